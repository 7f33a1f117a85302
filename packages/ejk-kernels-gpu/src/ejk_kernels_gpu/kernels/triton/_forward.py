"""The forward flash-attention kernel (FlashAttention-2, Alg. 1), Triton bodies only.

One program computes ``BLOCK_M`` query rows of one (batch, query head) with an
online softmax in float32. The key blocks it visits come from a per-query-block
table ``ranges[m] = (lo, full_lo, full_hi, hi)`` built by `flash._tables.block_table`:
blocks outside ``[lo, hi)`` are skipped (causal, window, packed bounds), blocks
inside ``[full_lo, full_hi)`` are fully visible and run without a mask.

On Hopper the fully visible and the causal-only calls can take a warp-specialised loop
fed by TMA (`_fwd_ws_loop`), which has to stay a single loop: causal calls mask every
block there, with block-relative positions (see `_fwd_step`).

The loops carry the call's `Options` ``F`` and masking tables ``P`` (see `kernels.triton._common`)
and this program's `_Context`.
"""

from typing import NamedTuple

import triton
import triton.language as tl

from ._common import (
    LN2,
    LOG2E,
    MaskTables,
    Options,
    block_causal,
    dropout_weights,
    grid_order,
    kv_bases,
    load_ranges,
    load_tile,
    logits,
    lse_from_log2,
    slab,
    softmax_rows,
    store_tile,
)


class _Context(NamedTuple):
    """What every key block of one forward program reads besides its k and v tiles."""

    q: object  # the resident [BLOCK_M, BLOCK_D] query tile
    k_base: object  # this (batch, kv head)'s k and v slabs
    v_base: object
    bias_base: object
    dropout_key: object  # uint32 [5] (`dropout_keep`)
    b: object  # batch index
    n: object  # query head
    offs_m: object  # query rows
    offs_d: object  # head-dim columns


@triton.jit
def _fwd_block(acc, m_i, l_i, start_n, ctx, P, F: tl.constexpr, BLOCK_N: tl.constexpr,
               KV_STRIDE: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_tile(ctx.k_base, offs_n, ctx.offs_d, KV_STRIDE, F.S, F.H, F.BLOCK_D, MASKED)
    v = load_tile(ctx.v_base, offs_n, ctx.offs_d, KV_STRIDE, F.S, F.H, F.BLOCK_D, MASKED)
    return _fwd_step(acc, m_i, l_i, k, v, start_n, ctx, P, F, BLOCK_N, MASKED, 0, False)


@triton.jit
def _fwd_step(acc, m_i, l_i, k, v, start_n, ctx, P, F: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, diag, BLOCK_CAUSAL: tl.constexpr):  # fmt: skip
    """One key block's online-softmax update of (acc, m, l), given its k and v tiles.

    BLOCK_CAUSAL: the warp-specialised loop's causal mask (`block_causal`), ``diag`` = the
    block's first key minus the query block's first row.

    The running max ``m`` is in log2 units in the plain case (max commutes with the
    positive factor: one FMA per logit), in natural units with natural logits, where it
    is subtracted before the exponential (see `kernels.triton._common`).
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    x = logits(ctx.q, k, ctx.bias_base, ctx.offs_m, offs_n, ctx.b, P, F, MASKED, False)
    if BLOCK_CAUSAL:
        x = block_causal(x, diag, False)
    if F.LOG2_FACTOR == LOG2E:  # natural logits
        m_new = tl.maximum(m_i, tl.max(x, 1))
    else:
        m_new = tl.maximum(m_i, tl.max(x, 1) * F.LOG2_FACTOR)
    # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead so
    # exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if F.LOG2_FACTOR == LOG2E:
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(x - m_safe[:, None])
    else:
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(x * F.LOG2_FACTOR - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    p = dropout_weights(p, ctx.dropout_key, ctx.b, ctx.n, ctx.offs_m, offs_n, F)
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _fwd_loop(acc, m_i, l_i, start, end, ctx, P, F: tl.constexpr, BLOCK_N: tl.constexpr,
              KV_STRIDE: tl.constexpr, MASKED: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """Key blocks ``start, start + BLOCK_N, ...`` below ``end``."""
    if INTERPRET:
        # Triton's interpreter cannot take a loaded value as a range() bound under
        # numpy >= 2 (int() of a 1-element array), so it walks a while loop instead;
        # compiled code keeps range(), which the software pipeliner understands.
        start_n = start
        while start_n < end:
            acc, m_i, l_i = _fwd_block(
                acc, m_i, l_i, start_n, ctx, P, F, BLOCK_N, KV_STRIDE, MASKED
            )
            start_n += BLOCK_N
    else:
        for start_n in range(start, end, BLOCK_N):
            acc, m_i, l_i = _fwd_block(
                acc, m_i, l_i, start_n, ctx, P, F, BLOCK_N, KV_STRIDE, MASKED
            )
    return acc, m_i, l_i


@triton.jit
def _fwd_ws_block(acc, m_i, l_i, start_n, ctx, P, F: tl.constexpr, BLOCK_N: tl.constexpr,
                  K_DESC, V_DESC, row0):  # fmt: skip
    """One step of `_fwd_ws_loop`: the key block at ``start_n`` through TMA; causal calls
    mask it relative to the query block's first row ``row0``."""
    k = K_DESC.load([start_n, 0])
    v = V_DESC.load([start_n, 0])
    return _fwd_step(acc, m_i, l_i, k, v, start_n, ctx, P, F, BLOCK_N, False, start_n - row0,
                     F.CAUSAL)  # fmt: skip


@triton.jit
def _fwd_ws_loop(acc, m_i, l_i, start, end, ctx, P, F: tl.constexpr, BLOCK_N: tl.constexpr,
                 K_DESC, V_DESC, row0, INTERPRET: tl.constexpr):  # fmt: skip
    """Key blocks through TMA, warp-specialised (Hopper; see `FlashConfig`).

    Triton 3.6 specialises only a kernel's single loop, fed by tensor-descriptor loads:
    one producer warpgroup issues the TMA copies, two consumer warpgroups each take half
    of the query rows. A second loop or a masked step outside it does not build, so a
    causal call masks every block here (the block-relative mask of `_fwd_step`).
    The interpreter (tests) walks the same blocks in a while loop, as `_fwd_loop` does.
    """
    if INTERPRET:
        start_n = start
        while start_n < end:
            acc, m_i, l_i = _fwd_ws_block(
                acc, m_i, l_i, start_n, ctx, P, F, BLOCK_N, K_DESC, V_DESC, row0
            )
            start_n += BLOCK_N
    else:
        for start_n in tl.range(start, end, BLOCK_N, warp_specialize=True):
            acc, m_i, l_i = _fwd_ws_block(
                acc, m_i, l_i, start_n, ctx, P, F, BLOCK_N, K_DESC, V_DESC, row0
            )
    return acc, m_i, l_i


@triton.jit
def _natural_lse(m_i, l_i, F: tl.constexpr):
    """The lse in natural units from the running max (in its units, see `_fwd_step`) and sum."""
    if F.LOG2_FACTOR == LOG2E:
        return m_i + tl.math.log2(l_i) * LN2
    else:
        return lse_from_log2(m_i, l_i)


@triton.jit
def fwd_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, sinks_ptr, prev_o_ptr, prev_lse_ptr,
    qsid_ptr, ksid_ptr, qpos_ptr, kpos_ptr, qseg_ptr, kseg_ptr, ranges_ptr, seed_ptr,
    o_ptr, lse_ptr, scratch_ptr,
    T: tl.constexpr, S: tl.constexpr, N: tl.constexpr, G: tl.constexpr, H: tl.constexpr,
    BIAS_SB: tl.constexpr, BIAS_SN: tl.constexpr, SCALE: tl.constexpr, SOFT_CAP: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SINKS: tl.constexpr, VARLEN: tl.constexpr, HAS_SEG: tl.constexpr,
    SEQ_IDS: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    DROPOUT_THRESHOLD: tl.constexpr, DROPOUT_SCALE: tl.constexpr, LOG2_FACTOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
    WS: tl.constexpr, RESUME: tl.constexpr, KV_PAIR: tl.constexpr,
):  # fmt: skip
    """out [B, T, N, H] and the lse (or, with a bias, the rows: see `flash._forward_launch`).
    ``RESUME`` (not with ``WS``, a bias or sinks): the rows continue a previous call over
    other keys from its output and lse (``prev_o_ptr``, ``prev_lse_ptr``, which ``o_ptr``
    and ``lse_ptr`` alias): m = its lse, l = 1, acc = its output; a program that sees no
    key here stores nothing. ``KV_PAIR``: k and v are the halves of one array
    (`kv_bases`)."""
    F: tl.constexpr = Options(
        T=T, S=S, H=H, BLOCK_D=BLOCK_D, SCALE=SCALE, SOFT_CAP=SOFT_CAP, HAS_BIAS=HAS_BIAS,
        VARLEN=VARLEN, SEQ_IDS=SEQ_IDS, HAS_SEG=HAS_SEG, CAUSAL=CAUSAL, WINDOW_LEFT=WINDOW_LEFT,
        WINDOW_RIGHT=WINDOW_RIGHT, DROPOUT_THRESHOLD=DROPOUT_THRESHOLD,
        DROPOUT_SCALE=DROPOUT_SCALE, LOG2_FACTOR=LOG2_FACTOR, BIAS_SN=BIAS_SN, DQ_ATOMIC=False,
        DQ_TMA=False, LSE_FACTOR=1.0 if LOG2_FACTOR == LOG2E else LOG2E,
    )  # fmt: skip
    P = MaskTables(qsid_ptr, ksid_ptr, qpos_ptr, kpos_ptr, qseg_ptr, kseg_ptr)
    K: tl.constexpr = N // G
    # Heaviest query blocks first (causal: the last ones) so the tail of the grid is short.
    pid_m, pid_bn = grid_order(True)
    b = pid_bn // N
    n = pid_bn % N
    kh = n // G
    b64 = b.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    q_base = q_ptr + b64 * (T * N * H) + n * H
    o_base = o_ptr + b64 * (T * N * H) + n * H
    if WS:
        # Tensor descriptors of this (batch, head)'s [rows, H] slabs; TMA zero-fills rows past
        # the end and clips stores there. `scratch_ptr` only sizes the launch (see _jax_triton_fix).
        q_desc = slab(q_base, T, H, N * H, BLOCK_M, BLOCK_D)
        o_desc = slab(o_base, T, H, N * H, BLOCK_M, BLOCK_D)
        q = q_desc.load([pid_m * BLOCK_M, 0])
    else:
        q = load_tile(q_base, offs_m, offs_d, N * H, T, H, BLOCK_D, True)
    k_base, v_base = kv_bases(k_ptr, v_ptr, b64, kh, S, K, H, KV_PAIR)
    kv_row: tl.constexpr = 2 * K * H if KV_PAIR else K * H  # k's and v's row stride
    bias_base = bias_ptr + b64 * BIAS_SB + n * BIAS_SN
    ctx = _Context(q, k_base, v_base, bias_base, seed_ptr, b, n, offs_m, offs_d)

    if HAS_SINKS:
        # The sink is a key with logit `sink` and no value: start the running max at
        # it (in the units of m, see _fwd_step) with mass exp(sink - sink) = 1.
        sink = tl.load(sinks_ptr + n).to(tl.float32)
        if LOG2_FACTOR != LOG2E:
            sink = sink * 1.4426950408889634
        m_i = tl.zeros([BLOCK_M], tl.float32) + sink
        l_i = tl.zeros([BLOCK_M], tl.float32) + 1.0
    else:
        m_i = tl.zeros([BLOCK_M], tl.float32) + float("-inf")
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    lo, full_lo, full_hi, hi = load_ranges(ranges_ptr, pid_m, b, HAS_SEG)
    if RESUME:
        lse_prev = tl.load(prev_lse_ptr + (b * N + n) * T + offs_m, mask=offs_m < T,
                           other=float("-inf"))  # fmt: skip
        m_i = lse_prev * F.LSE_FACTOR  # m's units (`_fwd_step`)
        l_i = tl.where(lse_prev > float("-inf"), 1.0, 0.0)
        prev_base = prev_o_ptr + b64 * (T * N * H) + n * H
        acc = load_tile(prev_base, offs_m, offs_d, N * H, T, H, BLOCK_D, True).to(tl.float32)
    if WS:  # fully visible (full_lo = lo, full_hi = hi) or causal-only calls (see _select)
        k_desc = slab(k_base, S, H, kv_row, BLOCK_N, BLOCK_D)
        v_desc = slab(v_base, S, H, kv_row, BLOCK_N, BLOCK_D)
        acc, m_i, l_i = _fwd_ws_loop(
            acc, m_i, l_i, lo, hi, ctx, P, F, BLOCK_N, k_desc, v_desc, pid_m * BLOCK_M, INTERPRET
        )
    else:
        acc, m_i, l_i = _fwd_loop(
            acc, m_i, l_i, lo, full_lo, ctx, P, F, BLOCK_N, kv_row, True, INTERPRET
        )
        acc, m_i, l_i = _fwd_loop(
            acc, m_i, l_i, full_lo, full_hi, ctx, P, F, BLOCK_N, kv_row, False, INTERPRET
        )
        acc, m_i, l_i = _fwd_loop(
            acc, m_i, l_i, full_hi, hi, ctx, P, F, BLOCK_N, kv_row, True, INTERPRET
        )

    if WS:
        # Every row has mass here (all keys visible, or causal: key 0 at least). Outputs go
        # through TMA, which clips rows past T; the lse as a [BLOCK_M, 16] tile (broadcast)
        # into a [B·N·T, 16] buffer: per-row pointer stores from the two consumer warpgroups
        # came out wrong in Triton 3.6 (its row shift,
        # docs/performance-history.md#step-6-2026-11-23), and this store costs nothing.
        o_desc.store([pid_m * BLOCK_M, 0], (acc / l_i[:, None]).to(o_ptr.dtype.element_ty))
        lse = _natural_lse(m_i, l_i, F)
        lse_base = lse_ptr + pid_bn.to(tl.int64) * (T * 16)
        lse_desc = slab(lse_base, T, 16, 16, BLOCK_M, 16)
        lse_desc.store([pid_m * BLOCK_M, 0], lse[:, None] + tl.zeros([BLOCK_M, 16], tl.float32))
    else:
        # Rows with no mass (no visible key, no sink) output exactly 0 with lse = -inf.
        has_mass = l_i > 0.0
        l_safe = tl.where(has_mass, l_i, 1.0)
        if HAS_BIAS:
            # The row max (natural units) and log row sum apart, for the backward (see
            # `kernels.triton._common`); the caller's lse is their sum. No mass: (-inf, 0).
            rows = softmax_rows(lse_ptr, (b * N + n) * T, F) + offs_m
            tl.store(rows, m_i, mask=offs_m < T)
            tl.store(rows + T, tl.log(l_safe), mask=offs_m < T)
        else:
            if RESUME:  # a program that saw no key leaves the previous output: rows past T
                offs_m = tl.where(hi > lo, offs_m, T)  # are stored nowhere
            lse = tl.where(has_mass, _natural_lse(m_i, l_safe, F), float("-inf"))
            tl.store(lse_ptr + (b * N + n) * T + offs_m, lse, mask=offs_m < T)
        store_tile(o_base, offs_m, offs_d, acc / l_safe[:, None], N * H, T, H)
