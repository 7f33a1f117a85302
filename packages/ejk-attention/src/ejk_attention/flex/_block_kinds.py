"""Block kinds of ejk's own mask_mods from their definitions, without evaluating every element.

`create_block_mask` would otherwise evaluate a mask_mod at all ``T x S`` positions (17
billion at T = 128k). ejk's mods say more than their values: causal and windows depend
on ``q_idx - kv_idx`` alone, a prefix on ``kv_idx`` against a length, documents on the
smallest and largest id in a block. From that, every block is classified from its
first and last positions (and id ranges) as empty, full or partial where that is
certain, and *unknown* where it is not: two partial operands of `and_masks` /
`or_masks`, a user's own function, document ids that are not sorted. Only the unknown
blocks are then evaluated element by element, a chunk of them per loop step. The result
equals the element-wise one exactly (tests compare them on random masks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array
from jax.tree_util import Partial
from jaxtyping import Bool, Int

from . import _mods
from ._evaluate import mask_grid

__all__ = ["UNKNOWN", "Blocks", "analytic_kinds", "block_kinds_of", "refine_unknown"]

EMPTY, PARTIAL, FULL = 0, 1, 2
UNKNOWN = 3  # not decided from the definition: evaluated element by element


class Blocks(NamedTuple):
    """The block grid: each block's first and last in-range position, along each axis."""

    q_first: Int[Array, "Tb 1"]
    q_last: Int[Array, "Tb 1"]
    kv_first: Int[Array, "1 Sb"]
    kv_last: Int[Array, "1 Sb"]
    q_block: int
    kv_block: int
    q_len: int
    kv_len: int

    @classmethod
    def of(cls, q_len: int, kv_len: int, q_block: int, kv_block: int) -> Blocks:
        def bounds(length: int, block: int) -> tuple[Array, Array]:
            first = jnp.arange(0, length, block, dtype=jnp.int32)
            return first, jnp.minimum(first + block, length) - 1

        q_first, q_last = bounds(q_len, q_block)
        kv_first, kv_last = bounds(kv_len, kv_block)
        return cls(q_first[:, None], q_last[:, None], kv_first[None], kv_last[None],
                   q_block, kv_block, q_len, kv_len)  # fmt: skip


def _from_bounds(full: Bool[Array, ...], empty: Bool[Array, ...], certain: Any = True) -> Array:
    """int8 kinds from the full and empty blocks; the rest partial where ``certain``, else unknown."""
    rest = jnp.where(certain, PARTIAL, UNKNOWN)
    return jnp.where(full, FULL, jnp.where(empty, EMPTY, rest)).astype(jnp.int8)


def block_kinds_of(visible: Bool[Array, ...], inside: Bool[Array, ...], axis: Any) -> Array:
    """int8 kinds of blocks of elements (reduced over ``axis``); ``inside``: not past the end."""
    return _from_bounds(
        jnp.all(visible | ~inside, axis=axis), ~jnp.any(visible & inside, axis=axis)
    )


def _offsets(grid: Blocks, left: Any, right: Any) -> Array:
    """Visible where ``-right <= q_idx - kv_idx <= left``: a block holds every offset between its
    extremes, so it is full when they both lie inside and empty when the range misses."""
    lowest = grid.q_first - grid.kv_last
    highest = grid.q_last - grid.kv_first
    full = (lowest >= -right) & (highest <= left)
    empty = (highest < -right) | (lowest > left)
    return _from_bounds(full, empty)[None, None]


def _causal(grid: Blocks) -> Array:
    return _from_bounds(grid.q_first >= grid.kv_last, grid.q_last < grid.kv_first)[None, None]


def _window(grid: Blocks, left: int, right: int) -> Array:
    limit = grid.q_len + grid.kv_len  # wider than any offset: no overflow from huge sizes
    return _offsets(grid, min(left, limit), min(right, limit))


def _prefix_lm(grid: Blocks, lengths: Any) -> Array:
    """``kv_idx <= q_idx or kv_idx < prefix``: full if every key is in the prefix or the block
    is causally full; empty if no key is in the prefix and the block causally empty."""
    prefix = jnp.reshape(lengths, (-1, 1, 1, 1))  # [B or 1, 1, 1, 1]
    full = (grid.kv_last < prefix) | (grid.q_first >= grid.kv_last)
    empty = (grid.kv_first >= prefix) & (grid.q_last < grid.kv_first)
    return _from_bounds(full, empty)


class _IdRanges(NamedTuple):
    """Per batch row and block: the smallest and largest id >= 0, whether any is, whether all are."""

    low: Array
    high: Array
    some: Array
    whole: Array


def _id_ranges(ids: Array, length: int, block: int) -> _IdRanges:
    rows = ids[None] if ids.ndim == 1 else ids  # [B or 1, L]
    blocks = -(-length // block)
    pad = blocks * block - length
    rows = jnp.pad(rows, ((0, 0), (0, pad)), constant_values=-1).reshape(-1, blocks, block)
    inside = (jnp.arange(blocks * block) < length).reshape(blocks, block)
    present = rows >= 0  # padding ids (and positions past the end) belong to no document
    info = jnp.iinfo(rows.dtype)
    low = jnp.min(jnp.where(present, rows, info.max), axis=-1)
    high = jnp.max(jnp.where(present, rows, info.min), axis=-1)
    return _IdRanges(low, high, jnp.any(present, axis=-1), jnp.all(present | ~inside, axis=-1))


def _sorted_self_attention(q_ids: Array, kv_ids: Array) -> Array:
    """True when queries and keys carry the same ids, non-decreasing apart from padding (< 0).

    Then a block's documents are every id between its smallest and largest (each
    document is one run), so two blocks share a document exactly when their ranges meet.
    """
    if q_ids.shape != kv_ids.shape:
        return jnp.bool_(False)
    rows = q_ids[None] if q_ids.ndim == 1 else q_ids
    running = jax.lax.cummax(rows, axis=rows.ndim - 1)
    ordered = jnp.all((rows[:, 1:] >= running[:, :-1]) | (rows[:, 1:] < 0))
    return ordered & jnp.all(q_ids == kv_ids)


def _document(grid: Blocks, q_ids: Array, kv_ids: Array) -> Array:
    # Query blocks along axis 2, key blocks along axis 3: kinds [B or 1, 1, Tb, Sb].
    q = _IdRanges(*(x[:, None, :, None] for x in _id_ranges(q_ids, grid.q_len, grid.q_block)))
    kv = _IdRanges(*(x[:, None, None] for x in _id_ranges(kv_ids, grid.kv_len, grid.kv_block)))
    one = (q.low == q.high) & (kv.low == kv.high) & (q.low == kv.low)
    full = one & q.whole & kv.whole
    empty = ~q.some | ~kv.some | (q.high < kv.low) | (kv.high < q.low)
    return _from_bounds(full, empty, certain=_sorted_self_attention(q_ids, kv_ids))


def _both(a: Array, b: Array) -> Array:
    """`and_masks` of two kinds: empty wins, full gives the other, two partial are unknown."""
    return jnp.where((a == EMPTY) | (b == EMPTY), EMPTY,
                     jnp.where(a == FULL, b, jnp.where(b == FULL, a, UNKNOWN))).astype(jnp.int8)  # fmt: skip


def _either(a: Array, b: Array) -> Array:
    """`or_masks` of two kinds: full wins, empty gives the other, two partial are unknown."""
    return jnp.where((a == FULL) | (b == FULL), FULL,
                     jnp.where(a == EMPTY, b, jnp.where(b == EMPTY, a, UNKNOWN))).astype(jnp.int8)  # fmt: skip


def analytic_kinds(mask_mod: Any, grid: Blocks, opaque: tuple[int, int]) -> Array | None:
    """int8 kinds ``[B or 1, N or 1, Tb, Sb]`` (broadcastable), `UNKNOWN` where undecided;
    None when nothing is known (a user's function alone).

    ``opaque``: ``(B, N)`` of the tables, the axes a user's function inside `and_masks` /
    `or_masks` may depend on (its blocks are unknown over all of them).
    """
    if not isinstance(mask_mod, Partial):
        return None
    func, args = mask_mod.func, mask_mod.args
    if func is _mods._causal:
        return _causal(grid)
    if isinstance(func, _mods._Window):
        return _window(grid, func.left, func.right)
    if func is _mods._prefix_lm:
        return _prefix_lm(grid, *args)
    if func is _mods._document:
        return _document(grid, *args)
    if func in (_mods._all_of, _mods._any_of):
        combine, start = (_both, FULL) if func is _mods._all_of else (_either, EMPTY)
        kinds = jnp.full((1, 1, 1, 1), start, jnp.int8)
        parts = [analytic_kinds(inner, grid, opaque) for inner in args[0]]
        if args[0] and all(part is None for part in parts):
            return None
        unknown = jnp.full((*opaque, 1, 1), UNKNOWN, jnp.int8)
        for part in parts:
            kinds = combine(kinds, unknown if part is None else part)
        return kinds
    return None


def refine_unknown(
    kinds: Int[Array, "B N Tb Sb"],
    mask_mod: Callable[..., Any],
    grid: Blocks,
    max_elements: int,
) -> Int[Array, "B N Tb Sb"]:
    """``kinds`` with each `UNKNOWN` block replaced by its kind from the mask_mod's elements.

    The unknown blocks are listed (`jnp.nonzero`) and evaluated a chunk at a time in a
    loop that stops after the last, so the work follows their number, not the grid's.
    Axes of size 1 in ``kinds`` are evaluated at index 0 (the mod does not depend on them).
    """
    shape = kinds.shape
    flat = kinds.reshape(-1)
    total = flat.size
    unknown = flat == UNKNOWN
    count = jnp.sum(unknown, dtype=jnp.int32)
    chunk = max(1, min(total, max_elements // (grid.q_block * grid.kv_block)))
    steps = -(-total // chunk)
    (where,) = jnp.nonzero(unknown, size=steps * chunk, fill_value=total)
    q_lane = jnp.arange(grid.q_block, dtype=jnp.int32)
    kv_lane = jnp.arange(grid.kv_block, dtype=jnp.int32)

    def block_kind(index: Array) -> Array:
        b, h, i, j = jnp.unravel_index(jnp.minimum(index, total - 1), shape)
        q_pos = i * grid.q_block + q_lane
        kv_pos = j * grid.kv_block + kv_lane
        inside = (q_pos < grid.q_len)[:, None] & (kv_pos < grid.kv_len)[None]
        # Positions past the end read the last one (captured arrays stay in bounds).
        visible = mask_grid(mask_mod, b[None].astype(jnp.int32), h[None].astype(jnp.int32),
                            jnp.minimum(q_pos, grid.q_len - 1),
                            jnp.minimum(kv_pos, grid.kv_len - 1))[0, 0]  # fmt: skip
        return block_kinds_of(visible, inside, axis=None)

    def step(state: tuple[Array, Array]) -> tuple[Array, Array]:
        start, flat = state
        picked = jax.lax.dynamic_slice(where, (start,), (chunk,))
        found = jax.vmap(block_kind)(picked)
        return start + chunk, flat.at[picked].set(found, mode="drop")

    _, flat = jax.lax.while_loop(lambda s: s[0] < count, step, (jnp.int32(0), flat))
    return flat.reshape(shape)
