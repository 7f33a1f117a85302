"""Per-row key ranges and per-block tables that let the kernels skip masked-out blocks.

All on int32: in jnp where the offsets of packed sequences or segment ids (traced values)
take part, else in NumPy, so that the tables of causal and window masks are constants of
the compiled call instead of a few small kernels launched with each call. A row's range
``[lo, hi)`` holds every key it may see under causal, window and packed bounds; a block's
table entry covers its rows' ranges (`block_table`). With segment ids the tables are per
batch row (``[B, blocks, 4]``): the masks' table intersected with one built from each
block's range of document ids (`segment_block_table`, a few fused reductions), so blocks
of other documents are never visited. Where Triton compiles, one kernel builds each such
table (`fused_segment_table`, the same entries in one launch instead of four).
`kernel_tables` gathers every integer side input of a call's kernels (`Tables`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from ejk_sequtils import AttentionRequest, dropout_key

from ..build import _triton
from ._select import CallOptions

__all__ = [
    "Packing",
    "PositionRanges",
    "Tables",
    "block_table",
    "dummy",
    "fused_segment_table",
    "kernel_tables",
    "mask_table",
    "range_tables",
    "ranges",
    "segment_block_table",
]

_BIG = 2**30
Table = Array | np.ndarray  # NumPy where no traced value takes part (`_module`)


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
    # an XLA while loop (a launch per step; docs/performance-history.md#flash_tablespy).
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
) -> tuple[Table, Table]:
    """Range of the other axis seen by each index: ``[pos - lower, pos + upper]`` clipped.

    ``lower``/``upper`` of None mean unbounded on that side.
    """
    xp = np if seq is None else jnp  # without packing: NumPy constants
    if seq is None:
        pos = np.arange(length, dtype=np.int32)
        base = np.zeros((length,), np.int32)
        size = np.full((length,), other_len, np.int32)
    else:
        valid = seq < num_seqs
        s = jnp.clip(seq, 0, num_seqs - 1)
        base = cu_other[s]
        size = jnp.where(valid, cu_other[s + 1] - base, 0)
    lo = xp.zeros_like(pos) if lower is None else xp.maximum(pos - lower, 0)
    hi = size if upper is None else xp.minimum(pos + upper + 1, size)
    hi = xp.maximum(hi, lo)
    return (base + lo).astype(np.int32), (base + hi).astype(np.int32)


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
) -> tuple[Table, Table]:
    """Global ranges ``[lo, hi)``, int32: of keys each query row may see (``of_queries``,
    ``[T]`` each), or of queries that may see each key column (``[S]`` each)."""
    upper, lower = _bounds(causal, window, keys_of_queries=of_queries)
    length, other = (q_len, kv_len) if of_queries else (kv_len, q_len)
    if packing is None:
        return _ranges(length, other, None, None, None, 1, upper, lower)
    p = packing
    seq, pos, cu_other = (p.q_seq, p.q_pos, p.cu_k) if of_queries else (p.k_seq, p.k_pos, p.cu_q)
    return _ranges(length, other, seq, pos, cu_other, p.num_seqs, upper, lower)


@dataclasses.dataclass(frozen=True)
class PositionRanges:
    """The ranges ``[lo, hi)`` of the other axis each index of this axis sees, given by
    positions: index i is at ``pos[i]``, and the other axis's ``M`` indices are ``chunks``
    equal contiguous chunks of increasing positions (chunk c's first at
    ``other_pos[c * M // chunks]``, the rest following it). Index i sees the other indices
    at most ``lower`` positions before its own and ``upper`` past it (None: unbounded;
    `_bounds`), so within one chunk a contiguous run, and over the chunks their hull
    (exact: positions increase with the index). Context parallelism's blocks: positions
    known only when the call runs, so the fused table kernel builds the masks' entries
    from them (`fused_segment_table`) instead of a few XLA kernels building ``(lo, hi)``.
    """

    pos: Array  # int32 [L]
    other_pos: Array  # int32 [M]
    chunks: int
    upper: int | None
    lower: int | None

    def __post_init__(self) -> None:
        other_len = self.other_pos.shape[0]
        if self.chunks < 1 or other_len % self.chunks:
            raise ValueError(
                f"PositionRanges' other axis is `chunks` equal chunks: {other_len} indices "
                f"in {self.chunks} chunks"
            )
        for name in ("upper", "lower"):
            bound = getattr(self, name)
            if bound is not None and bound < 0:
                raise ValueError(f"PositionRanges' {name} is >= 0 or None, got {bound}")

    @classmethod
    def of(
        cls,
        pos: Array,
        other_pos: Array,
        chunks: int,
        causal: bool,
        window: tuple[int, int] | None,
        *,
        of_queries: bool,
    ) -> PositionRanges:
        """The ranges of keys each query sees (``of_queries``; ``pos`` the queries') or of
        queries that see each key, under causal and a window."""
        upper, lower = _bounds(causal, window, keys_of_queries=of_queries)
        return cls(pos, other_pos, chunks, upper, lower)

    def lo_hi(self) -> tuple[Array, Array]:
        """``(lo, hi)``, int32 ``[L]`` each (``lo == hi == 0`` where nothing is seen)."""
        other_len = self.other_pos.shape[0]
        size = other_len // self.chunks
        lo = jnp.full(self.pos.shape, other_len, jnp.int32)
        hi = jnp.zeros(self.pos.shape, jnp.int32)
        for i in range(self.chunks):
            rel = self.pos - self.other_pos[i * size]
            lo_i = jnp.zeros_like(rel) if self.lower is None else jnp.maximum(rel - self.lower, 0)
            hi_i = jnp.full_like(rel, size)
            if self.upper is not None:
                hi_i = jnp.minimum(hi_i, rel + self.upper + 1)
            some = lo_i < hi_i
            lo = jnp.where(some, jnp.minimum(lo, lo_i + i * size), lo)
            hi = jnp.where(some, jnp.maximum(hi, hi_i + i * size), hi)
        return jnp.minimum(lo, hi), hi


Ranges = tuple[Table, Table] | PositionRanges  # listed per index, or given by positions


def block_table(lo: Table, hi: Table, block: int, inner_block: int) -> Table:
    """int32 ``[num_blocks, 4]``: ``(start, full_start, full_end, end)`` of the inner loop.

    The inner loop visits inner blocks from ``start`` (aligned) while ``< end``;
    blocks in ``[full_start, full_end)`` are visible to every row of the block and
    run without a mask (both ``end`` rounded up to an inner block when there are none).
    NumPy ranges give a NumPy table (a constant of the compiled call).
    """
    xp = _module(lo, hi)
    length = lo.shape[0]
    nblk = -(-length // block)
    pad = nblk * block - length
    empty = lo >= hi
    lo_any = xp.pad(xp.where(empty, _BIG, lo), (0, pad), constant_values=_BIG).reshape(nblk, block)
    hi_any = xp.pad(xp.where(empty, 0, hi), (0, pad), constant_values=0).reshape(nblk, block)
    start = lo_any.min(1)
    end = hi_any.max(1)
    none = start >= end
    start = xp.where(none, 0, start // inner_block * inner_block)
    end = xp.where(none, 0, end)
    # Rows past the end are neutral for the fully visible range.
    lo_all = xp.pad(lo, (0, pad), constant_values=-_BIG).reshape(nblk, block).max(1)
    hi_all = xp.pad(hi, (0, pad), constant_values=_BIG).reshape(nblk, block).min(1)
    full_lo = -(-lo_all // inner_block) * inner_block
    full_hi = hi_all // inner_block * inner_block
    return _with_full(start, full_lo, full_hi, end, inner_block)


def _with_full(start: Table, full_lo: Table, full_hi: Table, end: Table, inner: int) -> Table:
    """The table ``[..., 4]``, an empty fully visible range moved to ``end`` rounded up."""
    xp = _module(start, full_lo, full_hi, end)
    end_up = -(-end // inner) * inner
    has_full = (full_lo < full_hi) & (start < end)
    full_lo = xp.where(has_full, full_lo, end_up)
    full_hi = xp.where(has_full, full_hi, end_up)
    return xp.stack([start, full_lo, full_hi, end], axis=-1).astype(np.int32)


def _module(*arrays: Any) -> Any:
    """NumPy if every array is a NumPy one (known when the call is traced), else jnp."""
    return np if all(isinstance(a, np.ndarray) for a in arrays) else jnp


def _id_blocks(ids: Array, block: int, tail: str) -> tuple[Array, Array, Array]:
    """Per block of ``ids [B, L]``: the lowest and highest document id (non-negative; a
    block of padding has lowest > highest) and whether the whole block holds one id.

    ``tail``: how the last block is padded: ``"edge"`` (rows past the end are neutral) or
    ``"padding"`` (keys past the end make the block mixed: it never runs unmasked).
    """
    length = ids.shape[1]
    nblk = -(-length // block)
    pad = ((0, 0), (0, nblk * block - length))
    if tail == "edge":
        ids = jnp.pad(ids, pad, mode="edge")
    else:
        ids = jnp.pad(ids, pad, constant_values=-1)
    ids = ids.reshape(ids.shape[0], nblk, block)
    low = jnp.where(ids >= 0, ids, _BIG).min(-1)
    high = ids.max(-1)
    uniform = (ids == ids[..., :1]).all(-1) & (ids[..., 0] >= 0)
    return low, jnp.where(high >= 0, high, -1), uniform


def segment_block_table(ids: Array, other_ids: Array, block: int, inner_block: int) -> Array:
    """int32 ``[B, blocks, 4]``: the `block_table` of segment ids alone.

    A block of ``block`` indices visits the inner blocks (of ``inner_block`` indices of the
    other axis) from the first to the last whose ids may meet its own (their ranges of
    document ids overlap), and runs without a mask the first run of inner blocks that hold
    the one id it holds. Blocks of other documents are skipped; blocks inside one document
    run unmasked; anything else (ids repeated in separate runs, padding, mixed blocks) is
    visited with the per-score mask, so the table is exact for any ids.

    Args:
        ids: ``[B, L]`` segment ids of this axis (negative: padding).
        other_ids: ``[B, M]`` segment ids of the other axis.
        block: indices per block of this axis.
        inner_block: indices per inner block of the other axis.
    """
    other_len = other_ids.shape[1]
    low, high, uniform = _id_blocks(ids, block, tail="edge")
    o_low, o_high, o_uniform = _id_blocks(other_ids, inner_block, tail="padding")
    meet = (low[:, :, None] <= o_high[:, None, :]) & (o_low[:, None, :] <= high[:, :, None])
    full = uniform[:, :, None] & o_uniform[:, None, :] & (low[:, :, None] == o_low[:, None, :])
    count = o_low.shape[1]
    idx = jnp.arange(count, dtype=jnp.int32)
    first = jnp.where(meet, idx, count).min(-1)
    last = jnp.where(meet, idx, -1).max(-1)
    none = first > last
    start = jnp.where(none, 0, first * inner_block)
    end = jnp.where(none, 0, jnp.minimum((last + 1) * inner_block, other_len))
    full_first = jnp.where(full, idx, count).min(-1)
    after = ~full & (idx > full_first[..., None])
    full_last = jnp.where(after, idx, count).min(-1)  # first mixed block after the run
    return _with_full(start, full_first * inner_block, full_last * inner_block, end, inner_block)


def _intersect(table: Table, seg: Array, inner: int, *, positions_after_full: bool) -> Array:
    """Tables ``[blocks, 4]`` (masks) and ``[B, blocks, 4]`` (segment ids) of the same
    blocks combined: visit what both visit, unmasked where both are.

    ``positions_after_full``: the kernel compares positions alone in the masked blocks
    after the unmasked range (the causal Gluon forward: there only the causal bound can
    hide a pair, `kernels.gluon._forward`). Then an entry keeps its unmasked range only
    where every key after it lies in `segment_block_table`'s unmasked run, so holds the
    block's own single id (a block of one document: its keys up to the diagonal are of
    that document); otherwise every block it visits is masked with the ids compared."""
    start = jnp.maximum(table[..., 0], seg[..., 0])
    end = jnp.minimum(table[..., 3], seg[..., 3])
    none = start >= end
    start, end = jnp.where(none, 0, start), jnp.where(none, 0, end)
    full_lo = jnp.maximum(table[..., 1], seg[..., 1])
    full_hi = jnp.minimum(table[..., 2], seg[..., 2])
    if positions_after_full:
        full_hi = jnp.where(end <= seg[..., 2], full_hi, full_lo)
    return _with_full(start, full_lo, full_hi, end, inner)


# Other-axis ids one program of `fused_segment_table` summarises at once (128 KiB, 64
# registers a thread at `TABLE_WARPS`, no spills on sm_90): 32768 keys of 128-key blocks in
# one step. Its programs wait on their loads, so fewer, larger steps (and 16 warps) are
# fastest; docs/performance-history.md#flash_tablespy.
CHUNK_ELEMENTS = 32768
TABLE_WARPS = 16


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def table_constexprs(
    length: int,
    other_len: int,
    block: int,
    inner_block: int,
    positions_after_full: bool,
    positions: tuple[int, int | None, int | None] | None = None,
) -> dict[str, Any]:
    """`kernels.triton._segment_table.segment_table_kernel`'s compile-time arguments (`fused_segment_table`;
    ``positions``: `PositionRanges`' ``(chunks, upper, lower)`` where the kernel builds the
    masks' entries from positions, else None)."""
    inner_p2 = _power_of_two(inner_block)
    num_inner = -(-other_len // inner_block)
    chunks, upper, lower = positions or (1, None, None)
    return dict(
        L=length, M=other_len, NBLK=-(-length // block), BLOCK=block, INNER=inner_block,
        BLOCK_P2=_power_of_two(block), INNER_P2=inner_p2,
        CHUNK=min(_power_of_two(num_inner), max(1, CHUNK_ELEMENTS // inner_p2)),
        AFTER_FULL=positions_after_full, POSITIONS=positions is not None, CHUNKS=chunks,
        UPPER=_bound(upper), LOWER=_bound(lower),
    )  # fmt: skip


def fused_segment_table(
    masks: Table | PositionRanges,
    ids: Array,
    other_ids: Array,
    block: int,
    inner_block: int,
    *,
    positions_after_full: bool,
) -> tuple[Array, Array]:
    """``_intersect(table, segment_block_table(ids, other_ids, block, inner_block), ...)``
    in one Triton kernel (`kernels.triton._segment_table`), ``table`` being ``masks`` or, for
    `PositionRanges`, ``block_table(*masks.lo_hi(), block, inner_block)``: the same int32
    ``[B, blocks, 4]``, one launch in place of a few XLA kernels. Also returns an int32
    ``[1]`` zero written by the same launch: the persistent forward's counter
    (`Tables.fwd_counter`)."""
    batch, length = ids.shape
    by_positions = isinstance(masks, PositionRanges)
    consts = table_constexprs(
        length, other_ids.shape[1], block, inner_block, positions_after_full,
        (masks.chunks, masks.upper, masks.lower) if by_positions else None,
    )  # fmt: skip
    nblk = consts["NBLK"]
    if by_positions:
        table, pos, other_pos = dummy(), masks.pos, masks.other_pos
    else:
        table, pos, other_pos = masks, dummy(), dummy()
    kernel = _triton.kernels().segment_table_kernel
    inputs, outputs, where = _triton.by_name(
        kernel,
        inputs=dict(ids_ptr=ids, other_ptr=other_ids, mask_ptr=table, pos_ptr=pos,
                    other_pos_ptr=other_pos),
        outputs=dict(
            out_ptr=jax.ShapeDtypeStruct((batch, nblk, 4), jnp.int32),
            counter_ptr=jax.ShapeDtypeStruct((1,), jnp.int32),
        ),
    )  # fmt: skip
    inputs = tuple(jnp.asarray(x, jnp.int32) for x in inputs)
    out, counter = _triton.launch(
        kernel, (nblk, batch), inputs, outputs, consts, num_warps=TABLE_WARPS, num_stages=1,
        **where,
    )  # fmt: skip
    return out, counter


def _bound(bound: int | None) -> int:
    """A `PositionRanges` bound (>= 0) as the table kernel's constexpr (-1: unbounded)."""
    return -1 if bound is None else bound


def range_tables(
    opts: CallOptions,
    rows: Ranges,
    cols: Ranges,
    segment_ids: tuple[Array, Array] | None,
    *,
    head_dim: int,
    fused: bool | None = None,
) -> tuple[Array, Array, Array, Array | None]:
    """The forward, dq and dk/dv block tables of a call.

    Args:
        opts: the call's options (the configs' tiles).
        rows: the keys each query row may see: ``(lo, hi)``, ``[T]`` each (`ranges`), or
            `PositionRanges`.
        cols: the queries that may see each key, likewise (``[S]``).
        segment_ids: int32 ``(q_ids [B, T], kv_ids [B, S])`` or None.
        head_dim: the call's (which dq kernel runs beside a Gluon dk/dv config).
        fused: build each table with segment ids in one Triton kernel
            (`fused_segment_table`) or in jnp; None: the kernel where Triton compiles (on a
            GPU: one launch a table), jnp in Triton's interpreter (the same tables).

    Returns:
        ``(fwd, dq, dkdv, fwd_counter)``: ``[blocks, 4]`` each, or ``[B, blocks, 4]`` with
        segment ids (the masks' table intersected with `segment_block_table`'s; a causal
        forward's blocks after its unmasked range hold the block's own id, `_intersect`);
        and where the forward's table came from the fused kernel, the zero it wrote for
        the forward's counter (`Tables.fwd_counter`), else None.
    """
    fwd_cfg, bwd_cfg = opts.fwd_cfg, opts.bwd_cfg
    # dk/dv programs own key blocks of block_keys rows (the resident tile) and stream
    # block_queries queries; the dq kernel's tiles are the backward config's
    # (`ordinary_dq_config`), or the Gluon dq kernel's beside a Gluon dk/dv config
    # (`CallOptions.dq_beside`: other tiles at head_dim 64 and 256).
    dq_cfg = opts.dq_config(head_dim)
    shapes = (
        (fwd_cfg.block_q, fwd_cfg.block_k),
        (dq_cfg.block_q, dq_cfg.block_k),
        (bwd_cfg.block_keys, bwd_cfg.block_queries),
    )
    ranges_of = (rows, rows, cols)
    if fused is None:
        fused = not _triton.interpreting()
    if segment_ids is None:  # NumPy ones become constants of the compiled call
        masks_only = (mask_table(r, *b) for r, b in zip(ranges_of, shapes, strict=True))
        return (*(jnp.asarray(t) for t in masks_only), None)
    q_seg, k_seg = segment_ids
    ids_of = ((q_seg, k_seg), (q_seg, k_seg), (k_seg, q_seg))
    after_full = (opts.causal, False, False)  # the forward's (see `_intersect`)
    if not fused:
        fwd, dq, dkdv = (
            _intersect(
                mask_table(r, *blocks),
                segment_block_table(*ids, *blocks),
                blocks[1],
                positions_after_full=a,
            )
            for r, ids, blocks, a in zip(ranges_of, ids_of, shapes, after_full, strict=True)
        )
        return fwd, dq, dkdv, None
    (fwd, counter), (dq, _), (dkdv, _) = (
        fused_segment_table(_kernel_masks(r, blocks), *ids, *blocks, positions_after_full=a)
        for r, ids, blocks, a in zip(ranges_of, ids_of, shapes, after_full, strict=True)
    )
    return fwd, dq, dkdv, counter


def mask_table(ranges: Ranges, block: int, inner_block: int) -> Table:
    """`block_table` of ``ranges`` (listed, or `PositionRanges`)."""
    lo_hi = ranges.lo_hi() if isinstance(ranges, PositionRanges) else ranges
    return block_table(*lo_hi, block, inner_block)


def _kernel_masks(ranges: Ranges, blocks: tuple[int, int]) -> Table | PositionRanges:
    """What `fused_segment_table` takes of ``ranges``: position ranges as they are (the
    kernel builds their entries), or the masks' table of listed ranges (NumPy, a
    constant of the call, where no packing takes part)."""
    return ranges if isinstance(ranges, PositionRanges) else block_table(*ranges, *blocks)


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
    seed: Any  # dropout: uint32 [seed, b0, n0, i0, j0] (`ejk_sequtils.dropout_key`)
    # int32 [1], zero: the persistent forward's counter, written by the launch that built
    # ``fwd_ranges`` (`fused_segment_table`), which the forward takes over (no memset of
    # its own); None: the forward zeroes one. Used once: not a residual (`for_backward`).
    fwd_counter: Any = None

    def for_backward(self) -> Tables:
        """These tables as the backward keeps them: without the forward's counter."""
        return dataclasses.replace(self, fwd_counter=None)

    def masking(self) -> dict[str, Any]:
        """The masking tables by the kernels' argument names (`kernels.triton._common.MaskTables`)."""
        return dict(
            qsid_ptr=self.q_sid, ksid_ptr=self.k_sid, qpos_ptr=self.q_pos, kpos_ptr=self.k_pos,
            qseg_ptr=self.q_seg, kseg_ptr=self.k_seg,
        )  # fmt: skip


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
    fwd_table, dq_table, dkdv_table, counter = range_tables(
        opts, rows, cols, segment_ids, head_dim=request.shape[5]
    )
    if packing is None:
        q_sid = k_sid = q_pos = k_pos = dummy()
    else:
        q_sid, k_sid = packing.q_sid, packing.k_sid
        q_pos, k_pos = packing.q_pos.astype(jnp.int32), packing.k_pos.astype(jnp.int32)
    if request.dropout_seed is None:
        seed = dummy(jnp.uint32)
    else:
        seed = dropout_key(request.dropout_seed, request.dropout_offsets)
    return Tables(
        q_sid, k_sid, q_pos, k_pos, q_seg, k_seg, fwd_table, dq_table, dkdv_table, seed, counter
    )
