"""Mask preprocessing: a dense mask becomes the block tables the kernels prefetch into SMEM.

The attention grid walks ``(q block, kv block)`` pairs. For every pair the tables say
whether the block is empty (skip it: no DMA, no compute), full (compute without
evaluating the mask) or partial (apply one stored ``[block_q, block_kv]`` mask tile),
and which kv (forward, dq) or q (dkv) block to fetch at that step. A skipped step
fetches the same block as the step before it, so Pallas' pipeline issues no copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._masks import Mask, MultiHeadMask

__all__ = [
    "MaskInfo",
    "check_mask",
    "process_dynamic_mask",
    "process_dynamic_mask_dkv",
    "process_mask",
    "process_mask_dkv",
]

EMPTY, PARTIAL, FULL = 0, 1, 2

MaskFunction = Callable[[Any, Any], Any]
"""``f(q_ids, kv_ids) -> bool``: a mask's value at broadcasting query and key indices."""


class MaskInfo(NamedTuple):
    """Block tables of one mask for the block-sparse kernels (splash attention's layout).

    ``data_next``, ``mask_next`` and ``block_mask`` live in TPU scalar memory (SMEM),
    a scarce resource, so they are downcast to the smallest of int8/int16/int32 that
    holds their values. Their first axis has ``num_heads`` rows when the heads of a
    head shard use different masks, else ``head_shards`` rows (one per shard, shared
    by its heads). The other two axes are ``[q_blocks, kv_blocks]`` for every kernel;
    with ``shrink_grid`` the walked axis is shorter: kv for the forward and dq tables,
    q for the dkv tables (which the dkv kernel walks inside each kv block).

    Attributes:
        data_next: int ``[heads_or_shards, q_steps, kv_steps]``: the block index (kv for
            forward/dq, q for dkv) to fetch at each grid step. Empty steps of a static mask
            repeat the index of the nearest non-empty step, so no new copy is issued. For dkv
            with ``q_seq_shards`` the q indices are relative to the shard's first q block.
        mask_next: int, same shape: index into ``partial_mask_blocks`` of the tile of each
            partial block; None when no tile is stored (no partial block, or a mask function).
        block_mask: int8, same shape: 0 empty, 1 partial, 2 full.
        partial_mask_blocks: bool ``[num_partial, block_q, block_kv]``: the distinct partial
            tiles (dkv: transposed, ``[num_partial, block_kv, block_q]``); None when none is
            stored. A dynamic mask keeps every tile: ``[heads, q_blocks, kv_blocks, rows, cols]``.
        q_sequence: int32 ``[q_len]``: the query positions the mask function is evaluated at
            on a partial block (``arange(q_len)``), or None when partial tiles are stored.
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


def check_mask(mask: Mask) -> None:
    """Raises when a query row of ``mask`` sees no key (splash attention's mask check).

    ejk's kernels give such a row zeros (and zero gradients), so they do not need this;
    it is the check for code that wants splash's rejection (``reject_empty_rows=True`` in
    `blocksparse_attention` runs it on the static mask).

    Args:
        mask: a 2-d `Mask` or a `MultiHeadMask` (every head is checked).

    Raises:
        ValueError: naming the head and the first row that sees no key.
    """
    for head, m in enumerate(_as_heads(mask)):
        q_len = m.shape[0]
        for start in range(0, q_len, 512):
            rows = m[start : start + 512, :].any(axis=1)
            if not rows.all():
                row = start + int(np.flatnonzero(~rows)[0])
                raise ValueError(
                    f"row {row} of the mask (head {head}) sees no key: splash attention's "
                    "softmax would divide by zero there (ejk's kernels give such a row zeros)"
                )


def fill_next(active: Any) -> Any:
    """Per position of the last axis, the nearest active position at or before it.

    Positions before the first active one take the first active one (so the first
    step of a row already fetches the block it will need); rows without any active
    position take 0. ``active`` is a NumPy array (static tables) or a jax array (tables
    of a traced mask), and the answer is of the same kind.
    """
    length = active.shape[-1]
    if isinstance(active, jax.Array):
        idx = jnp.arange(length, dtype=jnp.int32)
        axis = active.ndim - 1
        last = jax.lax.cummax(jnp.where(active, idx, -1), axis=axis)
        first = jax.lax.cummin(jnp.where(active, idx, length), axis=axis, reverse=True)
        return jnp.where(last >= 0, last, jnp.where(first < length, first, 0))
    idx = np.arange(length, dtype=np.int32)
    last = np.maximum.accumulate(np.where(active, idx, -1), axis=-1)
    first = np.minimum.accumulate(np.where(active, idx, length)[..., ::-1], axis=-1)[..., ::-1]
    return np.where(last >= 0, last, np.where(first < length, first, 0))


def _shrink(bm: np.ndarray, pidx: np.ndarray, *, at_end: bool) -> tuple[np.ndarray, ...]:
    """Compacts the non-empty steps of each row of the last axis and cuts it to the longest.

    ``at_end``: the non-empty steps go last (the dkv tables, as splash attention pads them)
    instead of first. Returns the block classes, partial indices and block indices kept.
    """
    active = bm != EMPTY
    steps = max(1, int(active.sum(axis=-1).max()))
    if at_end:
        order = np.argsort(active, axis=-1, kind="stable")[..., -steps:]
    else:
        order = np.argsort(~active, axis=-1, kind="stable")[..., :steps]
    valid = np.take_along_axis(active, order, axis=-1)
    bm = np.where(valid, np.take_along_axis(bm, order, axis=-1), EMPTY)
    return bm, np.take_along_axis(pidx, order, axis=-1), order


def _tables(
    block_mask: np.ndarray,
    partial_index: np.ndarray,
    *,
    is_dkv: bool,
    q_seq_shards: int,
    shrink_grid: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int32 ``data_next``, ``mask_next``, ``block_mask`` from ``[h, q_blocks, kv_blocks]`` classes.

    The walked axis is kv for the forward/dq tables and q (split into ``q_seq_shards``
    shards, each indexed from its own first block) for dkv.
    """
    if is_dkv:
        # Walked axis last: [h, kv, q].
        block_mask = np.swapaxes(block_mask, 1, 2)
        partial_index = np.swapaxes(partial_index, 1, 2)
    shards = q_seq_shards if is_dkv else 1
    per_shard = block_mask.shape[-1] // shards
    parts = []
    for s in range(shards):
        cut = slice(s * per_shard, (s + 1) * per_shard)
        bm, pidx = block_mask[..., cut], partial_index[..., cut]
        block_index = np.broadcast_to(np.arange(per_shard, dtype=np.int32), bm.shape)
        if shrink_grid:
            bm, pidx, block_index = _shrink(bm, pidx, at_end=is_dkv)
        parts.append((bm, pidx, block_index))
    # Shards shrink on their own; pad the short ones at their end (splash's layout).
    width = max(p[0].shape[-1] for p in parts)
    out = []
    for bm, pidx, block_index in parts:
        pad = ((0, 0), (0, 0), (0, width - bm.shape[-1]))
        bm = np.pad(bm, pad, constant_values=EMPTY)
        pidx = np.pad(pidx, pad, mode="edge")
        block_index = np.pad(block_index, pad, mode="edge")
        data_next = np.take_along_axis(block_index, fill_next(bm != EMPTY), axis=-1)
        mask_next = np.take_along_axis(pidx, fill_next(bm == PARTIAL), axis=-1)
        out.append((data_next, mask_next, bm))
    tables = [np.concatenate(t, axis=-1).astype(np.int32) for t in zip(*out, strict=True)]
    if is_dkv:
        tables = [np.swapaxes(t, 1, 2) for t in tables]
    return tuple(np.ascontiguousarray(t) for t in tables)  # type: ignore[return-value]


def _downcast(array: Any, max_value: int, downcast: bool) -> Any:
    return array.astype(smallest_int_dtype(max(max_value, 0)) if downcast else np.int32)


def _as_heads(mask: Mask) -> tuple[Mask, ...]:
    if isinstance(mask, MultiHeadMask):
        return mask.masks
    if isinstance(mask, Mask):
        return (mask,)
    raise TypeError(f"mask must be a Mask or MultiHeadMask, got {type(mask).__name__}")


@functools.lru_cache(maxsize=64)
def _classify(mask: Mask, block_q: int, block_kv: int, is_dkv: bool, keep_tiles: bool = True):
    """Block classes of one 2-d mask and its distinct partial tiles (computed once per mask;
    none are kept without ``keep_tiles``: the kernels evaluate the mask function instead)."""
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
        if not keep_tiles:
            continue
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
    shrink_any_mask: bool = False,
) -> tuple[MaskInfo, MaskFunction | None]:
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
    shard_masks = [heads_masks[s * per_shard : (s + 1) * per_shard] for s in range(head_shards)]
    one_per_shard = all(len(set(ms)) == 1 for ms in shard_masks)
    rows = [ms[0] for ms in shard_masks] if one_per_shard else list(heads_masks)
    unique = list(dict.fromkeys(heads_masks))  # by value, in order of first appearance
    # One computable mask for every head (splash's rule): the kernels evaluate its function.
    mask_function = unique[0].mask_function if len(unique) == 1 else None

    # Distinct partial tiles of every mask, numbered in (mask, q block, kv block) order.
    tiles: list[np.ndarray] = []
    tile_ids: dict[bytes, int] = {}
    per_mask = {}
    for m in unique:
        cls, pidx, mtiles = _classify(m, block_q, block_kv, is_dkv, mask_function is None)
        remap = np.zeros(max(len(mtiles), 1), np.int64)
        for t, tile in enumerate(mtiles):
            remap[t] = tile_ids.setdefault(tile.tobytes(), len(tiles))
            if remap[t] == len(tiles):
                tiles.append(tile)
        per_mask[m] = (cls, remap[pidx])
    # One mask for all heads (splash's rule): the grid shrinks.
    single = len(unique) == 1 and len(rows) == head_shards
    data_next, mask_next, block_mask = _tables(
        np.stack([per_mask[m][0] for m in rows]),
        np.stack([per_mask[m][1] for m in rows]),
        is_dkv=is_dkv,
        q_seq_shards=q_seq_shards,
        shrink_grid=shrink_grid and (single or shrink_any_mask),
    )
    walked = q_len // block_q // q_seq_shards if is_dkv else kv_len // block_kv
    data_next = _downcast(data_next, walked - 1, downcast_smem_data)
    block_mask = block_mask.astype(np.int8 if downcast_smem_data else np.int32)
    if mask_function is not None:
        info = MaskInfo(data_next, None, block_mask, None, unique[0].q_sequence, False)
    elif tiles:
        partial = np.stack(tiles)
        mask_next = _downcast(mask_next, len(tiles) - 1, downcast_smem_data)
        info = MaskInfo(data_next, mask_next, block_mask, partial, None, False)
    else:
        info = MaskInfo(data_next, None, block_mask, None, None, False)
    return info, mask_function


_PROCESS_DOC = """Block tables of a static mask for the {kernels} (splash attention's `process_mask{suffix}`).

    Args:
        mask: a `Mask` of shape ``(T, S)`` (one mask for every head) or a `MultiHeadMask`.
        block_shape: ``(block_q, block_kv)``; each must divide its mask axis.
        is_dkv: build the dkv kernel's tables (default {is_dkv}; `process_mask_dkv` is this
            with True).
        downcast_smem_data: store the SMEM tables in the narrowest int type that fits.
        head_shards: number of shards of the head axis the kernel is launched over.
        q_seq_shards: number of shards of the query axis (must divide the q block count).
        shrink_grid: when one mask serves every head, compact each walked row's non-empty
            blocks (to the front for forward/dq, to the back for dkv) and cut the walked axis
            to the longest row: the grid has no all-empty steps; the block of a step is then
            its ``data_next``.

    Returns:
        ``(MaskInfo, mask_function)``: tables ``[heads_or_shards, T // block_q, S // block_kv]``
        (the walked axis shorter after shrinking). ``mask_function`` is the mask's
        ``f(q_ids, kv_ids)`` when one computable mask (causal, local, chunked and their
        ``&``/``|``) serves every head: then ``q_sequence`` is set and no tile is stored
        (``mask_next`` and ``partial_mask_blocks`` are None); else None.

    Raises:
        ValueError: a block size does not divide the mask shape, or a shard count is invalid.
    """


def process_mask(
    mask: Mask,
    block_shape: tuple[int, int],
    *,
    is_dkv: bool = False,
    downcast_smem_data: bool = True,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    shrink_grid: bool = True,
) -> tuple[MaskInfo, MaskFunction | None]:
    return _process(
        mask,
        block_shape,
        is_dkv=is_dkv,
        downcast_smem_data=downcast_smem_data,
        head_shards=head_shards,
        q_seq_shards=q_seq_shards,
        shrink_grid=shrink_grid,
    )


# The seed's pair: one function, is_dkv's default set (as splash attention defines them).
process_mask_dkv = functools.partial(process_mask, is_dkv=True)
process_mask.__doc__ = _PROCESS_DOC.format(
    kernels="forward and dq kernels", suffix="", is_dkv="False"
)
process_mask_dkv.__doc__ = _PROCESS_DOC.format(
    kernels="dkv kernel (it walks q blocks inside each kv block)", suffix="_dkv", is_dkv="True"
)


def _process_dynamic(
    mask: Any,
    block_shape: tuple[int, int],
    *,
    is_dkv: bool,
    downcast_smem_data: bool,
    head_shards: int,
    q_seq_shards: int,
) -> tuple[MaskInfo, None]:
    if getattr(mask, "ndim", None) != 3:
        raise ValueError(
            f"a dynamic mask must be a [heads, T, S] array, got shape {getattr(mask, 'shape', None)}"
        )
    if mask.dtype != jnp.bool_:
        raise ValueError(f"a dynamic mask must have dtype bool, got {mask.dtype}")
    heads = mask.shape[0]
    q_blocks, kv_blocks = _check_blocks(mask.shape, block_shape, head_shards, q_seq_shards)
    block_q, block_kv = int(block_shape[0]), int(block_shape[1])
    blocks = jnp.asarray(mask).reshape(heads, q_blocks, block_q, kv_blocks, block_kv)
    blocks = blocks.swapaxes(2, 3)  # [h, qb, kb, block_q, block_kv]
    anyb = blocks.any(axis=(3, 4))
    allb = blocks.all(axis=(3, 4))
    block_mask = jnp.where(allb, FULL, jnp.where(anyb, PARTIAL, EMPTY)).astype(jnp.int32)
    # The tile contents are unknown at trace time: every tile is kept, uncollapsed, and a
    # partial block points at its own tile, numbered in [head, q block, kv block] order
    # within its (head shard, q shard) slice (splash's layout, so a shard holds its tiles).
    heads_per_shard, q_per_shard = heads // head_shards, q_blocks // q_seq_shards
    local = jnp.arange(heads_per_shard * q_per_shard * kv_blocks, dtype=jnp.int32)
    local = jnp.tile(
        local.reshape(heads_per_shard, q_per_shard, kv_blocks), (head_shards, q_seq_shards, 1)
    )
    mask_next = jnp.where(block_mask == PARTIAL, local, 0)
    # An empty block fetches block 0, as in splash attention (the tables are traced).
    if is_dkv:
        index = jnp.arange(q_blocks, dtype=jnp.int32)[None, :, None] % q_per_shard
        blocks = blocks.swapaxes(3, 4)
    else:
        index = jnp.arange(kv_blocks, dtype=jnp.int32)[None, None, :]
    data_next = jnp.where(block_mask == EMPTY, 0, jnp.broadcast_to(index, block_mask.shape))
    walked = q_per_shard if is_dkv else kv_blocks
    info = MaskInfo(
        _downcast(data_next, walked - 1, downcast_smem_data),
        _downcast(mask_next, local.size - 1, downcast_smem_data),
        block_mask.astype(jnp.int8 if downcast_smem_data else jnp.int32),
        blocks,
        None,
        True,
    )
    return info, None


_DYNAMIC_DOC = """Block tables of a (possibly traced) dense mask ``[heads, T, S]`` for the {kernels}.

    The tile contents are unknown at trace time, so every tile is kept, uncollapsed:
    ``partial_mask_blocks`` is ``[heads, T // block_q, S // block_kv, rows, cols]`` (dkv:
    tiles transposed) and ``mask_next`` holds each partial block's flat index in its (head
    shard, q shard) slice. Empty blocks are still skipped. Tables ``[heads, q_blocks,
    kv_blocks]``; ``data_next`` is the block's own index (0 for an empty block).

    Args:
        mask: bool ``[heads, T, S]``, traced or concrete.
        block_shape, is_dkv (default {is_dkv}), downcast_smem_data, head_shards,
            q_seq_shards: as in `process_mask`.
        shrink_grid: accepted for splash attention's signature and ignored (a traced mask's
            non-empty counts are unknown at trace time).

    Returns:
        ``(MaskInfo, None)``.
    """


def process_dynamic_mask(
    mask: jax.Array,
    block_shape: tuple[int, int],
    *,
    is_dkv: bool = False,
    downcast_smem_data: bool = True,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    shrink_grid: bool = True,
) -> tuple[MaskInfo, None]:
    del shrink_grid
    return _process_dynamic(
        mask,
        block_shape,
        is_dkv=is_dkv,
        downcast_smem_data=downcast_smem_data,
        head_shards=head_shards,
        q_seq_shards=q_seq_shards,
    )


process_dynamic_mask_dkv = functools.partial(process_dynamic_mask, is_dkv=True)
process_dynamic_mask.__doc__ = _DYNAMIC_DOC.format(kernels="forward and dq kernels", is_dkv="False")
process_dynamic_mask_dkv.__doc__ = _DYNAMIC_DOC.format(kernels="dkv kernel", is_dkv="True")
