"""One Triton kernel that builds a call's block table from segment ids (Triton body only).

`_masks.segment_block_table` intersected with a mask table (`_masks._intersect`) takes
four small XLA kernels a table; on a GPU their launches cost more than the work (about
12 us of a 0.34 ms packed forward on an H100, `docs/performance.md`). This kernel gives
the same table, entry for entry, in one launch: program ``(b, m)`` summarises block
``m``'s ids (lowest, highest, whether all one id), walks the other axis's inner blocks
a chunk at a time with the same summary, and keeps the first and last block whose ids
may meet its own and the first run of blocks holding its own single id; then it
intersects that with row ``m`` of the mask table. `_masks` stays the definition (and the
path on the CPU); the tests hold the two equal on random ids.
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
    """`_masks._with_full` on scalars: an empty unmasked range moves to ``end`` rounded up."""
    end_up = (end + INNER - 1) // INNER * INNER
    has_full = (full_lo < full_hi) & (start < end)
    return tl.where(has_full, full_lo, end_up), tl.where(has_full, full_hi, end_up)


@triton.jit
def segment_table_kernel(
    ids_ptr,  # int32 [B, L]: this axis's segment ids (negative: padding)
    other_ptr,  # int32 [B, M]: the other axis's
    mask_ptr,  # int32 [NBLK, 4]: the masks' table of the same blocks (`_masks.block_table`)
    out_ptr,  # int32 [B, NBLK, 4]
    L: tl.constexpr,
    M: tl.constexpr,
    NBLK: tl.constexpr,
    BLOCK: tl.constexpr,  # indices per block of this axis
    INNER: tl.constexpr,  # indices per inner block of the other axis
    BLOCK_P2: tl.constexpr,  # the two, rounded up to powers of two
    INNER_P2: tl.constexpr,
    CHUNK: tl.constexpr,  # inner blocks summarised at once (a power of two)
    AFTER_FULL: tl.constexpr,  # `_masks._intersect`'s ``positions_after_full``
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
    # The masks' entry, loaded before the walk so that its latency hides behind it.
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
    # Intersect with the masks' entry (`_masks._intersect`).
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
