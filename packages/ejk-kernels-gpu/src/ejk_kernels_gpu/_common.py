"""Triton device functions shared by the forward and backward kernels.

Imported only through `ejk_kernels_gpu._triton.kernels`, after the Triton
backend (GPU or interpreter) has been chosen.
"""

import triton
import triton.language as tl

# The dropout counter hash (reference-spec: mix = MurmurHash3's fmix32 after a golden-ratio xor).
_GOLDEN = 0x9E3779B1
_MUR1 = 0x85EBCA6B
_MUR2 = 0xC2B2AE35


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
def visibility(
    offs_m,
    offs_n,
    qsid_ptr,
    ksid_ptr,
    qpos_ptr,
    kpos_ptr,
    qseg_ptr,
    kseg_ptr,
    b,
    T: tl.constexpr,
    S: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_SEG: tl.constexpr,
):
    """bool [BLOCK_M, BLOCK_N]: which keys each query sees (reference-spec visibility)."""
    m_ok = offs_m < T
    n_ok = offs_n < S
    visible = m_ok[:, None] & n_ok[None, :]
    if VARLEN:
        # Packed input: sequence ids (padding rows/columns get ids that never match)
        # and positions local to their sequence.
        qsid = tl.load(qsid_ptr + offs_m, mask=m_ok, other=-1)
        ksid = tl.load(ksid_ptr + offs_n, mask=n_ok, other=-2)
        visible = visible & (qsid[:, None] == ksid[None, :])
        pos_q = tl.load(qpos_ptr + offs_m, mask=m_ok, other=0)
        pos_k = tl.load(kpos_ptr + offs_n, mask=n_ok, other=0)
    else:
        pos_q = offs_m
        pos_k = offs_n
    if CAUSAL:
        visible = visible & (pos_k[None, :] <= pos_q[:, None])
    if WINDOW_LEFT >= 0:
        visible = visible & (pos_k[None, :] >= pos_q[:, None] - WINDOW_LEFT)
        visible = visible & (pos_k[None, :] <= pos_q[:, None] + WINDOW_RIGHT)
    if HAS_SEG:
        qs = tl.load(qseg_ptr + b * T + offs_m, mask=m_ok, other=0)
        ks = tl.load(kseg_ptr + b * S + offs_n, mask=n_ok, other=0)
        visible = visible & (qs[:, None] == ks[None, :]) & (qs[:, None] > 0)
    return visible
