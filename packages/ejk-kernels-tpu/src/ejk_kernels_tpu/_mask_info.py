"""Mask preprocessing: a dense mask becomes the block tables the kernels prefetch into SMEM.

The attention grid walks ``(q block, kv block)`` pairs. For every pair the tables say
whether the block is empty (skip it: no DMA, no compute), full (compute without
evaluating the mask) or partial (apply one stored ``[block_q, block_kv]`` mask tile),
and which kv (forward, dq) or q (dkv) block to fetch at that step. A skipped step
fetches the same block as the step before it, so Pallas' pipeline issues no copy.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._masks import Mask, MultiHeadMask

__all__ = [
    "MaskInfo",
    "process_dynamic_mask",
    "process_dynamic_mask_dkv",
    "process_mask",
    "process_mask_dkv",
]

EMPTY, PARTIAL, FULL = 0, 1, 2


class MaskInfo(NamedTuple):
    """Block tables of one mask for the block-sparse kernels.

    ``data_next``, ``mask_next`` and ``block_mask`` live in TPU scalar memory (SMEM),
    a scarce resource, so they are downcast to the smallest of int8/int16/int32 that
    holds their values. Their first axis has ``num_heads`` rows when the heads of a
    head shard use different masks, else ``head_shards`` rows (one per shard, shared
    by its heads). The other two axes are ``[q_blocks, kv_blocks]`` for the forward
    and dq kernels and ``[kv_blocks, q_blocks]`` for the dkv kernel (its grid order).

    Attributes:
        data_next: int ``[heads_or_shards, outer, inner]``: the block index (kv for
            forward/dq, q for dkv) to fetch at each grid step. Empty steps repeat the
            index of the nearest non-empty step, so no new copy is issued. For dkv with
            ``q_seq_shards`` the q indices are relative to the shard's first q block.
        mask_next: int ``[heads_or_shards, outer, inner]``: index into
            ``partial_mask_blocks`` of the tile for each partial block.
        block_mask: int ``[heads_or_shards, outer, inner]``: 0 empty, 1 partial, 2 full.
        partial_mask_blocks: bool ``[num_partial, rows, cols]``: the distinct partial
            tiles, ``[block_q, block_kv]`` (forward/dq) or transposed ``[block_kv, block_q]``
            (dkv). A dynamic mask keeps every tile: ``[heads, outer, inner, rows, cols]``.
        q_sequence: None: these kernels read every partial tile from memory
            instead of evaluating a mask function on query positions.
        is_dynamic_mask: True when built by `process_dynamic_mask` from a traced array.
    """

    data_next: Any
    mask_next: Any
    block_mask: Any
    partial_mask_blocks: Any
    q_sequence: Any
    is_dynamic_mask: bool = False


def smallest_int_dtype(max_value: int) -> np.dtype:
    """The narrowest of int8, int16, int32 holding ``0..max_value``."""
    for dtype in (np.int8, np.int16, np.int32):
        if max_value <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"{max_value=} does not fit in int32 scalar memory")


def _check_blocks(
    shape: tuple[int, ...],
    block_shape: tuple[int, int],
    head_shards: int,
    q_seq_shards: int,
) -> tuple[int, int]:
    """Validates block sizes and shard counts; returns ``(q_blocks, kv_blocks)``."""
    heads, q_len, kv_len = shape
    if not isinstance(block_shape, tuple | list) or len(block_shape) != 2:
        raise ValueError(f"block_shape must be (block_q, block_kv), got {block_shape!r}")
    block_q, block_kv = block_shape
    for name, b in (("block_q", block_q), ("block_kv", block_kv)):
        if not isinstance(b, int | np.integer) or b <= 0:
            raise ValueError(f"{name} must be a positive int, got {b!r}")
    if q_len % block_q:
        raise ValueError(f"{block_q=} must divide the mask's q_len={q_len}")
    if kv_len % block_kv:
        raise ValueError(f"{block_kv=} must divide the mask's kv_len={kv_len}")
    if not isinstance(head_shards, int) or head_shards <= 0 or heads % head_shards:
        raise ValueError(f"{head_shards=} must be a positive divisor of the mask's {heads=}")
    q_blocks = q_len // block_q
    if not isinstance(q_seq_shards, int) or q_seq_shards <= 0 or q_blocks % q_seq_shards:
        raise ValueError(f"{q_seq_shards=} must be a positive divisor of {q_blocks=}")
    return q_blocks, kv_len // block_kv


def _fill_next(active: Any, xp: Any) -> Any:
    """Per position of the last axis, the nearest active position at or before it.

    Positions before the first active one take the first active one (so the first
    step of a row already fetches the block it will need); rows without any active
    position take 0. ``xp`` is numpy or jax.numpy.
    """
    length = active.shape[-1]
    idx = xp.arange(length, dtype=xp.int32)
    if xp is np:
        last = np.maximum.accumulate(np.where(active, idx, -1), axis=-1)
        first = np.minimum.accumulate(np.where(active, idx, length)[..., ::-1], axis=-1)[..., ::-1]
    else:
        last = jax.lax.cummax(jnp.where(active, idx, -1), axis=active.ndim - 1)
        first = jax.lax.cummin(jnp.where(active, idx, length), axis=active.ndim - 1, reverse=True)
    return xp.where(last >= 0, last, xp.where(first < length, first, 0))


def _tables(
    block_mask: Any,
    partial_index: Any,
    *,
    is_dkv: bool,
    q_seq_shards: int,
    downcast: bool,
    num_partial: int,
    xp: Any,
    shrink_grid: bool = False,
) -> tuple[Any, Any, Any]:
    """``data_next``, ``mask_next``, ``block_mask`` from ``[h, q_blocks, kv_blocks]`` tables."""
    if is_dkv:
        # The dkv kernel walks q blocks inside each kv block: tables are [h, kv, q].
        block_mask = xp.swapaxes(block_mask, 1, 2)
        partial_index = xp.swapaxes(partial_index, 1, 2)
    heads, outer, inner = block_mask.shape
    shards = q_seq_shards if is_dkv else 1
    per_shard = inner // shards
    # Split the walked axis into shards: each shard fills (and counts) on its own.
    bm = block_mask.reshape(heads, outer, shards, per_shard)
    pidx = partial_index.reshape(heads, outer, shards, per_shard)
    block_index = xp.broadcast_to(xp.arange(per_shard, dtype=xp.int32), bm.shape)
    if shrink_grid:
        # Move each row's non-empty steps to the front (in order) and cut the walked axis
        # to the longest row: the grid then has no all-empty tail steps.
        active = bm != EMPTY
        steps = max(1, int(active.sum(axis=-1).max()))
        order = np.argsort(~active, axis=-1, kind="stable")[..., :steps]
        valid = np.take_along_axis(active, order, axis=-1)
        bm = np.where(valid, np.take_along_axis(bm, order, axis=-1), EMPTY)
        pidx = np.take_along_axis(pidx, order, axis=-1)
        block_index = order
    data_next = xp.take_along_axis(block_index, _fill_next(bm != EMPTY, xp), axis=-1)
    mask_next = xp.take_along_axis(pidx, _fill_next(bm == PARTIAL, xp), axis=-1)
    walked = shards * bm.shape[-1]
    data_next = data_next.reshape(heads, outer, walked)
    mask_next = mask_next.reshape(heads, outer, walked)
    block_mask = bm.reshape(heads, outer, walked)
    if downcast:
        d_type = smallest_int_dtype(max(per_shard - 1, 0))
        m_type = smallest_int_dtype(max(num_partial - 1, 0))
        b_type = np.int8
    else:
        d_type = m_type = b_type = np.int32
    return data_next.astype(d_type), mask_next.astype(m_type), block_mask.astype(b_type)


def _as_heads(mask: Mask) -> tuple[Mask, ...]:
    if isinstance(mask, MultiHeadMask):
        return mask.masks
    if isinstance(mask, Mask):
        return (mask,)
    raise TypeError(f"mask must be a Mask or MultiHeadMask, got {type(mask).__name__}")


@functools.lru_cache(maxsize=64)
def _classify(mask: Mask, block_q: int, block_kv: int, is_dkv: bool):
    """Block classes of one 2-d mask and its distinct partial tiles (computed once per mask)."""
    q_len, kv_len = mask.shape
    q_blocks, kv_blocks = q_len // block_q, kv_len // block_kv
    classes = np.zeros((q_blocks, kv_blocks), np.int8)
    tiles: list[np.ndarray] = []
    tile_ids: dict[bytes, int] = {}
    partial_index = np.zeros((q_blocks, kv_blocks), np.int64)
    for i in range(q_blocks):
        rows = mask[i * block_q : (i + 1) * block_q, :]
        blocks = rows.reshape(block_q, kv_blocks, block_kv).transpose(1, 0, 2)
        anyb = blocks.any(axis=(1, 2))
        allb = blocks.all(axis=(1, 2))
        classes[i] = np.where(allb, FULL, np.where(anyb, PARTIAL, EMPTY))
        for j in np.flatnonzero(anyb & ~allb):
            tile = blocks[j].T if is_dkv else blocks[j]
            key = tile.tobytes()
            if key not in tile_ids:
                tile_ids[key] = len(tiles)
                tiles.append(np.ascontiguousarray(tile))
            partial_index[i, j] = tile_ids[key]
    return classes, partial_index, tuple(tiles)


def _process(
    mask: Mask,
    block_shape: tuple[int, int],
    *,
    is_dkv: bool,
    downcast_smem_data: bool,
    head_shards: int,
    q_seq_shards: int,
    shrink_grid: bool,
) -> MaskInfo:
    heads_masks = _as_heads(mask)
    heads = len(heads_masks)
    q_len, kv_len = heads_masks[0].shape
    if heads == 1 and head_shards > 1:
        # One mask for every head: each shard gets its own (identical) row.
        heads_masks = heads_masks * head_shards
        heads = head_shards
    _check_blocks((heads, q_len, kv_len), block_shape, head_shards, q_seq_shards)
    block_q, block_kv = int(block_shape[0]), int(block_shape[1])

    # Heads of a shard sharing one mask share one table row.
    per_shard = heads // head_shards
    uniform = all(
        all(
            m == heads_masks[s * per_shard]
            for m in heads_masks[s * per_shard : (s + 1) * per_shard]
        )
        for s in range(head_shards)
    )
    rows = heads_masks[::per_shard] if uniform else heads_masks

    tiles: list[np.ndarray] = []
    tile_ids: dict[bytes, int] = {}
    classes, partial_index = [], []
    for m in rows:
        cls, pidx, mtiles = _classify(m, block_q, block_kv, is_dkv)
        # Renumber this mask's tiles into the shared, deduplicated list.
        remap = np.zeros(max(len(mtiles), 1), np.int64)
        for t, tile in enumerate(mtiles):
            key = tile.tobytes()
            if key not in tile_ids:
                tile_ids[key] = len(tiles)
                tiles.append(tile)
            remap[t] = tile_ids[key]
        classes.append(cls)
        partial_index.append(remap[pidx])
    data_next, mask_next, block_mask = _tables(
        np.stack(classes),
        np.stack(partial_index),
        is_dkv=is_dkv,
        q_seq_shards=q_seq_shards,
        downcast=downcast_smem_data,
        num_partial=len(tiles),
        xp=np,
        shrink_grid=shrink_grid,
    )
    tile_shape = (block_kv, block_q) if is_dkv else (block_q, block_kv)
    partial = np.stack(tiles) if tiles else np.zeros((0, *tile_shape), bool)
    return MaskInfo(data_next, mask_next, block_mask, partial, None, False)


def process_mask(
    mask: Mask,
    block_shape: tuple[int, int],
    *,
    downcast_smem_data: bool = True,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    shrink_grid: bool = False,
) -> MaskInfo:
    """Block tables of a static mask for the forward and dq kernels.

    Args:
        mask: a `Mask` of shape ``(T, S)`` (one mask for every head) or a `MultiHeadMask`.
        block_shape: ``(block_q, block_kv)``; each must divide its mask axis.
        downcast_smem_data: store the SMEM tables in the narrowest int type that fits.
        head_shards: number of shards of the head axis the kernel is launched over.
        q_seq_shards: number of shards of the query axis (must divide the q block count).
        shrink_grid: compact each row's non-empty blocks to the front and cut the walked
            axis to the longest row, so the kernel's grid has no all-empty tail; the
            block at step t is then ``data_next[..., t]``.

    Returns:
        `MaskInfo` with tables ``[heads_or_shards, T // block_q, S // block_kv]`` (the last
        axis shorter with ``shrink_grid``).

    Raises:
        ValueError: a block size does not divide the mask shape, or a shard count is invalid.
    """
    return _process(
        mask,
        block_shape,
        is_dkv=False,
        downcast_smem_data=downcast_smem_data,
        head_shards=head_shards,
        q_seq_shards=q_seq_shards,
        shrink_grid=shrink_grid,
    )


def process_mask_dkv(
    mask: Mask,
    block_shape: tuple[int, int],
    *,
    downcast_smem_data: bool = True,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    shrink_grid: bool = False,
) -> MaskInfo:
    """Block tables of a static mask for the dkv kernel (kv blocks outer, q blocks inner).

    Args and errors as `process_mask`; ``data_next`` holds q block indices, relative to the
    first q block of each of the ``q_seq_shards`` shards, and the partial tiles are
    transposed to ``[block_kv, block_q]``.

    Returns:
        `MaskInfo` with tables ``[heads_or_shards, S // block_kv, T // block_q]`` (the last
        axis shorter with ``shrink_grid``: ``q_seq_shards`` times the longest shard row).
    """
    return _process(
        mask,
        block_shape,
        is_dkv=True,
        downcast_smem_data=downcast_smem_data,
        head_shards=head_shards,
        q_seq_shards=q_seq_shards,
        shrink_grid=shrink_grid,
    )


def _process_dynamic(
    mask: Any,
    block_shape: tuple[int, int],
    *,
    is_dkv: bool,
    downcast_smem_data: bool,
    head_shards: int,
    q_seq_shards: int,
) -> MaskInfo:
    if getattr(mask, "ndim", None) != 3:
        raise ValueError(
            f"a dynamic mask must be a [heads, T, S] array, got shape {getattr(mask, 'shape', None)}"
        )
    heads = mask.shape[0]
    q_blocks, kv_blocks = _check_blocks(mask.shape, block_shape, head_shards, q_seq_shards)
    block_q, block_kv = int(block_shape[0]), int(block_shape[1])
    blocks = jnp.asarray(mask, bool).reshape(heads, q_blocks, block_q, kv_blocks, block_kv)
    blocks = blocks.transpose(0, 1, 3, 2, 4)  # [h, qb, kb, block_q, block_kv]
    anyb = blocks.any(axis=(3, 4))
    allb = blocks.all(axis=(3, 4))
    classes = jnp.where(allb, FULL, jnp.where(anyb, PARTIAL, EMPTY))
    # Every tile is kept (its content is unknown at trace time), indexed in grid order.
    if is_dkv:
        blocks = blocks.transpose(0, 2, 1, 4, 3)  # [h, kb, qb, block_kv, block_q]
        order = jnp.arange(heads * kv_blocks * q_blocks, dtype=jnp.int32)
        partial_index = order.reshape(heads, kv_blocks, q_blocks).swapaxes(1, 2)
    else:
        order = jnp.arange(heads * q_blocks * kv_blocks, dtype=jnp.int32)
        partial_index = order.reshape(heads, q_blocks, kv_blocks)
    data_next, mask_next, block_mask = _tables(
        classes,
        partial_index,
        is_dkv=is_dkv,
        q_seq_shards=q_seq_shards,
        downcast=downcast_smem_data,
        num_partial=heads * q_blocks * kv_blocks,
        xp=jnp,
    )
    return MaskInfo(data_next, mask_next, block_mask, blocks, None, True)


def process_dynamic_mask(
    mask: jax.Array,
    block_shape: tuple[int, int],
    *,
    downcast_smem_data: bool = True,
    head_shards: int = 1,
    q_seq_shards: int = 1,
) -> MaskInfo:
    """Block tables of a (possibly traced) dense mask ``[heads, T, S]`` for forward and dq.

    The tile contents are unknown at trace time, so every tile is kept, uncollapsed:
    ``partial_mask_blocks`` is ``[heads, T // block_q, S // block_kv, block_q, block_kv]``
    and ``mask_next`` holds the flat index of each tile. Empty blocks are still skipped.

    Args and errors as `process_mask`.
    """
    return _process_dynamic(
        mask,
        block_shape,
        is_dkv=False,
        downcast_smem_data=downcast_smem_data,
        head_shards=head_shards,
        q_seq_shards=q_seq_shards,
    )


def process_dynamic_mask_dkv(
    mask: jax.Array,
    block_shape: tuple[int, int],
    *,
    downcast_smem_data: bool = True,
    head_shards: int = 1,
    q_seq_shards: int = 1,
) -> MaskInfo:
    """`process_dynamic_mask` for the dkv kernel: tables ``[heads, S // block_kv, T // block_q]``.

    ``partial_mask_blocks`` is ``[heads, S // block_kv, T // block_q, block_kv, block_q]``.
    """
    return _process_dynamic(
        mask,
        block_shape,
        is_dkv=True,
        downcast_smem_data=downcast_smem_data,
        head_shards=head_shards,
        q_seq_shards=q_seq_shards,
    )
