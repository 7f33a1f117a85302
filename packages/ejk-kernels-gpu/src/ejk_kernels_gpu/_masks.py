"""Per-row key ranges and per-block tables that let the kernels skip masked-out blocks.

All in jnp on int32 (the offsets of packed sequences and segment ids are traced values).
A row's range ``[lo, hi)`` holds every key it may see under causal, window and packed
bounds, and with segment ids the span of the keys that carry its id (`segment_ranges`):
blocks of other documents are never visited. A range is exact when every key inside it is
visible (always for causal, window and packing; for segment ids when the row's id forms
one run of keys): only blocks inside every exact row range of a block run unmasked.
With segment ids the tables are per batch row (``[B, blocks, 4]``).
`kernel_tables` gathers every integer side input of a call's kernels (`Tables`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from ejk_sequtils import AttentionRequest, dropout_seed_u32

from ._options import CallOptions

__all__ = [
    "Packing",
    "Tables",
    "block_table",
    "dummy",
    "kernel_tables",
    "range_tables",
    "ranges",
    "segment_ranges",
]

_BIG = 2**30


class Packing:
    """Sequence id and local position of every packed token, and the sequence offsets."""

    def __init__(self, cu_q: Array, cu_k: Array, q_len: int, kv_len: int):
        self.cu_q = cu_q
        self.cu_k = cu_k
        num_seqs = cu_q.shape[0] - 1
        self.q_seq, self.q_pos = _sequence_of(cu_q, q_len, num_seqs)
        self.k_seq, self.k_pos = _sequence_of(cu_k, kv_len, num_seqs)
        # Padding tokens get ids that never match (-1 for rows, -2 for columns).
        self.q_sid = jnp.where(self.q_seq < num_seqs, self.q_seq, -1).astype(jnp.int32)
        self.k_sid = jnp.where(self.k_seq < num_seqs, self.k_seq, -2).astype(jnp.int32)
        self.num_seqs = num_seqs


def _sequence_of(cu: Array, length: int, num_seqs: int) -> tuple[Array, Array]:
    idx = jnp.arange(length, dtype=jnp.int32)
    # Few offsets: one fused compare-and-count per token beats the default binary search,
    # an XLA while loop (a launch per step; H100: the forward's tables 154 -> 96 us a call).
    method = "compare_all" if cu.shape[0] <= 1024 else "sort"
    seq = jnp.searchsorted(cu, idx, side="right", method=method).astype(jnp.int32) - 1
    seq = jnp.where(idx >= cu[-1], num_seqs, jnp.clip(seq, 0, num_seqs))
    local = idx - cu[jnp.clip(seq, 0, num_seqs)]
    return seq, local


def _ranges(
    length: int,
    other_len: int,
    seq: Array | None,
    pos: Array | None,
    cu_other: Array | None,
    num_seqs: int,
    upper: int | None,
    lower: int | None,
) -> tuple[Array, Array]:
    """Range of the other axis seen by each index: ``[pos - lower, pos + upper]`` clipped.

    ``lower``/``upper`` of None mean unbounded on that side.
    """
    if seq is None:
        pos = jnp.arange(length, dtype=jnp.int32)
        base = jnp.zeros((length,), jnp.int32)
        size = jnp.full((length,), other_len, jnp.int32)
    else:
        valid = seq < num_seqs
        s = jnp.clip(seq, 0, num_seqs - 1)
        base = cu_other[s]
        size = jnp.where(valid, cu_other[s + 1] - base, 0)
    lo = jnp.zeros_like(pos) if lower is None else jnp.maximum(pos - lower, 0)
    hi = size if upper is None else jnp.minimum(pos + upper + 1, size)
    hi = jnp.maximum(hi, lo)
    return (base + lo).astype(jnp.int32), (base + hi).astype(jnp.int32)


def _bounds(
    causal: bool, window: tuple[int, int] | None, keys_of_queries: bool
) -> tuple[int | None, int | None]:
    """(upper, lower): how far past / before its own position an index reaches on the other axis.

    Query i sees keys j with i - left <= j <= i + right (j <= i if causal); so key j is
    seen by queries j - right <= i <= j + left (i >= j if causal). None is unbounded.
    """
    upper = lower = None
    if window is not None:
        left, right = window
        upper, lower = (right, left) if keys_of_queries else (left, right)
    if causal:
        if keys_of_queries:
            upper = 0 if upper is None else min(upper, 0)
        else:
            lower = 0 if lower is None else min(lower, 0)
    return upper, lower


def ranges(
    q_len: int,
    kv_len: int,
    causal: bool,
    window: tuple[int, int] | None,
    packing: Packing | None,
    *,
    of_queries: bool,
) -> tuple[Array, Array]:
    """Global ranges ``[lo, hi)``, int32: of keys each query row may see (``of_queries``,
    ``[T]`` each), or of queries that may see each key column (``[S]`` each)."""
    upper, lower = _bounds(causal, window, keys_of_queries=of_queries)
    length, other = (q_len, kv_len) if of_queries else (kv_len, q_len)
    if packing is None:
        return _ranges(length, other, None, None, None, 1, upper, lower)
    p = packing
    seq, pos, cu_other = (p.q_seq, p.q_pos, p.cu_k) if of_queries else (p.k_seq, p.k_pos, p.cu_q)
    return _ranges(length, other, seq, pos, cu_other, p.num_seqs, upper, lower)


def block_table(
    lo: Array, hi: Array, block: int, inner_block: int, exact: bool | Array = True
) -> Array:
    """int32 ``[num_blocks, 4]``: ``(start, full_start, full_end, end)`` of the inner loop.

    The inner loop visits inner blocks from ``start`` (aligned) while ``< end``;
    blocks in ``[full_start, full_end)`` are visible to every row of the block and
    run without a mask. ``exact``: whether each row (bool ``[length]``, or one bool for
    all) sees every index of its range; a block with an inexact row has no unmasked part.
    """
    length = lo.shape[0]
    nblk = -(-length // block)
    pad = nblk * block - length
    empty = lo >= hi
    lo_any = jnp.pad(jnp.where(empty, _BIG, lo), (0, pad), constant_values=_BIG).reshape(
        nblk, block
    )
    hi_any = jnp.pad(jnp.where(empty, 0, hi), (0, pad), constant_values=0).reshape(nblk, block)
    start = lo_any.min(1)
    end = hi_any.max(1)
    none = start >= end
    start = jnp.where(none, 0, start // inner_block * inner_block)
    end = jnp.where(none, 0, end)
    # Rows past the end are neutral for the fully visible range.
    lo_all = jnp.pad(lo, (0, pad), constant_values=-_BIG).reshape(nblk, block).max(1)
    hi_all = jnp.pad(hi, (0, pad), constant_values=_BIG).reshape(nblk, block).min(1)
    full_lo = -(-lo_all // inner_block) * inner_block
    full_hi = hi_all // inner_block * inner_block
    end_up = -(-end // inner_block) * inner_block
    has_full = (full_lo < full_hi) & ~none
    if isinstance(exact, bool):
        has_full = has_full & exact
    else:
        has_full = has_full & jnp.pad(exact, (0, pad), constant_values=True).reshape(
            nblk, block
        ).all(1)
    full_lo = jnp.where(has_full, full_lo, end_up)
    full_hi = jnp.where(has_full, full_hi, end_up)
    return jnp.stack([start, full_lo, full_hi, end], axis=1).astype(jnp.int32)


def segment_ranges(ids: Array, other_ids: Array) -> tuple[Array, Array, Array]:
    """Where each index's id lies on the other axis (one batch row; int32 ids).

    Args:
        ids: ``[L]`` segment ids of one axis (negative: padding).
        other_ids: ``[M]`` segment ids of the other axis.

    Returns:
        ``(lo, hi, exact)``, each ``[L]``: ``[lo, hi)`` spans the first to the last index of
        ``other_ids`` equal to ``ids[i]`` (empty for padding or an id the other axis lacks);
        ``exact[i]``: every index in that span holds the id (it is one run).
    """
    length, other = ids.shape[0], other_ids.shape[0]
    if other == 0 or length == 0:
        zero = jnp.zeros((length,), jnp.int32)
        return zero, zero, jnp.ones((length,), bool)
    # One sort of both axes by (id, axis): within an id, the other axis's indices come first
    # and ascending, so an id's group starts with its first and ends with its last other
    # index. Group bounds and counts come from scans (no binary searches: on a GPU each of
    # their steps is a launch).
    key = jnp.concatenate([other_ids, ids]).astype(jnp.int32)
    axis = jnp.concatenate([jnp.zeros((other,), jnp.int32), jnp.ones((length,), jnp.int32)])
    index = jnp.concatenate(
        [jnp.arange(other, dtype=jnp.int32), jnp.arange(length, dtype=jnp.int32)]
    )
    key, axis, index = jax.lax.sort((key, axis, index), num_keys=2)
    size = other + length
    pos = jnp.arange(size, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((1,), bool), key[1:] != key[:-1]])
    group_start = jax.lax.cummax(jnp.where(starts, pos, 0))
    is_other = (axis == 0).astype(jnp.int32)
    others_before = jnp.cumsum(is_other) - is_other  # other-axis entries before each position
    # This axis's entries follow every other-axis entry of their group.
    count = others_before - others_before[group_start]
    first = index[group_start]
    last = index[jnp.maximum(group_start + count - 1, 0)]
    found = (count > 0) & (key >= 0)
    lo = jnp.where(found, first, 0)
    hi = jnp.where(found, last + 1, 0)
    exact = ~found | (count == hi - lo)
    # Back to this axis's order (each of its indices appears once among axis == 1).
    where = jnp.where(axis == 1, index, length)  # other-axis entries land out of bounds
    scatter = lambda x: jnp.zeros((length,), x.dtype).at[where].set(x, mode="drop")
    return scatter(lo).astype(jnp.int32), scatter(hi).astype(jnp.int32), scatter(exact)


def _narrowed(lo: Array, hi: Array, ids: Array, other_ids: Array) -> tuple[Array, Array, Array]:
    """``(lo, hi, exact)``, each ``[B, L]``: the ranges ``[lo, hi)`` (``[L]``, shared by the
    batch) narrowed per batch row to the span of each index's segment id (`segment_ranges`)."""

    def one_row(ids: Array, other_ids: Array) -> tuple[Array, Array, Array]:
        slo, shi, exact = segment_ranges(ids, other_ids)
        row_lo = jnp.maximum(lo, slo)
        return row_lo, jnp.maximum(jnp.minimum(hi, shi), row_lo), exact

    return jax.vmap(one_row)(ids, other_ids)


def range_tables(
    opts: CallOptions,
    rows: tuple[Array, Array],
    cols: tuple[Array, Array],
    segment_ids: tuple[Array, Array] | None,
) -> tuple[Array, Array, Array]:
    """The forward, dq and dk/dv block tables of a call.

    Args:
        opts: the call's options (the configs' tiles).
        rows: ``(lo, hi)``, ``[T]`` each: the keys each query row may see (`ranges`).
        cols: ``(lo, hi)``, ``[S]`` each: the queries that may see each key.
        segment_ids: int32 ``(q_ids [B, T], kv_ids [B, S])`` or None.

    Returns:
        ``(fwd, dq, dkdv)``: ``[blocks, 4]`` each, or ``[B, blocks, 4]`` with segment ids
        (each row's range narrowed to its id's span, found once per direction).
    """
    fwd, bwd = opts.fwd_cfg, opts.bwd_cfg
    # dk/dv programs own key blocks of block_q rows (the resident tile) and stream block_k queries.
    shapes = ((fwd.block_q, fwd.block_k), (bwd.block_q, bwd.block_k), (bwd.block_q, bwd.block_k))
    if segment_ids is None:
        ranges_of = (rows, rows, cols)
        return tuple(block_table(*r, *blocks) for r, blocks in zip(ranges_of, shapes, strict=True))
    q_seg, k_seg = segment_ids
    row_ranges = _narrowed(*rows, q_seg, k_seg)
    col_ranges = _narrowed(*cols, k_seg, q_seg)

    def per_batch(narrowed: tuple[Array, Array, Array], block: int, inner: int) -> Array:
        return jax.vmap(lambda lo, hi, exact: block_table(lo, hi, block, inner, exact))(*narrowed)

    ranges_of = (row_ranges, row_ranges, col_ranges)
    return tuple(per_batch(r, *blocks) for r, blocks in zip(ranges_of, shapes, strict=True))


def dummy(dtype: object = jnp.int32) -> Array:
    """A one-element stand-in for a pointer argument the launch does not use."""
    return jnp.zeros((1,), dtype)


@dataclasses.dataclass(frozen=True)
class Tables:
    """Integer side inputs of the kernels (not differentiated)."""

    q_sid: Any  # jax arrays; float0 zeros when JAX builds their tangents
    k_sid: Any
    q_pos: Any
    k_pos: Any
    q_seg: Any
    k_seg: Any
    fwd_ranges: Any
    dq_ranges: Any
    dkdv_ranges: Any
    seed: Any

    def masking(self) -> tuple[Any, ...]:
        """The masking tables in the kernels' argument order (`_kernel_common.MaskTables`)."""
        return (self.q_sid, self.k_sid, self.q_pos, self.k_pos, self.q_seg, self.k_seg)


jax.tree_util.register_dataclass(
    Tables,
    data_fields=[f.name for f in dataclasses.fields(Tables)],
    meta_fields=[],
)


def kernel_tables(opts: CallOptions, request: AttentionRequest) -> Tables:
    """The `Tables` of a validated request run with ``opts``."""
    _, q_len, kv_len, *_ = request.shape
    packing = None
    if request.cu_seqlens_q is not None:
        cu_q = jnp.asarray(request.cu_seqlens_q, jnp.int32)
        cu_k = jnp.asarray(request.cu_seqlens_k, jnp.int32)
        packing = Packing(cu_q, cu_k, q_len, kv_len)
    rows = ranges(q_len, kv_len, opts.causal, opts.window, packing, of_queries=True)
    cols = ranges(q_len, kv_len, opts.causal, opts.window, packing, of_queries=False)
    if request.segment_ids is None:
        q_seg = k_seg = dummy()
        segment_ids = None
    else:
        segment_ids = q_seg, k_seg = tuple(jnp.asarray(x, jnp.int32) for x in request.segment_ids)
    fwd_table, dq_table, dkdv_table = range_tables(opts, rows, cols, segment_ids)
    if packing is None:
        q_sid = k_sid = q_pos = k_pos = dummy()
    else:
        q_sid, k_sid = packing.q_sid, packing.k_sid
        q_pos, k_pos = packing.q_pos.astype(jnp.int32), packing.k_pos.astype(jnp.int32)
    if request.dropout_seed is None:
        seed = dummy(jnp.uint32)
    else:
        seed = dropout_seed_u32(request.dropout_seed).reshape(1)
    return Tables(q_sid, k_sid, q_pos, k_pos, q_seg, k_seg, fwd_table, dq_table, dkdv_table, seed)
