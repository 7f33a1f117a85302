"""Triton device functions shared by the forward and backward kernels.

Imported only through `ejk_kernels_gpu._triton.kernels`, after the Triton
backend (GPU or interpreter) has been chosen.

Two tuples travel through every helper so that signatures stay short:
``P``, the runtime pointers of the masking tables ``(qsid, ksid, qpos, kpos,
qseg, kseg)``, and ``F``, the constexpr features
``(T, S, H, BLOCK_D, SCALE, SOFT_CAP, HAS_BIAS, VARLEN, HAS_SEG, CAUSAL,
WINDOW_LEFT, WINDOW_RIGHT, DROPOUT_THRESHOLD, DROPOUT_SCALE, LOG2_FACTOR)`` (tuple
items keep their constexpr-ness when indexed, not when star-unpacked).

Softmax runs in base 2 (``exp2`` is the hardware instruction; FlashAttention-2
and the Triton tutorial do the same): `logits` returns a tile ``x`` whose logits
in log2 units are ``x * LOG2_FACTOR``. In the plain case (no bias, no soft cap,
positive scale) ``x`` is the raw ``q·kᵀ`` and the factor is ``scale·log2(e)``, so
scaling and max-subtraction fuse into one FMA; otherwise ``x`` is the natural
logit and the factor ``log2(e)``.
"""

import triton
import triton.language as tl

# The dropout counter hash (reference-spec: mix = MurmurHash3's fmix32 after a golden-ratio xor).
_GOLDEN = tl.constexpr(0x9E3779B1)
_MUR1 = tl.constexpr(0x85EBCA6B)
_MUR2 = tl.constexpr(0xC2B2AE35)
# Rows of the grid scheduled together by `grid_order`: four (batch, head) rows of 32
# 128-row blocks (4k tokens) fill an H100's 132 SMs about once.
GRID_GROUP = tl.constexpr(4)


@triton.jit
def along_q(x, TRANS: tl.constexpr):
    """A per-query vector as a column of a [q, k] tile, or a row of a transposed [k, q] tile."""
    if TRANS:
        return x[None, :]
    else:
        return x[:, None]


@triton.jit
def along_k(x, TRANS: tl.constexpr):
    """A per-key vector as a row of a [q, k] tile, or a column of a transposed [k, q] tile."""
    if TRANS:
        return x[:, None]
    else:
        return x[None, :]


@triton.jit
def _mix(h, x):
    h = h ^ (x * tl.full([], _GOLDEN, tl.uint32))
    h = (h ^ (h >> 16)) * tl.full([], _MUR1, tl.uint32)
    h = (h ^ (h >> 13)) * tl.full([], _MUR2, tl.uint32)
    return h ^ (h >> 16)


@triton.jit
def dropout_keep(seed, b, n, offs_m, offs_n, THRESHOLD: tl.constexpr, TRANS: tl.constexpr):
    """bool tile: keep-mask of rows offs_m, columns offs_n for (batch b, head n)."""
    h = _mix(_mix(seed, b.to(tl.uint32)), n.to(tl.uint32))
    h = along_q(_mix(h, offs_m.to(tl.uint32)), TRANS)
    h = _mix(h, along_k(offs_n.to(tl.uint32), TRANS))
    return (h >> 8) >= tl.full([], THRESHOLD, tl.uint32)


@triton.jit
def tanh(x):
    # 1 - 2 / (e^{2x} + 1): saturates to +-1 without NaN (e^{2x} = inf gives 1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def load_tile(base, rows, offs_d, ROW_STRIDE: tl.constexpr, N_ROWS: tl.constexpr,
              H: tl.constexpr, BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr):  # fmt: skip
    """[len(rows), BLOCK_D] tile of a ``[rows, H]`` slab (zeros past its end)."""
    off = rows[:, None] * ROW_STRIDE + offs_d[None, :]
    if MASK_ROWS:
        return tl.load(base + off, mask=(rows[:, None] < N_ROWS) & (offs_d[None, :] < H), other=0.0)
    elif BLOCK_D != H:
        return tl.load(base + off, mask=offs_d[None, :] < H, other=0.0)
    else:
        return tl.load(base + off)


@triton.jit
def store_tile(base, rows, offs_d, value, ROW_STRIDE: tl.constexpr, N_ROWS: tl.constexpr,
               H: tl.constexpr):  # fmt: skip
    off = rows[:, None] * ROW_STRIDE + offs_d[None, :]
    mask = (rows[:, None] < N_ROWS) & (offs_d[None, :] < H)
    tl.store(base + off, value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def visibility(offs_m, offs_n, b, P, F: tl.constexpr, TRANS: tl.constexpr):
    """bool [BLOCK_M, BLOCK_N] ([BLOCK_N, BLOCK_M] if TRANS): which keys each query sees."""
    T: tl.constexpr = F[0]
    S: tl.constexpr = F[1]
    VARLEN: tl.constexpr = F[7]
    HAS_SEG: tl.constexpr = F[8]
    CAUSAL: tl.constexpr = F[9]
    WINDOW_LEFT: tl.constexpr = F[10]
    WINDOW_RIGHT: tl.constexpr = F[11]
    m_ok = offs_m < T
    n_ok = offs_n < S
    visible = along_q(m_ok, TRANS) & along_k(n_ok, TRANS)
    if VARLEN:
        # Packed input: sequence ids (padding rows/columns get ids that never match)
        # and positions local to their sequence.
        qsid = tl.load(P[0] + offs_m, mask=m_ok, other=-1)
        ksid = tl.load(P[1] + offs_n, mask=n_ok, other=-2)
        visible = visible & (along_q(qsid, TRANS) == along_k(ksid, TRANS))
        pos_q = along_q(tl.load(P[2] + offs_m, mask=m_ok, other=0), TRANS)
        pos_k = along_k(tl.load(P[3] + offs_n, mask=n_ok, other=0), TRANS)
    else:
        pos_q = along_q(offs_m, TRANS)
        pos_k = along_k(offs_n, TRANS)
    if CAUSAL:
        visible = visible & (pos_k <= pos_q)
    if WINDOW_LEFT >= 0:
        visible = visible & (pos_k >= pos_q - WINDOW_LEFT) & (pos_k <= pos_q + WINDOW_RIGHT)
    if HAS_SEG:
        # Equal ids see each other; a negative id is padding (0 is an ordinary segment).
        qs = along_q(tl.load(P[4] + b * T + offs_m, mask=m_ok, other=-1), TRANS)
        ks = along_k(tl.load(P[5] + b * S + offs_n, mask=n_ok, other=-1), TRANS)
        visible = visible & (qs == ks) & (qs >= 0)
    return visible


@triton.jit
def grid_order(HEAVY_LAST: tl.constexpr):
    """(block, row) of this program in a ``(blocks, rows)`` grid, rows being (batch, head).

    Programs start in launch order (``program_id(0)`` fastest). They are handed out by
    groups of `GRID_GROUP` rows: within a group, block by block, heaviest first (causal:
    the last query blocks when ``HEAVY_LAST``, else the first key blocks), each block for
    every row of the group in turn. Long programs then start early and the grid ends on
    short ones, while the programs running together are those of a few rows, sharing their
    keys and values (or queries) in L2 as before.
    """
    blocks = tl.num_programs(0)
    rows = tl.num_programs(1)
    pid = tl.program_id(1) * blocks + tl.program_id(0)
    group = pid // (blocks * GRID_GROUP)
    size = tl.minimum(rows - group * GRID_GROUP, GRID_GROUP)
    rank = pid - group * (blocks * GRID_GROUP)
    block = rank // size
    if HEAVY_LAST:
        block = blocks - 1 - block
    return block, group * GRID_GROUP + rank % size


@triton.jit
def slab(base, ROWS: tl.constexpr, COLS: tl.constexpr, ROW_STRIDE: tl.constexpr,
         BLOCK: tl.constexpr, H: tl.constexpr):  # fmt: skip
    """TMA descriptor of a ``[ROWS, COLS]`` slab in ``[BLOCK, H]`` tiles (zero fill past its end)."""
    return tl.make_tensor_descriptor(base, [ROWS, COLS], [ROW_STRIDE, 1], [BLOCK, H])


@triton.jit
def line(base, LENGTH: tl.constexpr, BLOCK: tl.constexpr):
    """TMA descriptor of ``LENGTH`` float32 values (``BLOCK`` at a time; zero fill past the end)."""
    return tl.make_tensor_descriptor(base, [LENGTH], [1], [BLOCK])


@triton.jit
def block_causal(x, diag, TRANS: tl.constexpr):
    """``x`` with -inf where the key comes after the query: the warp-specialised loops' causal
    mask, in positions relative to the tile (``diag`` = the first column's position minus
    the first row's).

    Rows are queries (keys with TRANS): row ``i`` sees column ``j`` iff ``j <= i - diag``
    (``j >= i - diag``). Not ``offs_m``/``offs_n``: Triton 3.6's Hopper data partitioning
    moves both the scalar and the range of ``row0 + arange`` to the second consumer
    warpgroup's half of the rows, 64 too far (docs/performance.md, ejk-kernels-gpu step 6);
    a bare ``arange`` is moved once. A per-row limit against constant columns leaves a
    compare and a select per element.
    """
    lim = tl.arange(0, x.shape[0]) - diag
    cols = tl.arange(0, x.shape[1])[None, :]
    if TRANS:
        return tl.where(cols >= lim[:, None], x, float("-inf"))
    else:
        return tl.where(cols <= lim[:, None], x, float("-inf"))


@triton.jit
def logits(a, c, bias_base, offs_m, offs_n, b, P, F: tl.constexpr, MASKED: tl.constexpr,
           TRANS: tl.constexpr):  # fmt: skip
    """float32 tile ``x`` with logits·log2(e) = ``x * LOG2_FACTOR``; -inf where hidden.

    ``x`` is the soft-capped natural logit ``cap·tanh((scale·q·kᵀ + bias)/cap)``, or just
    ``q·kᵀ`` when there is neither bias nor soft cap (see the module docstring).
    ``(a, c)`` is ``(q, k)`` for a [BLOCK_M, BLOCK_N] tile, or ``(k, q)`` with TRANS for
    its transpose, which the dk/dv kernel uses so that no register tile needs transposing.
    """
    T: tl.constexpr = F[0]
    S: tl.constexpr = F[1]
    SCALE: tl.constexpr = F[4]
    SOFT_CAP: tl.constexpr = F[5]
    HAS_BIAS: tl.constexpr = F[6]
    LOG2_FACTOR: tl.constexpr = F[14]
    s = tl.dot(a, tl.trans(c))
    if LOG2_FACTOR == 1.4426950408889634:  # not the plain case: natural logits
        s = s * SCALE
    if HAS_BIAS:
        # Masked on both axes even in fully visible blocks: the resident side of a
        # program (rows in fwd/dq, columns in dk/dv) may run past the end.
        qi = along_q(offs_m, TRANS)
        kj = along_k(offs_n, TRANS)
        b_off = qi * S + kj
        bmask = (qi < T) & (kj < S)
        s += tl.load(bias_base + b_off, mask=bmask, other=0.0).to(tl.float32)
    if SOFT_CAP > 0.0:
        s = SOFT_CAP * tanh(s / SOFT_CAP)
    if MASKED:
        s = tl.where(visibility(offs_m, offs_n, b, P, F, TRANS), s, float("-inf"))
    return s


@triton.jit
def dropout_weights(p, seed, b, n, offs_m, offs_n, F: tl.constexpr):
    """``p`` with dropped entries zeroed and kept ones scaled by ``1 / (1 - rate)``."""
    DROPOUT_THRESHOLD: tl.constexpr = F[12]
    DROPOUT_SCALE: tl.constexpr = F[13]
    if DROPOUT_THRESHOLD > 0:
        keep = dropout_keep(seed, b, n, offs_m, offs_n, DROPOUT_THRESHOLD, False)
        p = tl.where(keep, p * DROPOUT_SCALE, 0.0)
    return p


@triton.jit
def grad_logits(q, k, v, do, lse, delta, bias_base, seed, b, n, offs_m, offs_n, P,
                F: tl.constexpr, MASKED: tl.constexpr, TRANS: tl.constexpr, diag,
                BLOCK_CAUSAL: tl.constexpr):  # fmt: skip
    """Recompute one tile's probabilities and the gradient of the pre-cap logits.

    FlashAttention-2, Alg. 2: ``P = exp(s - lse)`` (in base 2: ``lse`` comes in log2
    units), ``dP = dO·vᵀ`` (times the dropout scale where kept), ``dS = P ∘ (dP - delta)``
    with ``delta = rowsum(dO ∘ O)``; through the soft cap ``1 - (s/cap)²``.
    With TRANS every tile is transposed ([BLOCK_N, BLOCK_M]: ``Pᵀ = exp(k·qᵀ ...)``,
    ``dPᵀ = v·dOᵀ``), as the dk/dv kernel consumes them (FlashAttention-2's dK, dV loop).
    BLOCK_CAUSAL: the causal mask of the warp-specialised loops (`block_causal`).

    Returns:
        (P after dropout, dX), float32 tiles.
    """
    SOFT_CAP: tl.constexpr = F[5]
    DROPOUT_THRESHOLD: tl.constexpr = F[12]
    DROPOUT_SCALE: tl.constexpr = F[13]
    LOG2_FACTOR: tl.constexpr = F[14]
    if TRANS:
        s = logits(k, q, bias_base, offs_m, offs_n, b, P, F, MASKED, TRANS)
        dp = tl.dot(v, tl.trans(do))
    else:
        s = logits(q, k, bias_base, offs_m, offs_n, b, P, F, MASKED, TRANS)
        dp = tl.dot(do, tl.trans(v))
    if BLOCK_CAUSAL:
        s = block_causal(s, diag, TRANS)
    p = tl.math.exp2(s * LOG2_FACTOR - along_q(lse, TRANS))
    if DROPOUT_THRESHOLD > 0:
        keep = dropout_keep(seed, b, n, offs_m, offs_n, DROPOUT_THRESHOLD, TRANS)
        p_drop = tl.where(keep, p * DROPOUT_SCALE, 0.0)
        dp = tl.where(keep, dp * DROPOUT_SCALE, 0.0)
    else:
        p_drop = p
    ds = p * (dp - along_q(delta, TRANS))
    if SOFT_CAP > 0.0:
        t = tl.where(s == float("-inf"), 0.0, s / SOFT_CAP)
        ds = ds * (1.0 - t * t)
    return p_drop, ds


@triton.jit
def load_rows(base, offs, N_ROWS: tl.constexpr, MASKED: tl.constexpr, FACTOR: tl.constexpr):
    """Per-row float32 statistics times ``FACTOR`` (lse in log2 units, delta with 1.0).

    A -inf lse (a row with no visible key) becomes 0, so ``exp2(-inf - 0)`` gives 0.
    """
    if MASKED:
        x = tl.load(base + offs, mask=offs < N_ROWS, other=0.0)
    else:
        x = tl.load(base + offs)
    return row_stats(x, FACTOR)


@triton.jit
def row_stats(x, FACTOR: tl.constexpr):
    """Loaded per-row statistics as `load_rows` returns them (``x * FACTOR``, -inf as 0)."""
    return tl.where(x == float("-inf"), 0.0, x * FACTOR)


@triton.jit
def load_ranges(ranges_ptr, pid):
    """This program's ``(lo, full_lo, full_hi, hi)`` from the block table (see `_masks.block_table`)."""
    base = ranges_ptr + pid * 4
    return tl.load(base), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3)
