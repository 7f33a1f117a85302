"""Triton device functions shared by the forward and backward kernels.

Imported only through `ejk_kernels_gpu._triton.kernels`, after the Triton
backend (GPU or interpreter) has been chosen.

Two tuples travel through every helper so that signatures stay short:
``P``, the runtime pointers of the masking tables ``(qsid, ksid, qpos, kpos,
qseg, kseg)``, and ``F``, the constexpr features
``(T, S, H, BLOCK_D, SCALE, SOFT_CAP, HAS_BIAS, VARLEN, HAS_SEG, CAUSAL,
WINDOW_LEFT, WINDOW_RIGHT, DROPOUT_THRESHOLD, DROPOUT_SCALE)`` (tuple items keep
their constexpr-ness when indexed, not when star-unpacked).
"""

import triton
import triton.language as tl

# The dropout counter hash (reference-spec: mix = MurmurHash3's fmix32 after a golden-ratio xor).
_GOLDEN = tl.constexpr(0x9E3779B1)
_MUR1 = tl.constexpr(0x85EBCA6B)
_MUR2 = tl.constexpr(0xC2B2AE35)


@triton.jit
def _mix(h, x):
    h = h ^ (x * tl.full([], _GOLDEN, tl.uint32))
    h = (h ^ (h >> 16)) * tl.full([], _MUR1, tl.uint32)
    h = (h ^ (h >> 13)) * tl.full([], _MUR2, tl.uint32)
    return h ^ (h >> 16)


@triton.jit
def dropout_keep(seed, b, n, offs_m, offs_n, THRESHOLD: tl.constexpr):
    """bool [BLOCK_M, BLOCK_N]: keep-mask of rows offs_m, columns offs_n for (batch b, head n)."""
    h = _mix(_mix(seed, b.to(tl.uint32)), n.to(tl.uint32))
    h = _mix(h, offs_m.to(tl.uint32))[:, None]
    h = _mix(h, offs_n.to(tl.uint32)[None, :])
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
def visibility(offs_m, offs_n, b, P, F: tl.constexpr):
    """bool [BLOCK_M, BLOCK_N]: which keys each query sees (reference-spec visibility)."""
    T: tl.constexpr = F[0]
    S: tl.constexpr = F[1]
    VARLEN: tl.constexpr = F[7]
    HAS_SEG: tl.constexpr = F[8]
    CAUSAL: tl.constexpr = F[9]
    WINDOW_LEFT: tl.constexpr = F[10]
    WINDOW_RIGHT: tl.constexpr = F[11]
    m_ok = offs_m < T
    n_ok = offs_n < S
    visible = m_ok[:, None] & n_ok[None, :]
    if VARLEN:
        # Packed input: sequence ids (padding rows/columns get ids that never match)
        # and positions local to their sequence.
        qsid = tl.load(P[0] + offs_m, mask=m_ok, other=-1)
        ksid = tl.load(P[1] + offs_n, mask=n_ok, other=-2)
        visible = visible & (qsid[:, None] == ksid[None, :])
        pos_q = tl.load(P[2] + offs_m, mask=m_ok, other=0)
        pos_k = tl.load(P[3] + offs_n, mask=n_ok, other=0)
    else:
        pos_q = offs_m
        pos_k = offs_n
    if CAUSAL:
        visible = visible & (pos_k[None, :] <= pos_q[:, None])
    if WINDOW_LEFT >= 0:
        visible = visible & (pos_k[None, :] >= pos_q[:, None] - WINDOW_LEFT)
        visible = visible & (pos_k[None, :] <= pos_q[:, None] + WINDOW_RIGHT)
    if HAS_SEG:
        qs = tl.load(P[4] + b * T + offs_m, mask=m_ok, other=0)
        ks = tl.load(P[5] + b * S + offs_n, mask=n_ok, other=0)
        visible = visible & (qs[:, None] == ks[None, :]) & (qs[:, None] > 0)
    return visible


@triton.jit
def logits(q, k, bias_base, offs_m, offs_n, b, P, F: tl.constexpr, MASKED: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N]: soft-capped ``scale * q·kᵀ + bias``, -inf where not visible."""
    T: tl.constexpr = F[0]
    S: tl.constexpr = F[1]
    SCALE: tl.constexpr = F[4]
    SOFT_CAP: tl.constexpr = F[5]
    HAS_BIAS: tl.constexpr = F[6]
    s = tl.dot(q, tl.trans(k)) * SCALE
    if HAS_BIAS:
        # Masked on both axes even in fully visible blocks: the resident side of a
        # program (rows in fwd/dq, columns in dk/dv) may run past the end.
        b_off = offs_m[:, None] * S + offs_n[None, :]
        bmask = (offs_m[:, None] < T) & (offs_n[None, :] < S)
        s += tl.load(bias_base + b_off, mask=bmask, other=0.0).to(tl.float32)
    if SOFT_CAP > 0.0:
        s = SOFT_CAP * tanh(s / SOFT_CAP)
    if MASKED:
        s = tl.where(visibility(offs_m, offs_n, b, P, F), s, float("-inf"))
    return s


@triton.jit
def dropout_weights(p, seed, b, n, offs_m, offs_n, F: tl.constexpr):
    """``p`` with dropped entries zeroed and kept ones scaled by ``1 / (1 - rate)``."""
    DROPOUT_THRESHOLD: tl.constexpr = F[12]
    DROPOUT_SCALE: tl.constexpr = F[13]
    if DROPOUT_THRESHOLD > 0:
        keep = dropout_keep(seed, b, n, offs_m, offs_n, DROPOUT_THRESHOLD)
        p = tl.where(keep, p * DROPOUT_SCALE, 0.0)
    return p


@triton.jit
def grad_logits(q, k, v, do, lse, delta, bias_base, seed, b, n, offs_m, offs_n, P,
                F: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Recompute one tile's probabilities and the gradient of the pre-cap logits.

    FlashAttention-2, Alg. 2: ``P = exp(s - lse)``, ``dP = dO·vᵀ`` (times the
    dropout scale where kept), ``dS = P ∘ (dP - delta)`` with ``delta = rowsum(dO ∘ O)``;
    through the soft cap ``d(cap·tanh(x/cap))/dx = 1 - (s/cap)²``.

    Returns:
        (P after dropout [BLOCK_M, BLOCK_N], dX [BLOCK_M, BLOCK_N]), both float32.
    """
    SOFT_CAP: tl.constexpr = F[5]
    DROPOUT_THRESHOLD: tl.constexpr = F[12]
    DROPOUT_SCALE: tl.constexpr = F[13]
    s = logits(q, k, bias_base, offs_m, offs_n, b, P, F, MASKED)
    p = tl.exp(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v))
    if DROPOUT_THRESHOLD > 0:
        keep = dropout_keep(seed, b, n, offs_m, offs_n, DROPOUT_THRESHOLD)
        p_drop = tl.where(keep, p * DROPOUT_SCALE, 0.0)
        dp = tl.where(keep, dp * DROPOUT_SCALE, 0.0)
    else:
        p_drop = p
    ds = p * (dp - delta[:, None])
    if SOFT_CAP > 0.0:
        t = tl.where(s == float("-inf"), 0.0, s / SOFT_CAP)
        ds = ds * (1.0 - t * t)
    return p_drop, ds


@triton.jit
def load_rows(base, offs, N_ROWS: tl.constexpr, MASKED: tl.constexpr):
    """Per-row float32 statistics (lse, delta); -inf lse (empty rows) becomes 0 so exp gives 0."""
    if MASKED:
        x = tl.load(base + offs, mask=offs < N_ROWS, other=0.0)
    else:
        x = tl.load(base + offs)
    return tl.where(x == float("-inf"), 0.0, x)
