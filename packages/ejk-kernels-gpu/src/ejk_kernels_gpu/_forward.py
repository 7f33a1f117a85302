"""The forward flash-attention kernel (FlashAttention-2, Alg. 1), Triton bodies only.

One program computes ``BLOCK_M`` query rows of one (batch, query head) with an
online softmax in float32. The key blocks it visits come from a per-query-block
table ``ranges[m] = (lo, full_lo, full_hi, hi)`` built by `_ops`: blocks outside
``[lo, hi)`` are skipped (causal, window, packed bounds), blocks inside
``[full_lo, full_hi)`` are fully visible and run without a mask.
"""

import triton
import triton.language as tl

from ._common import dropout_keep, tanh, visibility


@triton.jit
def _fwd_block(
    acc,
    m_i,
    l_i,
    start_n,
    q,
    k_base,
    v_base,
    bias_base,
    seed,
    b,
    n,
    offs_m,
    offs_d,
    qsid_ptr,
    ksid_ptr,
    qpos_ptr,
    kpos_ptr,
    qseg_ptr,
    kseg_ptr,
    T: tl.constexpr,
    S: tl.constexpr,
    H: tl.constexpr,
    KV_STRIDE: tl.constexpr,
    SCALE: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_SEG: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    DROPOUT_THRESHOLD: tl.constexpr,
    DROPOUT_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kv_mask = offs_d[None, :] < H
    if MASKED:
        kv_mask = kv_mask & (offs_n[:, None] < S)
    kv_off = offs_n[:, None] * KV_STRIDE + offs_d[None, :]
    if MASKED or BLOCK_D != H:
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_base + kv_off)
        v = tl.load(v_base + kv_off)
    s = tl.dot(q, tl.trans(k)) * SCALE
    if HAS_BIAS:
        b_off = offs_m[:, None] * S + offs_n[None, :]
        bmask = offs_m[:, None] < T
        if MASKED:
            bmask = bmask & (offs_n[None, :] < S)
        s += tl.load(bias_base + b_off, mask=bmask, other=0.0).to(tl.float32)
    if SOFT_CAP > 0.0:
        s = SOFT_CAP * tanh(s / SOFT_CAP)
    if MASKED:
        visible = visibility(
            offs_m, offs_n, qsid_ptr, ksid_ptr, qpos_ptr, kpos_ptr, qseg_ptr, kseg_ptr, b,
            T, S, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, VARLEN, HAS_SEG,
        )  # fmt: skip
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead so
    # exp(-inf - 0) = 0 rather than exp(-inf + inf) = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DROPOUT_THRESHOLD > 0:
        keep = dropout_keep(seed, b, n, offs_m, offs_n, DROPOUT_THRESHOLD)
        p = tl.where(keep, p * DROPOUT_SCALE, 0.0)
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _fwd_loop(acc, m_i, l_i, start, end, args, MASKED: tl.constexpr, INTERPRET: tl.constexpr):
    """Key blocks ``start, start + BLOCK_N, ...`` below ``end``."""
    BLOCK_N: tl.constexpr = args[-2]
    if INTERPRET:
        # Triton's interpreter cannot take a loaded value as a range() bound under
        # numpy >= 2 (int() of a 1-element array), so it walks a while loop instead;
        # compiled code keeps range(), which the software pipeliner understands.
        start_n = start
        while start_n < end:
            acc, m_i, l_i = _fwd_block(acc, m_i, l_i, start_n, *args, MASKED)
            start_n += BLOCK_N
    else:
        for start_n in range(start, end, BLOCK_N):
            acc, m_i, l_i = _fwd_block(acc, m_i, l_i, start_n, *args, MASKED)
    return acc, m_i, l_i


@triton.jit
def fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bias_ptr,
    sinks_ptr,
    qsid_ptr,
    ksid_ptr,
    qpos_ptr,
    kpos_ptr,
    qseg_ptr,
    kseg_ptr,
    ranges_ptr,
    seed_ptr,
    o_ptr,
    lse_ptr,
    T: tl.constexpr,
    S: tl.constexpr,
    N: tl.constexpr,
    G: tl.constexpr,
    H: tl.constexpr,
    BIAS_SB: tl.constexpr,
    BIAS_SN: tl.constexpr,
    SCALE: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_SEG: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    DROPOUT_THRESHOLD: tl.constexpr,
    DROPOUT_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bn = tl.program_id(1)
    b = pid_bn // N
    n = pid_bn % N
    kh = n // G
    K: tl.constexpr = N // G
    b64 = b.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < T

    q_base = q_ptr + b64 * (T * N * H) + n * H
    q_off = offs_m[:, None] * (N * H) + offs_d[None, :]
    q = tl.load(q_base + q_off, mask=m_ok[:, None] & (offs_d[None, :] < H), other=0.0)
    k_base = k_ptr + b64 * (S * K * H) + kh * H
    v_base = v_ptr + b64 * (S * K * H) + kh * H
    bias_base = bias_ptr + b64 * BIAS_SB + n * BIAS_SN
    seed = tl.load(seed_ptr)

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + n).to(tl.float32)
        m_i = tl.zeros([BLOCK_M], tl.float32) + sink
        l_i = tl.zeros([BLOCK_M], tl.float32) + 1.0
    else:
        m_i = tl.zeros([BLOCK_M], tl.float32) + float("-inf")
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    lo = tl.load(ranges_ptr + pid_m * 4)
    full_lo = tl.load(ranges_ptr + pid_m * 4 + 1)
    full_hi = tl.load(ranges_ptr + pid_m * 4 + 2)
    hi = tl.load(ranges_ptr + pid_m * 4 + 3)
    args = (
        q, k_base, v_base, bias_base, seed, b, n, offs_m, offs_d,
        qsid_ptr, ksid_ptr, qpos_ptr, kpos_ptr, qseg_ptr, kseg_ptr,
        T, S, H, K * H, SCALE, SOFT_CAP, HAS_BIAS, VARLEN, HAS_SEG, CAUSAL,
        WINDOW_LEFT, WINDOW_RIGHT, DROPOUT_THRESHOLD, DROPOUT_SCALE, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    acc, m_i, l_i = _fwd_loop(acc, m_i, l_i, lo, full_lo, args, True, INTERPRET)
    acc, m_i, l_i = _fwd_loop(acc, m_i, l_i, full_lo, full_hi, args, False, INTERPRET)
    acc, m_i, l_i = _fwd_loop(acc, m_i, l_i, full_hi, hi, args, True, INTERPRET)

    # Rows with no mass (no visible key, no sink) output exactly 0 with lse = -inf.
    has_mass = l_i > 0.0
    l_safe = tl.where(has_mass, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_mass, m_i + tl.log(l_safe), float("-inf"))
    tl.store(lse_ptr + (b * N + n) * T + offs_m, lse, mask=m_ok)
    o_base = o_ptr + b64 * (T * N * H) + n * H
    tl.store(
        o_base + q_off, out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_d[None, :] < H)
    )
