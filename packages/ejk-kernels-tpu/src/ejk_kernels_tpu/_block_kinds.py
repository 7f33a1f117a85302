"""Block tables from a per-block kinds table (empty / partial / full), as a flex `BlockMask` holds.

A kinds table ``[B', N', Tb, Sb]`` summarises a mask at its own block size; the kernels
walk their own blocks over padded lengths. `rescale_kinds` re-cuts the table to the
kernels' blocks (exactly where one size divides the other, conservatively otherwise: a
kernel block is full only when every mask block it touches is full, empty only when every
one is empty), and `block_kind_info` turns it into the `MaskInfo` the kernels prefetch:
partial blocks evaluate the mask function (no tile is stored), empty ones are skipped.
The tables may be traced (a mask built under ``jax.jit``), so nothing here shrinks the
grid: an empty step repeats the previous step's block, so it issues no copy.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ._mask_info import EMPTY, FULL, PARTIAL, MaskInfo, fill_next, smallest_int_dtype

__all__ = ["block_kind_info", "rescale_kinds"]


def _rescale_axis(
    kinds: Int[Array, "*blocks"], axis: int, block: int, new_block: int, length: int, padded: int
) -> Int[Array, "*new_blocks"]:
    """``kinds`` along ``axis`` (blocks of ``block`` over ``length``) as blocks of
    ``new_block`` over ``padded``; a new block holding padding is never full."""
    fine = math.gcd(block, new_block)
    # Cut to blocks of `fine` (each keeps its block's kind), then group them.
    kinds = jnp.repeat(kinds, block // fine, axis=axis)
    n_fine = padded // fine
    starts = jnp.arange(n_fine) * fine
    seen = starts < length  # fine blocks holding a real position
    whole = starts + fine <= length  # ... and no padding
    kinds = jax.lax.slice_in_dim(kinds, 0, min(kinds.shape[axis], n_fine), axis=axis)
    pad = [(0, 0)] * kinds.ndim
    pad[axis] = (0, n_fine - kinds.shape[axis])
    kinds = jnp.pad(kinds, pad, constant_values=EMPTY)
    shape = list(kinds.shape)
    shape[axis : axis + 1] = [n_fine // (new_block // fine), new_block // fine]
    where = [None] * kinds.ndim
    where[axis] = slice(None)
    seen, whole = (
        jnp.broadcast_to(x[tuple(where)], kinds.shape).reshape(shape) for x in (seen, whole)
    )
    kinds = kinds.reshape(shape)
    any_seen = jnp.any((kinds != EMPTY) & seen, axis=axis + 1)
    all_full = jnp.all((kinds == FULL) & whole, axis=axis + 1)
    return jnp.where(all_full, FULL, jnp.where(any_seen, PARTIAL, EMPTY)).astype(jnp.int8)


def rescale_kinds(
    kinds: Int[Array, "B N Tb Sb"],
    block: tuple[int, int],
    new_block: tuple[int, int],
    lengths: tuple[int, int],
    padded: tuple[int, int],
) -> Int[Array, "B N Tb2 Sb2"]:
    """int8 kinds of blocks ``new_block`` over ``padded`` lengths, from ``kinds`` of ``block``.

    Args:
        kinds: int8 ``[B', N', ceil(T / block_q), ceil(S / block_kv)]`` (0 empty, 1 partial,
            2 full), each block classified on its positions inside ``lengths`` only.
        block: ``(block_q, block_kv)`` of ``kinds``.
        new_block: the kernel's ``(block_q, block_kv)``; they divide ``padded``.
        lengths: ``(T, S)``.
        padded: ``(Tp, Sp)``, the kernel's padded lengths.

    Returns:
        int8 ``[B', N', Tp // new_block_q, Sp // new_block_kv]``; a block holding a padding
        position is partial or empty (the kernels' length check hides the padding).
    """
    for axis in (0, 1):
        kinds = _rescale_axis(
            kinds, 2 + axis, block[axis], new_block[axis], lengths[axis], padded[axis]
        )
    return kinds


def block_kind_info(kinds: Int[Array, "R Tb Sb"], *, is_dkv: bool) -> MaskInfo:
    """The kernels' tables from a kinds table ``[rows, q_blocks, kv_blocks]`` (traced or not).

    Args:
        kinds: int8 kinds per table row (a ``(b, h)`` pair, or one row for all).
        is_dkv: the dkv kernel's tables (its walked axis is q) instead of forward / dq.

    Returns:
        `MaskInfo` with ``data_next`` (the block each step fetches: its own, or for an
        empty step the previous visited one), ``block_mask`` and no tiles; ``q_sequence``
        None (the kernels take positions from the grid).
    """
    walked = kinds.shape[1] if is_dkv else kinds.shape[2]
    if is_dkv:
        kinds = jnp.swapaxes(kinds, 1, 2)
    data_next = fill_next(kinds != EMPTY)
    if is_dkv:
        kinds, data_next = jnp.swapaxes(kinds, 1, 2), jnp.swapaxes(data_next, 1, 2)
    data_next = data_next.astype(smallest_int_dtype(max(walked - 1, 0)))
    return MaskInfo(data_next, None, kinds.astype(jnp.int8), None, None, True)
