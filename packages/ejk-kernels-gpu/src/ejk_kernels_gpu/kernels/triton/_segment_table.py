"""One Triton kernel that builds a call's block table from segment ids (Triton body only).

`flash._tables.segment_block_table` intersected with a mask table (`flash._tables._intersect`) takes
four small XLA kernels a table; on a GPU their launches cost more than the work
(`docs/performance-history.md#kernelstriton_segment_tablepy`). This kernel gives
the same table, entry for entry, in one launch: program ``(b, m)`` summarises block
``m``'s ids (lowest, highest, whether all one id), walks the other axis's inner blocks
a chunk at a time with the same summary, and keeps the first and last block whose ids
may meet its own and the first run of blocks holding its own single id; then it
intersects that with block ``m``'s entry of the masks' table: read from the table, or,
for ranges given by positions (``POSITIONS``, `flash._tables.PositionRanges`: context
parallelism's blocks, whose offsets are known when the call runs), built from its
indices' positions, so that such calls need no XLA kernels for their masks. It also
writes the zero that the persistent forward's counter starts from (``counter_ptr``: the
forward takes the buffer over, with no memset launched). `flash._tables` stays the definition
(and the path on the CPU); the tests hold the two equal on random ids.
"""

import triton
import triton.language as tl

_BIG = tl.constexpr(2**30)


@triton.jit
def _first(values, keep, none):
    """Lowest of ``values`` where ``keep``, else ``none``."""
    return tl.min(tl.where(keep, values, none), axis=0)


@triton.jit
def _with_full(start, full_lo, full_hi, end, INNER: tl.constexpr):
    """`flash._tables._with_full` on scalars: an empty unmasked range moves to ``end`` rounded up."""
    end_up = (end + INNER - 1) // INNER * INNER
    has_full = (full_lo < full_hi) & (start < end)
    return tl.where(has_full, full_lo, end_up), tl.where(has_full, full_hi, end_up)


@triton.jit
def _entry_of_ranges(lo, hi, real, INNER: tl.constexpr):
    """`flash._tables.block_table`'s entry of one block from its indices' ranges ``[lo, hi)``
    (``real``: the indices inside the axis; the others are neutral)."""
    sees = real & (lo < hi)
    start = tl.min(tl.where(sees, lo, _BIG), axis=0)
    end = tl.max(tl.where(sees, hi, 0), axis=0)
    none = start >= end
    start = tl.where(none, 0, start // INNER * INNER)
    end = tl.where(none, 0, end)
    lo_all = tl.max(tl.where(real, lo, -_BIG), axis=0)
    hi_all = tl.min(tl.where(real, hi, _BIG), axis=0)
    full_lo = (lo_all + INNER - 1) // INNER * INNER
    full_hi = hi_all // INNER * INNER
    full_lo, full_hi = _with_full(start, full_lo, full_hi, end, INNER)
    return start, full_lo, full_hi, end


@triton.jit
def _position_entry(pos_ptr, other_pos_ptr, m, L: tl.constexpr, M: tl.constexpr,
                    BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, INNER: tl.constexpr,
                    CHUNKS: tl.constexpr, UPPER: tl.constexpr, LOWER: tl.constexpr):  # fmt: skip
    """Block ``m``'s entry of the masks' table from positions (`flash._tables.PositionRanges`,
    whose ``lo_hi`` this follows): index i at ``pos[i]`` sees, in each of the other axis's
    ``CHUNKS`` equal chunks (the chunk's first position read from ``other_pos``), the
    indices within ``LOWER`` before and ``UPPER`` past its position (-1: unbounded), and
    the hull of those over the chunks."""
    lane = tl.arange(0, BLOCK_P2)
    idx = m * BLOCK + lane
    real = (lane < BLOCK) & (idx < L)
    p = tl.load(pos_ptr + idx, mask=real, other=0)
    C: tl.constexpr = M // CHUNKS
    lo = tl.full([BLOCK_P2], M, tl.int32)
    hi = tl.zeros([BLOCK_P2], tl.int32)
    for i in tl.static_range(CHUNKS):
        rel = p - tl.load(other_pos_ptr + i * C)
        lo_i = tl.zeros([BLOCK_P2], tl.int32)
        hi_i = tl.full([BLOCK_P2], C, tl.int32)
        if LOWER >= 0:
            lo_i = tl.maximum(lo_i, rel - LOWER)
        if UPPER >= 0:
            hi_i = tl.minimum(hi_i, rel + UPPER + 1)
        some = lo_i < hi_i
        lo = tl.where(some, tl.minimum(lo, lo_i + i * C), lo)
        hi = tl.where(some, tl.maximum(hi, hi_i + i * C), hi)
    return _entry_of_ranges(tl.minimum(lo, hi), hi, real, INNER)


@triton.jit
def segment_table_kernel(
    ids_ptr,  # int32 [B, L]: this axis's segment ids (negative: padding)
    other_ptr,  # int32 [B, M]: the other axis's
    mask_ptr,  # int32 [NBLK, 4]: the masks' table of the same blocks (`flash._tables.block_table`)
    pos_ptr,  # with POSITIONS, int32 [L]: this axis's positions (`flash._tables.PositionRanges`)
    other_pos_ptr,  # ... and the other axis's, [M]
    out_ptr,  # int32 [B, NBLK, 4]
    counter_ptr,  # int32 [1]: set to zero (the persistent forward's counter)
    L: tl.constexpr,
    M: tl.constexpr,
    NBLK: tl.constexpr,
    BLOCK: tl.constexpr,  # indices per block of this axis
    INNER: tl.constexpr,  # indices per inner block of the other axis
    BLOCK_P2: tl.constexpr,  # the two, rounded up to powers of two
    INNER_P2: tl.constexpr,
    CHUNK: tl.constexpr,  # inner blocks summarised at once (a power of two)
    AFTER_FULL: tl.constexpr,  # `flash._tables._intersect`'s ``positions_after_full``
    POSITIONS: tl.constexpr,  # the masks' entries from positions, not from ``mask_ptr``
    CHUNKS: tl.constexpr,  # with POSITIONS: `flash._tables.PositionRanges`' chunks, upper, lower
    UPPER: tl.constexpr,
    LOWER: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    b = tl.program_id(1)
    m = tl.program_id(0)
    num_inner: tl.constexpr = (M + INNER - 1) // INNER
    # This block's ids; rows past the end repeat the last id (neutral, as "edge" padding).
    lane = tl.arange(0, BLOCK_P2)
    own = tl.minimum(m * BLOCK + lane, L - 1)
    ids = tl.load(ids_ptr + b * L + own)
    ids = tl.where(lane < BLOCK, ids, tl.load(ids_ptr + b * L + m * BLOCK))
    low = _first(ids, ids >= 0, _BIG)
    top = tl.max(ids, axis=0)
    high = tl.where(top >= 0, top, -1)
    uniform = (tl.min(ids, axis=0) == top) & (top >= 0)
    if (b == 0) & (m == 0):
        tl.store(counter_ptr, 0)
    # The masks' entry, loaded before the walk so that its latency hides behind it.
    if POSITIONS:
        mask_start, mask_lo, mask_hi, mask_end = _position_entry(
            pos_ptr, other_pos_ptr, m, L, M, BLOCK, BLOCK_P2, INNER, CHUNKS, UPPER, LOWER
        )
    else:
        row = mask_ptr + m * 4
        mask_start = tl.load(row)
        mask_lo = tl.load(row + 1)
        mask_hi = tl.load(row + 2)
        mask_end = tl.load(row + 3)
    # The other axis, CHUNK inner blocks at a time; keys past the end are padding (-1).
    cols = tl.arange(0, INNER_P2)
    first = tl.full([], num_inner, tl.int32)
    last = tl.full([], -1, tl.int32)
    full_first = tl.full([], num_inner, tl.int32)
    full_last = tl.full([], num_inner, tl.int32)
    for c in range(0, num_inner, CHUNK):
        j = c + tl.arange(0, CHUNK)
        real = (cols[None, :] < INNER) & (j[:, None] < num_inner)
        key = j[:, None] * INNER + cols[None, :]
        kid = tl.load(other_ptr + b * M + key, mask=real & (key < M), other=-1)
        o_low = tl.min(tl.where(real & (kid >= 0), kid, _BIG), axis=1)
        o_top = tl.max(tl.where(real, kid, -1), axis=1)
        o_high = tl.where(o_top >= 0, o_top, -1)
        o_uniform = (tl.min(tl.where(real, kid, _BIG), axis=1) == o_top) & (o_top >= 0)
        inside = j < num_inner
        meet = inside & (low <= o_high) & (o_low <= high)
        full = inside & uniform & o_uniform & (low == o_low)
        first = tl.minimum(first, _first(j, meet, num_inner))
        last = tl.maximum(last, tl.max(tl.where(meet, j, -1), axis=0))
        full_first = tl.minimum(full_first, _first(j, full, num_inner))
        # The first block after the run that breaks it (blocks run in order, so a later
        # chunk's blocks all come after a run found before).
        full_last = tl.minimum(full_last, _first(j, inside & ~full & (j > full_first), num_inner))
    none = first > last
    s_start = tl.where(none, 0, first * INNER)
    s_end = tl.where(none, 0, tl.minimum((last + 1) * INNER, M))
    s_lo, s_hi = _with_full(s_start, full_first * INNER, full_last * INNER, s_end, INNER)
    # Intersect with the masks' entry (`flash._tables._intersect`).
    start = tl.maximum(mask_start, s_start)
    end = tl.minimum(mask_end, s_end)
    empty = start >= end
    start = tl.where(empty, 0, start)
    end = tl.where(empty, 0, end)
    full_lo = tl.maximum(mask_lo, s_lo)
    full_hi = tl.minimum(mask_hi, s_hi)
    if AFTER_FULL:
        full_hi = tl.where(end <= s_hi, full_hi, full_lo)
    full_lo, full_hi = _with_full(start, full_lo, full_hi, end, INNER)
    slot = tl.arange(0, 4)
    entry = tl.where(
        slot == 0, start, tl.where(slot == 1, full_lo, tl.where(slot == 2, full_hi, end))
    )
    tl.store(out_ptr + (b * NBLK + m) * 4 + slot, entry)
