"""Batch- and head-sharded attention calls: the facade writes the ``shard_map`` for the user.

Attention is independent across batch rows and across head groups, so a call
sharded over B and N (with K sharded alike, which keeps each query head beside
its kv head: head n reads kv head ``n // (N // K)``, and a contiguous split of N
and K into d parts maps part i to part i) needs no communication. Sharding the
sequence needs communication: context parallelism (`_context_sharding`, which runs
`ring_attention` with the ring or all-gather strategy).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ejk_sequtils import AttentionRequest

from ._context_sharding import context_call
from ._shard_map import add_traced_seed, mesh_axes, shard_map_compat, shard_start

__all__ = ["inferred_mesh", "sharded_call"]


def _shards(mesh: Any, entry: Any) -> int:
    return math.prod(mesh.shape[a] for a in mesh_axes(entry))


def _qkv_spec(mesh: Any, in_specs: Any, request: AttentionRequest) -> tuple[Any, Any, Any]:
    """The ``(batch, seq, heads)`` entries of a ``[B, T, N, H]`` PartitionSpec, checked."""
    if not isinstance(mesh, Mesh | getattr(jax.sharding, "AbstractMesh", Mesh)):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if in_specs is None:
        in_specs = PartitionSpec(tuple(mesh.axis_names))
    if not isinstance(in_specs, PartitionSpec):
        raise TypeError(
            f"in_specs must be a PartitionSpec over q's [B, T, N, H] axes, got {in_specs!r}"
        )
    if len(in_specs) > 4:
        raise ValueError(f"in_specs has {len(in_specs)} entries, q has 4 axes [B, T, N, H]")
    entries = tuple(in_specs) + (None,) * (4 - len(in_specs))
    batch_axis, seq_axis, head_axis, dim_axis = entries
    if dim_axis is not None:
        raise ValueError(f"in_specs={in_specs} shards head_dim; shard B, T and N only")
    for axis in mesh_axes(batch_axis) + mesh_axes(seq_axis) + mesh_axes(head_axis):
        if axis not in mesh.shape:
            raise ValueError(
                f"in_specs={in_specs} names axis {axis!r}, not in mesh axes {mesh.axis_names}"
            )
    b, t, s, n, kh, _ = request.shape
    nb, nh, ns = _shards(mesh, batch_axis), _shards(mesh, head_axis), _shards(mesh, seq_axis)
    if b % nb:
        raise ValueError(f"in_specs={in_specs} splits batch {b} into {nb} shards, not evenly")
    if t % ns or s % ns:
        raise ValueError(
            f"in_specs={in_specs} splits the sequence (T={t}, S={s}) into {ns} shards, not evenly"
        )
    if n % nh or kh % nh:
        raise ValueError(
            f"in_specs={in_specs} splits q heads {n} and k/v heads {kh} into {nh} shards, not evenly"
        )
    return batch_axis, seq_axis, head_axis


def inferred_mesh(request: AttentionRequest) -> tuple[Any, PartitionSpec] | None:
    """``(mesh, spec)`` when q already has a batch/head NamedSharding that k and v can follow.

    Concrete arrays carry their sharding; under ``jit`` only Explicit mesh axes show it
    (``jax.typeof(q).sharding``). A sequence- or head_dim-sharded q, or one whose split
    does not divide the k/v heads, is left to XLA (None).
    """
    q = request.q
    if isinstance(q, jax.Array) and not isinstance(q, jax.core.Tracer):
        sharding = q.sharding
    elif hasattr(jax, "typeof"):
        sharding = getattr(jax.typeof(q), "sharding", None)
    else:  # pragma: no cover - jax < 0.6
        return None
    if not isinstance(sharding, NamedSharding) or getattr(sharding.mesh, "empty", False):
        return None
    spec = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))
    if spec[1] is not None or spec[3] is not None or (spec[0] is None and spec[2] is None):
        return None
    in_specs = PartitionSpec(spec[0], None, spec[2], None)
    try:
        _qkv_spec(sharding.mesh, in_specs, request)
    except ValueError:
        return None
    return sharding.mesh, in_specs


def sharded_call(
    compute: Callable[[AttentionRequest], Any],
    request: AttentionRequest,
    *,
    mesh: Any,
    in_specs: Any,
    out_specs: Any,
    implementation: tuple[str, ...] | None = None,
) -> Any:
    """Run ``compute(request)`` per shard of a batch/head sharded ``mesh``.

    Args:
        compute: the unsharded attention of one shard.
        request: the validated global request.
        mesh: a `jax.sharding.Mesh`.
        in_specs: a PartitionSpec over q's ``[B, T, N, H]``; k and v follow it (their K
            axis split like N). Default: batch over every mesh axis.
        out_specs: None (derived from ``in_specs``) or the output's PartitionSpec, which
            must equal q's spec (the output is laid out as q).
        implementation: the backends the call asked for (resolved), or None; a
            sequence-sharded call takes its steps' implementation from them.
    """
    batch_axis, seq_axis, head_axis = _qkv_spec(mesh, in_specs, request)
    qkv_spec = PartitionSpec(batch_axis, seq_axis, head_axis, None)
    if out_specs is not None and out_specs != qkv_spec and out_specs != tuple(qkv_spec):
        raise ValueError(f"out_specs={out_specs} must match q's spec {qkv_spec} (or be None)")
    if seq_axis is not None:
        return context_call(
            request,
            mesh=mesh,
            batch_axis=batch_axis,
            seq_axis=seq_axis,
            head_axis=head_axis,
            shards=_shards(mesh, seq_axis),
            shard_map=functools.partial(shard_map_compat, check=False),
            implementation=implementation,
        )
    if request.cu_seqlens_q is not None and batch_axis is not None:
        raise ValueError(
            f"packed input (cu_seqlens) has batch 1, it cannot be batch sharded by {in_specs}"
        )

    arrays: dict[str, Any] = {"q": request.q, "k": request.k, "v": request.v}
    specs: dict[str, Any] = {"q": qkv_spec, "k": qkv_spec, "v": qkv_spec}
    if request.bias is not None:
        bias = request.bias
        arrays["bias"] = bias
        specs["bias"] = PartitionSpec(
            batch_axis if bias.shape[0] > 1 else None, head_axis if bias.shape[1] > 1 else None
        )
    if request.softmax_sinks is not None:
        arrays["softmax_sinks"] = request.softmax_sinks
        specs["softmax_sinks"] = PartitionSpec(head_axis)
    if request.segment_ids is not None:
        arrays["segment_ids"] = request.segment_ids
        specs["segment_ids"] = (PartitionSpec(batch_axis), PartitionSpec(batch_axis))
    add_traced_seed(request, arrays, specs)
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        if getattr(request, name) is not None:
            arrays[name] = getattr(request, name)
            specs[name] = PartitionSpec()
    out_spec: Any = qkv_spec
    if request.return_lse:
        out_spec = (qkv_spec, PartitionSpec(batch_axis, head_axis, None))

    def per_shard(local: dict[str, Any]) -> Any:
        if request.dropout_rate > 0.0:
            # The counter hash is keyed on global (b, n, i, j): each shard draws its slice.
            b0 = shard_start(batch_axis, local["q"].shape[0])
            n0 = shard_start(head_axis, local["q"].shape[2])
            local["dropout_offsets"] = (b0, n0, 0, 0)
        return compute(dataclasses.replace(request, **local))

    # check=False: the kernels may be custom calls whose replication shard_map cannot infer.
    mapped = shard_map_compat(
        per_shard, mesh=mesh, in_specs=(specs,), out_specs=out_spec, check=False
    )
    return mapped(arrays)
