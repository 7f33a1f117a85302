"""``shard_map`` helpers shared by the batch/head-sharded calls and context parallelism."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ejk_sequtils import AttentionRequest

__all__ = ["add_traced_seed", "mesh_axes", "shard_map_compat", "shard_start"]


def shard_map_compat(
    fn: Callable, *, mesh: Any, in_specs: Any, out_specs: Any, check: bool = True
) -> Callable:
    """``jax.shard_map`` where it exists (jax >= 0.7), else the experimental one."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map

    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check)


def mesh_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def shard_start(entry: Any, local_size: int) -> Any:
    """Inside ``shard_map``: the global index of this shard's first element on an axis
    split over the mesh axes ``entry`` (a name, a tuple of names, or None) into blocks of
    ``local_size`` (int32; 0 where the axis is not split)."""
    axes = mesh_axes(entry)
    if not axes:
        return jnp.int32(0)
    return jax.lax.axis_index(axes if len(axes) > 1 else axes[0]) * jnp.int32(local_size)


def add_traced_seed(request: AttentionRequest, arrays: dict, specs: dict) -> None:
    """A traced ``dropout_seed`` enters a facade's ``shard_map`` as a replicated input (a
    Python int stays a constant of the request)."""
    if isinstance(request.dropout_seed, jax.Array):
        arrays["dropout_seed"] = request.dropout_seed
        specs["dropout_seed"] = PartitionSpec()
