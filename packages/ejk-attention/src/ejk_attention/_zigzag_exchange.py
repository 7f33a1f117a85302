"""The zigzag layout reached inside a ``shard_map``: two ``ppermute``s, no global gather.

Split contiguously over ``n`` devices, device ``i`` holds global chunks ``2i`` and ``2i+1``
(of ``2n``); in the zigzag layout (`ejk_sequtils.to_zigzag`) it holds chunks ``i`` and
``2n-1-i``. Chunk ``c`` lives in the zigzag layout on device ``c`` (its first half) when
``c < n``, else on device ``2n-1-c`` (its second half). The even chunks of all devices go
to distinct devices, and so do the odd ones, so the exchange is one ``ppermute`` of each
device's first half and one of its second half: every device sends and receives its block
once, at NVLink speed, and the transpose (for gradients) is the inverse ``ppermute``.
Laying the global array out with `ejk_sequtils.to_zigzag` instead leaves XLA a gather
across the shards, whose gradient it partitions as a scatter and an all-reduce of the
whole array (measured on two H200s: docs/performance-history.md, "2026-11-27 (twelfth and
thirteenth sessions)").
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejk_sequtils import zigzag_chunks

__all__ = ["from_zigzag_local", "to_zigzag_local"]


def _pairs(shards: int, parity: int) -> list[tuple[int, int]]:
    """(source, destination) of the chunks ``2i + parity``, contiguous to zigzag (the
    device holding a chunk in the zigzag layout is its slot in `zigzag_chunks` over 2)."""
    home = {chunk: slot // 2 for slot, chunk in enumerate(zigzag_chunks(shards))}
    return [(i, home[2 * i + parity]) for i in range(shards)]


def _halves(x: Any, axis: int) -> tuple[Any, Any]:
    half = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, half, axis=axis), jax.lax.slice_in_dim(
        x, half, None, axis=axis
    )


def _even_first(axis_name: Any) -> Any:
    """Whether this device's first zigzag chunk (chunk ``i``) is the even one."""
    return jax.lax.axis_index(axis_name) % 2 == 0


def to_zigzag_local(x: Any, *, axis_name: Any, shards: int, axis: int = 1) -> Any:
    """A device's contiguous block of ``x`` along ``axis`` replaced by its zigzag block.

    Call inside a ``shard_map`` over ``axis_name`` (``shards`` devices), ``x`` holding the
    device's ``[i T, (i+1) T)`` slice of the sequence, ``T`` even.
    """
    first, second = _halves(x, axis)
    even = jax.lax.ppermute(first, axis_name, perm=_pairs(shards, 0))
    odd = jax.lax.ppermute(second, axis_name, perm=_pairs(shards, 1))
    keep = _even_first(axis_name)
    return jnp.concatenate([jnp.where(keep, even, odd), jnp.where(keep, odd, even)], axis=axis)


def from_zigzag_local(x: Any, *, axis_name: Any, shards: int, axis: int = 1) -> Any:
    """The inverse of `to_zigzag_local`: a device's zigzag block back to its contiguous one."""
    first, second = _halves(x, axis)
    keep = _even_first(axis_name)
    even, odd = jnp.where(keep, first, second), jnp.where(keep, second, first)
    back = lambda pairs: [(dst, src) for src, dst in pairs]
    home_even = jax.lax.ppermute(even, axis_name, perm=back(_pairs(shards, 0)))
    home_odd = jax.lax.ppermute(odd, axis_name, perm=back(_pairs(shards, 1)))
    return jnp.concatenate([home_even, home_odd], axis=axis)
