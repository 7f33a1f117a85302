"""The split-KV (flash-decoding) paged attention kernel, Triton body only.

One program takes one *query tile* (up to ``TILE_T`` consecutive new tokens of one
sequence, `paged._launch.query_tiles`), one kv head and one *split*, a slice of the
tile's key range. Its rows are every (token, query head) pair of the tile that reads
this kv head: row ``r`` is token ``r // G`` and head ``kh·G + r % G``, so a decode step
(``T = 1``) of a GQA group fills ``G`` rows and k and v are read once per group, not
once per query head. Key blocks of ``BLOCK_N`` rows are gathered through the page
table inside the loop (one page per block when ``PAGE`` is a multiple of ``BLOCK_N``,
one page per row otherwise).

Flash-decoding (Dao et al., 2023): with few query rows a sequence's keys are spread
over ``NUM_SPLITS`` programs, each writing a float32 partial output (normalised by its
own row sum) and its log-sum-exp; `paged._launch.combine_splits` merges them. With one
split the program writes the final output itself (sinks folded in, as the forward
kernel does).

Positions are bottom-right (serving): token ``t`` of a sequence with ``q_len`` new
tokens and ``kv_len`` keys sits at ``kv_len - q_len + t``. With ``CAUSAL`` it sees keys
``<=`` its position, with a window ``(WINDOW_LEFT, WINDOW_RIGHT)`` those within it, and
never keys ``>= kv_len`` (nor past the page table's capacity). Keys fully visible to
every row of the tile run without the mask (`_paged_loop` with ``MASKED=False``).

FP8 pages (``KV_SCALES`` 1: one scale for the pool, 2: one per stored token and kv head)
are loaded as e4m3 and converted to q's dtype in registers (exactly: every e4m3 value is
a float16 / bfloat16 one); the key scales multiply the logits' columns and the value
scales the probabilities' columns (per token) or the output (scalar), so the value a slot
holds is ``page * scale`` (`ejk_sequtils.dequantize_kv`) at no extra matmul.
"""

from typing import NamedTuple

import triton
import triton.language as tl

from ._common import LOG2E, lse_from_log2, tanh


class PagedOptions(NamedTuple):
    """The compile-time options of one launch (see `paged._launch.paged_constexprs`)."""

    H: int  # head dim
    BLOCK_D: int  # head dim padded to a power of two
    PAGE: int  # tokens per page
    ROW_STRIDE: int  # elements between the tokens of a page
    SCALE: float
    SOFT_CAP: float  # 0.0: none
    CAUSAL: bool
    WINDOW_LEFT: int  # -1: no window
    WINDOW_RIGHT: int
    LOG2_FACTOR: float  # as in `kernels.triton._common`: logits in log2 units are x * LOG2_FACTOR
    KV_SCALES: int  # fp8 pages: 0 none (pages in q's dtype), 1 one scale, 2 per token and kv head


class _Tile(NamedTuple):
    """What every key block of one program reads besides its keys."""

    q: object  # [BLOCK_M, BLOCK_D] resident queries
    k_base: object  # k_pages / v_pages at this kv head
    v_base: object
    k_scale: object  # KV_SCALES 2: k_scales / v_scales at this kv head; 1: the scales' values
    v_scale: object
    pages: object  # this sequence's row of the page table
    kv_len: object  # keys that exist (positions come from the caller's kv_len)
    pos: object  # [BLOCK_M] position of each row's token
    offs_d: object


@triton.jit
def _slots(pages, start_n, kv_len, F: tl.constexpr, BLOCK_N: tl.constexpr,
           MASKED: tl.constexpr):  # fmt: skip
    """int64 [BLOCK_N]: the pool slot (``page * PAGE + offset``) of the sequence's keys
    ``start_n ...`` through its page table (past ``kv_len`` when MASKED: slot of page 0,
    never read; the table entries of those rows are not read)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if F.PAGE % BLOCK_N == 0:  # the block lies in one page (blocks start at multiples of BLOCK_N)
        page = tl.load(pages + start_n // F.PAGE).to(tl.int64)
    else:
        if MASKED:
            page = tl.load(pages + offs_n // F.PAGE, mask=offs_n < kv_len, other=0)
        else:
            page = tl.load(pages + offs_n // F.PAGE)
        page = page.to(tl.int64)
    return page * F.PAGE + offs_n % F.PAGE


@triton.jit
def _gather(base, slots, offs_n, offs_d, kv_len, F: tl.constexpr, MASKED: tl.constexpr):
    """[BLOCK_N, BLOCK_D] rows of the pool's ``slots`` (zeros past ``kv_len`` when MASKED)."""
    ptrs = base + (slots * F.ROW_STRIDE)[:, None] + offs_d[None, :]
    if MASKED:
        return tl.load(ptrs, mask=(offs_n[:, None] < kv_len) & (offs_d[None, :] < F.H), other=0.0)
    elif F.BLOCK_D != F.H:
        return tl.load(ptrs, mask=offs_d[None, :] < F.H, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _gather_scales(base, slots, offs_n, kv_len, F: tl.constexpr, MASKED: tl.constexpr):
    """float32 [BLOCK_N]: the per-token scales of the pool's ``slots`` (0 past ``kv_len``
    when MASKED, so a stale slot's scale never reaches a logit or a probability)."""
    ptrs = base + slots * (F.ROW_STRIDE // F.H)  # scales [P, PAGE, K]: K per slot
    if MASKED:
        return tl.load(ptrs, mask=offs_n < kv_len, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _visible(pos, offs_n, kv_len, F: tl.constexpr):
    """bool [BLOCK_M, BLOCK_N]: which keys each row sees (bottom-right positions)."""
    key = offs_n[None, :]
    row = pos[:, None]
    visible = key < kv_len
    if F.CAUSAL:
        visible = visible & (key <= row)
    if F.WINDOW_LEFT >= 0:
        visible = visible & (key >= row - F.WINDOW_LEFT) & (key <= row + F.WINDOW_RIGHT)
    return visible


@triton.jit
def _paged_block(acc, m_i, l_i, start_n, tile, F: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASKED: tl.constexpr):  # fmt: skip
    """One key block's online-softmax update (FlashAttention-2, Alg. 1, lines 8-10); the
    running max is in the units of `kernels.triton._common` (log2 in the plain case)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    slots = _slots(tile.pages, start_n, tile.kv_len, F, BLOCK_N, MASKED)
    k = _gather(tile.k_base, slots, offs_n, tile.offs_d, tile.kv_len, F, MASKED)
    v = _gather(tile.v_base, slots, offs_n, tile.offs_d, tile.kv_len, F, MASKED)
    if F.KV_SCALES != 0:  # fp8 pages: e4m3 -> q's dtype is exact; the scales come below
        k = k.to(tile.q.dtype)
        v = v.to(tile.q.dtype)
    x = tl.dot(tile.q, tl.trans(k))
    if F.KV_SCALES == 2:  # q·(k_j · s_j) = (q·k_j) · s_j: scale the logits' columns
        x = x * _gather_scales(tile.k_scale, slots, offs_n, tile.kv_len, F, MASKED)[None, :]
    elif F.KV_SCALES == 1:
        x = x * tile.k_scale
    if F.LOG2_FACTOR == LOG2E:  # natural logits: scale, then the soft cap
        x = x * F.SCALE
        if F.SOFT_CAP > 0.0:
            x = F.SOFT_CAP * tanh(x / F.SOFT_CAP)
    if MASKED:
        x = tl.where(_visible(tile.pos, offs_n, tile.kv_len, F), x, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(x, 1) * (1.0 if F.LOG2_FACTOR == LOG2E else F.LOG2_FACTOR))
    # A row with no visible key yet keeps m = -inf: subtract 0 so exp2(-inf) = 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if F.LOG2_FACTOR == LOG2E:
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(x - m_safe[:, None])
    else:
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(x * F.LOG2_FACTOR - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if F.KV_SCALES == 2:  # Σ_j p_j (v_j · s_j) = Σ_j (p_j · s_j) v_j; l keeps the plain p
        p = p * _gather_scales(tile.v_scale, slots, offs_n, tile.kv_len, F, MASKED)[None, :]
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _paged_loop(acc, m_i, l_i, start, end, tile, F: tl.constexpr, BLOCK_N: tl.constexpr,
                MASKED: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """Key blocks ``start, start + BLOCK_N, ...`` below ``end``."""
    if INTERPRET:  # a while loop: the interpreter cannot take a loaded value as range() bound
        start_n = start
        while start_n < end:
            acc, m_i, l_i = _paged_block(acc, m_i, l_i, start_n, tile, F, BLOCK_N, MASKED)
            start_n += BLOCK_N
    else:
        for start_n in range(start, end, BLOCK_N):
            acc, m_i, l_i = _paged_block(acc, m_i, l_i, start_n, tile, F, BLOCK_N, MASKED)
    return acc, m_i, l_i


@triton.jit
def _key_range(first, last, kv_len, F: tl.constexpr):
    """``(lo, hi, full_lo, full_hi)``: the keys some row of a tile whose tokens sit at
    positions ``first..last`` sees, and those every row sees."""
    hi = kv_len
    full_hi = kv_len
    lo = 0
    full_lo = 0
    if F.CAUSAL:
        hi = tl.minimum(hi, last + 1)
        full_hi = tl.minimum(full_hi, first + 1)
    if F.WINDOW_LEFT >= 0:
        hi = tl.minimum(hi, last + F.WINDOW_RIGHT + 1)
        full_hi = tl.minimum(full_hi, first + F.WINDOW_RIGHT + 1)
        lo = tl.maximum(lo, first - F.WINDOW_LEFT)
        full_lo = tl.maximum(full_lo, last - F.WINDOW_LEFT)
    return lo, hi, full_lo, full_hi


@triton.jit
def paged_kernel(
    q_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, page_table_ptr, tiles_ptr, sinks_ptr,
    o_ptr, lse_ptr,
    ROWS: tl.constexpr, N: tl.constexpr, G: tl.constexpr, H: tl.constexpr,
    PAGES_PER_SEQ: tl.constexpr, PAGE: tl.constexpr, ROW_STRIDE: tl.constexpr,
    SCALE: tl.constexpr, SOFT_CAP: tl.constexpr, CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, LOG2_FACTOR: tl.constexpr,
    KV_SCALES: tl.constexpr, HAS_SINKS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    TILE_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """Grid ``(NUM_SPLITS, tiles · K)``.

    ``tiles_ptr``: int32 ``[tiles, 5]`` rows ``(seq, first q row, first token, q_len,
    kv_len)`` (`paged._launch.query_tiles`); a tile with ``q_len = 0`` does nothing.
    ``q_ptr``: ``[ROWS, N, H]``. ``k_scales_ptr``/``v_scales_ptr``: float32 ``[P, PAGE, K]``
    (``KV_SCALES`` 2), ``[1]`` (1), or unused (0). Outputs: with one split
    ``o [ROWS, N, H]`` in q's dtype; otherwise float32 ``o [NUM_SPLITS, ROWS, N, H]`` and ``lse [NUM_SPLITS, ROWS, N]``.
    """
    F: tl.constexpr = PagedOptions(
        H=H, BLOCK_D=BLOCK_D, PAGE=PAGE, ROW_STRIDE=ROW_STRIDE,
        SCALE=SCALE, SOFT_CAP=SOFT_CAP, CAUSAL=CAUSAL, WINDOW_LEFT=WINDOW_LEFT,
        WINDOW_RIGHT=WINDOW_RIGHT, LOG2_FACTOR=LOG2_FACTOR, KV_SCALES=KV_SCALES,
    )  # fmt: skip
    K: tl.constexpr = N // G
    split = tl.program_id(0)
    tile_id = tl.program_id(1) // K
    kh = tl.program_id(1) % K
    entry = tiles_ptr + tile_id * 5
    seq = tl.load(entry)
    q_start = tl.load(entry + 1)
    t0 = tl.load(entry + 2)
    q_len = tl.load(entry + 3)
    kv_len = tl.load(entry + 4)

    # Rows: token r // G of the tile, query head kh·G + r % G.
    offs_m = tl.arange(0, BLOCK_M)
    tok = t0 + offs_m // G
    row_ok = (offs_m < TILE_T * G) & (tok < q_len)
    head = kh * G + offs_m % G
    offs_d = tl.arange(0, BLOCK_D)
    q_off = (q_start + tok).to(tl.int64) * (N * H) + head * H
    q_mask = row_ok[:, None] & (offs_d[None, :] < H)
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=q_mask, other=0.0)
    pos = kv_len - q_len + tok

    # Keys that exist: a kv_len past the table's capacity (possible only with traced values,
    # which validation cannot check) still places the queries, but reads stay in the table.
    keys = tl.minimum(kv_len, PAGES_PER_SEQ * PAGE)
    first = kv_len - q_len + t0
    last = kv_len - q_len + tl.minimum(t0 + TILE_T, q_len) - 1
    lo, hi, full_lo, full_hi = _key_range(first, last, keys, F)
    hi = tl.where(q_len > t0, hi, 0)  # an unused tile reads nothing
    # This split's share of the key blocks [lo, hi) (blocks at multiples of BLOCK_N).
    lo = lo // BLOCK_N * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N), NUM_SPLITS) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(hi, start + per_split)
    end = tl.maximum(end, start)
    # Blocks every row sees in full run unmasked: [mid_lo, mid_hi) inside [start, end).
    mid_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, start), end)
    mid_hi = tl.minimum(tl.maximum(full_hi // BLOCK_N * BLOCK_N, mid_lo), end)

    if KV_SCALES == 2:
        k_scale = k_scales_ptr + kh
        v_scale = v_scales_ptr + kh
    elif KV_SCALES == 1:
        k_scale = tl.load(k_scales_ptr)
        v_scale = tl.load(v_scales_ptr)
    else:
        k_scale = 1.0
        v_scale = 1.0
    tile = _Tile(
        q,
        k_ptr + kh * H,
        v_ptr + kh * H,
        k_scale,
        v_scale,
        page_table_ptr + seq.to(tl.int64) * PAGES_PER_SEQ,
        keys,
        pos,
        offs_d,
    )
    if HAS_SINKS and NUM_SPLITS == 1:
        # The sink is a key with a logit and no value (as in the forward kernel);
        # with several splits `combine_splits` adds it.
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        if LOG2_FACTOR != LOG2E:
            sink = sink * 1.4426950408889634
        m_i = sink
        l_i = tl.zeros([BLOCK_M], tl.float32) + 1.0
    else:
        m_i = tl.zeros([BLOCK_M], tl.float32) + float("-inf")
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, m_i, l_i = _paged_loop(acc, m_i, l_i, start, mid_lo, tile, F, BLOCK_N, True, INTERPRET)
    acc, m_i, l_i = _paged_loop(acc, m_i, l_i, mid_lo, mid_hi, tile, F, BLOCK_N, False, INTERPRET)
    acc, m_i, l_i = _paged_loop(acc, m_i, l_i, mid_hi, end, tile, F, BLOCK_N, True, INTERPRET)

    has_mass = l_i > 0.0
    l_safe = tl.where(has_mass, l_i, 1.0)
    out = acc / l_safe[:, None]
    if KV_SCALES == 1:  # one value scale: it factors out of Σ_j p_j v_j
        out = out * v_scale
    row_off = (q_start + tok).to(tl.int64) * N + head
    if NUM_SPLITS == 1:
        tl.store(o_ptr + row_off[:, None] * H + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=q_mask)  # fmt: skip
    else:
        if LOG2_FACTOR == LOG2E:
            lse = m_i + tl.log(l_safe)
        else:
            lse = lse_from_log2(m_i, l_safe)
        lse = tl.where(has_mass, lse, float("-inf"))
        split_off = split.to(tl.int64) * (ROWS * N)
        tl.store(lse_ptr + split_off + row_off, lse, mask=row_ok)
        tl.store(o_ptr + (split_off + row_off)[:, None] * H + offs_d[None, :], out, mask=q_mask)
