"""The backward flash-attention kernels (FlashAttention-2, Alg. 2), Triton bodies only.

``dq_kernel``: one program per (query block, batch, query head), looping over key
blocks. ``dkdv_kernel``: one program per (key block, batch, kv head), looping over
the query heads of its GQA group and their query blocks, so k/v gradients are
summed over the group in registers; it also writes the logits gradient for
``dbias`` when there is a bias. With ``DQ_ATOMIC`` it computes dq as well, adding
each tile's ``dS·K`` into a float32 buffer (FlashAttention-2's single backward
loop), and the dq kernel is not launched. Both skip blocks through the same range
tables as the forward (rows for dq, columns for dk/dv).

The loops carry the call's `Options` ``F`` and masking tables ``P`` (see `kernels.triton._common`)
and the program's context (`_DqContext`, `_DkDvContext`).
"""

from typing import NamedTuple

import triton
import triton.language as tl

from ._common import (
    LOG2E,
    MaskTables,
    Options,
    grad_logits,
    grid_order,
    kv_bases,
    line,
    load_ranges,
    load_rows,
    load_softmax_rows,
    load_tile,
    row_stats,
    slab,
    softmax_rows,
    store_tile,
)


class _DqContext(NamedTuple):
    """What every key block of one dq program reads besides its k and v tiles."""

    q: object  # the resident query and output-gradient tiles, their lse (`load_softmax_rows`)
    # and delta rows
    do: object
    lse: object
    delta: object
    k_base: object  # this (batch, kv head)'s k and v slabs
    v_base: object
    bias_base: object
    dropout_key: object  # uint32 [5] (`dropout_keep`)
    b: object
    n: object
    offs_m: object
    offs_d: object


class _DkDvContext(NamedTuple):
    """What every query block of one dk/dv program reads besides its q, dO, lse, delta."""

    k: object  # the resident key and value tiles
    v: object
    q_base: object  # the GQA group's first query head: q, dO slabs, lse (`softmax_rows`) and
    # delta rows
    do_base: object
    lse_base: object
    delta_base: object
    bias_base: object
    dbias_base: object
    dq_acc: object  # float32 dq buffer (pointer) or its TMA descriptor (DQ_TMA)
    dropout_key: object  # uint32 [5] (`dropout_keep`)
    b: object
    n0: object  # the group's first query head
    offs_n: object
    offs_d: object


@triton.jit
def _dq_step(dq, k, v, start_n, ctx, P, F: tl.constexpr, BLOCK_N: tl.constexpr,
             MASKED: tl.constexpr, diag, BLOCK_CAUSAL: tl.constexpr):  # fmt: skip
    """dq += dS·K for one key block, given its k and v tiles (BLOCK_CAUSAL: `block_causal`)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    _, ds = grad_logits(
        ctx.q, k, v, ctx.do, ctx.lse, ctx.delta, ctx.bias_base, ctx.dropout_key, ctx.b, ctx.n,
        ctx.offs_m, offs_n, P, F, MASKED, False, diag, BLOCK_CAUSAL,
    )  # fmt: skip
    return tl.dot(ds.to(k.dtype), k, dq)


@triton.jit
def _dq_block(dq, start_n, ctx, P, F: tl.constexpr, BLOCK_N: tl.constexpr,
              KV_STRIDE: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_tile(ctx.k_base, offs_n, ctx.offs_d, KV_STRIDE, F.S, F.H, F.BLOCK_D, MASKED)
    v = load_tile(ctx.v_base, offs_n, ctx.offs_d, KV_STRIDE, F.S, F.H, F.BLOCK_D, MASKED)
    return _dq_step(dq, k, v, start_n, ctx, P, F, BLOCK_N, MASKED, 0, False)


@triton.jit
def _dq_ws_block(dq, start_n, ctx, P, F: tl.constexpr, BLOCK_N: tl.constexpr, K_DESC, V_DESC,
                 row0):  # fmt: skip
    """One step of `_dq_ws_loop`: the key block at ``start_n`` through TMA, as the forward's
    `_fwd_ws_block`."""
    k = K_DESC.load([start_n, 0])
    v = V_DESC.load([start_n, 0])
    return _dq_step(dq, k, v, start_n, ctx, P, F, BLOCK_N, False, start_n - row0, F.CAUSAL)


@triton.jit
def _dq_ws_loop(dq, start, end, ctx, P, F: tl.constexpr, BLOCK_N: tl.constexpr, K_DESC, V_DESC,
                row0, INTERPRET: tl.constexpr):  # fmt: skip
    """Key blocks through TMA, warp-specialised, as the forward's `_fwd_ws_loop`."""
    if INTERPRET:
        start_n = start
        while start_n < end:
            dq = _dq_ws_block(dq, start_n, ctx, P, F, BLOCK_N, K_DESC, V_DESC, row0)
            start_n += BLOCK_N
    else:
        for start_n in tl.range(start, end, BLOCK_N, warp_specialize=True):
            dq = _dq_ws_block(dq, start_n, ctx, P, F, BLOCK_N, K_DESC, V_DESC, row0)
    return dq


@triton.jit
def _dq_loop(dq, start, end, ctx, P, F: tl.constexpr, BLOCK_N: tl.constexpr,
             KV_STRIDE: tl.constexpr, MASKED: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    if INTERPRET:  # see _forward_kernel._fwd_loop
        start_n = start
        while start_n < end:
            dq = _dq_block(dq, start_n, ctx, P, F, BLOCK_N, KV_STRIDE, MASKED)
            start_n += BLOCK_N
    else:
        for start_n in range(start, end, BLOCK_N):
            dq = _dq_block(dq, start_n, ctx, P, F, BLOCK_N, KV_STRIDE, MASKED)
    return dq


@triton.jit
def dq_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, do_ptr, lse_ptr, delta_ptr,
    qsid_ptr, ksid_ptr, qpos_ptr, kpos_ptr, qseg_ptr, kseg_ptr, ranges_ptr, seed_ptr,
    dq_ptr, scratch_ptr,
    T: tl.constexpr, S: tl.constexpr, N: tl.constexpr, G: tl.constexpr, H: tl.constexpr,
    BIAS_SB: tl.constexpr, BIAS_SN: tl.constexpr, SCALE: tl.constexpr, SOFT_CAP: tl.constexpr,
    HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr, HAS_SEG: tl.constexpr, SEQ_IDS: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    DROPOUT_THRESHOLD: tl.constexpr, DROPOUT_SCALE: tl.constexpr, LOG2_FACTOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
    WS: tl.constexpr, LSE_T: tl.constexpr, KV_PAIR: tl.constexpr,
):  # fmt: skip
    """dq of one query block. With ``WS`` (Hopper; fully visible or causal-only calls, see
    `FlashConfig.warp_specialize`) every tile moves through TMA in one warp-specialised
    loop; lse and delta then come as ``[B, N, LSE_T]`` rows padded with zeros, and
    `scratch_ptr` stands for the descriptors' global scratch (see _jax_triton_fix). With a
    bias ``lse_ptr`` holds the rows (max, log sum) instead (`softmax_rows`)."""
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

    q_off = b64 * (T * N * H) + n * H
    row0 = pid_m * BLOCK_M
    if WS:
        q = slab(q_ptr + q_off, T, H, N * H, BLOCK_M, H).load([row0, 0])
        do = slab(do_ptr + q_off, T, H, N * H, BLOCK_M, H).load([row0, 0])
        rows = pid_bn.to(tl.int64) * LSE_T
        lse = row_stats(line(lse_ptr + rows, LSE_T, BLOCK_M).load([row0]), F.LSE_FACTOR)
        delta = row_stats(line(delta_ptr + rows, LSE_T, BLOCK_M).load([row0]), 1.0)
    else:
        q = load_tile(q_ptr + q_off, offs_m, offs_d, N * H, T, H, BLOCK_D, True)
        do = load_tile(do_ptr + q_off, offs_m, offs_d, N * H, T, H, BLOCK_D, True)
        lse = load_softmax_rows(softmax_rows(lse_ptr, (b * N + n) * T, F), offs_m, True, F)
        delta = load_rows(delta_ptr + (b * N + n) * T, offs_m, T, True, 1.0)
    k_base, v_base = kv_bases(k_ptr, v_ptr, b64, kh, S, K, H, KV_PAIR)
    kv_row: tl.constexpr = 2 * K * H if KV_PAIR else K * H  # k's and v's row stride
    bias_base = bias_ptr + b64 * BIAS_SB + n * BIAS_SN
    ctx = _DqContext(q, do, lse, delta, k_base, v_base, bias_base, seed_ptr, b, n, offs_m, offs_d)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, full_lo, full_hi, hi = load_ranges(ranges_ptr, pid_m, b, HAS_SEG)
    if WS:
        kd = slab(k_base, S, H, kv_row, BLOCK_N, H)
        vd = slab(v_base, S, H, kv_row, BLOCK_N, H)
        dq = _dq_ws_loop(dq, lo, hi, ctx, P, F, BLOCK_N, kd, vd, row0, INTERPRET)
        # Through TMA (clipped past T): per-row stores from the consumer warpgroups would
        # meet Triton 3.6's row shift (see `block_causal`).
        out = (dq * SCALE).to(dq_ptr.dtype.element_ty)
        slab(dq_ptr + q_off, T, H, N * H, BLOCK_M, H).store([row0, 0], out)
    else:
        dq = _dq_loop(dq, lo, full_lo, ctx, P, F, BLOCK_N, kv_row, True, INTERPRET)
        dq = _dq_loop(dq, full_lo, full_hi, ctx, P, F, BLOCK_N, kv_row, False, INTERPRET)
        dq = _dq_loop(dq, full_hi, hi, ctx, P, F, BLOCK_N, kv_row, True, INTERPRET)
        store_tile(dq_ptr + q_off, offs_m, offs_d, dq * SCALE, N * H, T, H)


@triton.jit
def _dkdv_block(dk, dv, it, start, n_blocks, ctx, P, F: tl.constexpr, BLOCK_M: tl.constexpr,
                Q_STRIDE: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Step ``it`` of a range: query head ``it // n_blocks`` of the group, its query block ``it % n_blocks``."""
    g = it // n_blocks
    row0 = start + (it - g * n_blocks) * BLOCK_M
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_d = ctx.offs_d
    q = load_tile(ctx.q_base + g * F.H, offs_m, offs_d, Q_STRIDE, F.T, F.H, F.BLOCK_D, MASKED)
    do = load_tile(ctx.do_base + g * F.H, offs_m, offs_d, Q_STRIDE, F.T, F.H, F.BLOCK_D, MASKED)
    lse = load_softmax_rows(softmax_rows(ctx.lse_base, g * F.T, F), offs_m, MASKED, F)
    delta = load_rows(ctx.delta_base + g * F.T, offs_m, F.T, MASKED, 1.0)
    return _dkdv_step(dk, dv, q, do, lse, delta, g, row0, ctx, P, F, BLOCK_M, Q_STRIDE, MASKED,
                      0, False)  # fmt: skip


@triton.jit
def _dkdv_ws_block(dk, dv, it, start, n_blocks, ctx, P, F: tl.constexpr, BLOCK_M: tl.constexpr,
                   Q_DESC, DO_DESC, LSE_DESC, DELTA_DESC, key0, LSE_T: tl.constexpr):  # fmt: skip
    """`_dkdv_block` through TMA: q and dO tiles of the group's ``[T, G·H]`` slabs, lse and
    delta of its ``G`` padded rows of ``LSE_T``; causal calls masked by `block_causal`."""
    g = it // n_blocks
    row0 = start + (it - g * n_blocks) * BLOCK_M
    q = Q_DESC.load([row0, g * F.H])
    do = DO_DESC.load([row0, g * F.H])
    lse = row_stats(LSE_DESC.load([g * LSE_T + row0]), F.LSE_FACTOR)
    delta = row_stats(DELTA_DESC.load([g * LSE_T + row0]), 1.0)
    return _dkdv_step(dk, dv, q, do, lse, delta, g, row0, ctx, P, F, BLOCK_M, 0, False,
                      row0 - key0, F.CAUSAL)  # fmt: skip


@triton.jit
def _dkdv_step(dk, dv, q, do, lse, delta, g, row0, ctx, P, F: tl.constexpr, BLOCK_M: tl.constexpr,
               Q_STRIDE: tl.constexpr, MASKED: tl.constexpr, diag,
               BLOCK_CAUSAL: tl.constexpr):  # fmt: skip
    """dk, dv (and dq, the logits gradient) updates of query head ``g`` of the group, rows
    from ``row0``, given their tiles."""
    k = ctx.k
    offs_n = ctx.offs_n
    n = ctx.n0 + g
    offs_m = row0 + tl.arange(0, BLOCK_M)
    # Transposed tiles [BLOCK_N, BLOCK_M]: dV += Pᵀ·dO and dK += dSᵀ·q need no register transpose.
    pt, dst = grad_logits(
        q, k, ctx.v, do, lse, delta, ctx.bias_base + g * F.BIAS_SN, ctx.dropout_key, ctx.b, n, offs_m,
        offs_n, P, F, MASKED, True, diag, BLOCK_CAUSAL,
    )  # fmt: skip
    if F.HAS_BIAS:
        # The bias gradient is the logits gradient; every (row, column) is visited once.
        off = g * (F.T * F.S) + offs_m[None, :] * F.S + offs_n[:, None]
        ok = (offs_m[None, :] < F.T) & (offs_n[:, None] < F.S)
        tl.store(ctx.dbias_base + off, dst, mask=ok)
    dv = tl.dot(pt.to(do.dtype), do, dv)
    ds = dst.to(q.dtype)
    dk = tl.dot(ds, q, dk)
    if F.DQ_ATOMIC:
        # dQ_i += dS_ij·K_j (FlashAttention-2, Alg. 2, line 21); other key blocks add theirs.
        dq = tl.dot(tl.trans(ds), k)
        if F.DQ_TMA:
            # One asynchronous bulk reduce of the tile (rows past T are clipped), as
            # FlashAttention-3 accumulates dQ; `dq_acc` is the batch's [T, N·H] descriptor.
            ctx.dq_acc.atomic_add([row0, n * F.H], dq)
        else:
            offs_d = ctx.offs_d
            ptrs = ctx.dq_acc + g * F.H + offs_m[:, None] * Q_STRIDE + offs_d[None, :]
            if MASKED or F.BLOCK_D != F.H:
                ok = (offs_m[:, None] < F.T) & (offs_d[None, :] < F.H)
                tl.atomic_add(ptrs, dq, mask=ok, sem="relaxed")
            else:
                tl.atomic_add(ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_loop(dk, dv, start, end, ctx, P, F: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr,
               Q_STRIDE: tl.constexpr, MASKED: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """Query blocks ``start, start + BLOCK_M, ...`` below ``end`` of every query head of the group.

    One flat loop over (head, block) pairs, so a GQA group streams through a single
    software pipeline instead of G loops that each fill and drain their own.
    """
    n_blocks = (end - start + BLOCK_M - 1) // BLOCK_M
    if INTERPRET:  # see _forward_kernel._fwd_loop
        it = 0
        while it < G * n_blocks:
            dk, dv = _dkdv_block(dk, dv, it, start, n_blocks, ctx, P, F, BLOCK_M, Q_STRIDE, MASKED)
            it += 1
    else:
        for it in range(0, G * n_blocks):
            dk, dv = _dkdv_block(dk, dv, it, start, n_blocks, ctx, P, F, BLOCK_M, Q_STRIDE, MASKED)
    return dk, dv


@triton.jit
def _dkdv_ws_loop(dk, dv, start, end, ctx, P, F: tl.constexpr, G: tl.constexpr,
                  BLOCK_M: tl.constexpr, descs, key0, LSE_T: tl.constexpr,
                  INTERPRET: tl.constexpr):  # fmt: skip
    """`_dkdv_loop` through TMA, warp-specialised (see `dkdv_kernel`)."""
    n_blocks = (end - start + BLOCK_M - 1) // BLOCK_M
    qd, dod, ld, dd = descs
    if INTERPRET:
        it = 0
        while it < G * n_blocks:
            dk, dv = _dkdv_ws_block(dk, dv, it, start, n_blocks, ctx, P, F, BLOCK_M, qd, dod, ld,
                                    dd, key0, LSE_T)  # fmt: skip
            it += 1
    else:
        for it in tl.range(0, G * n_blocks, warp_specialize=True):
            dk, dv = _dkdv_ws_block(dk, dv, it, start, n_blocks, ctx, P, F, BLOCK_M, qd, dod, ld,
                                    dd, key0, LSE_T)  # fmt: skip
    return dk, dv


@triton.jit
def dkdv_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, do_ptr, lse_ptr, delta_ptr,
    qsid_ptr, ksid_ptr, qpos_ptr, kpos_ptr, qseg_ptr, kseg_ptr, ranges_ptr, seed_ptr,
    dk_ptr, dv_ptr, dbias_ptr, dq_acc_ptr, scratch_ptr,
    T: tl.constexpr, S: tl.constexpr, N: tl.constexpr, G: tl.constexpr, H: tl.constexpr,
    BIAS_SB: tl.constexpr, BIAS_SN: tl.constexpr, SCALE: tl.constexpr, SOFT_CAP: tl.constexpr,
    HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr, HAS_SEG: tl.constexpr, SEQ_IDS: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    DROPOUT_THRESHOLD: tl.constexpr, DROPOUT_SCALE: tl.constexpr, LOG2_FACTOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
    DQ_ATOMIC: tl.constexpr, DQ_TMA: tl.constexpr, WS: tl.constexpr, LSE_T: tl.constexpr,
    KV_PAIR: tl.constexpr,
):  # fmt: skip
    """dk, dv (and the logits gradient with a bias); with ``DQ_ATOMIC`` also the unscaled
    dq, added into ``dq_acc_ptr`` (float32 ``[B, T, N, H]``, zeroed by the caller), by
    TMA reduces with ``DQ_TMA`` (Hopper, ``BLOCK_D == H``; the descriptor lives in the
    global scratch that `scratch_ptr` stands for, see _jax_triton_fix) or else by atomic adds.
    With ``WS`` (no dq here) every tile moves through TMA in one warp-specialised loop, as
    in `dq_kernel`: lse and delta as ``[B, N, LSE_T]`` rows padded with zeros. With a bias
    ``lse_ptr`` holds the rows (max, log sum) instead (`softmax_rows`)."""
    F: tl.constexpr = Options(
        T=T, S=S, H=H, BLOCK_D=BLOCK_D, SCALE=SCALE, SOFT_CAP=SOFT_CAP, HAS_BIAS=HAS_BIAS,
        VARLEN=VARLEN, SEQ_IDS=SEQ_IDS, HAS_SEG=HAS_SEG, CAUSAL=CAUSAL, WINDOW_LEFT=WINDOW_LEFT,
        WINDOW_RIGHT=WINDOW_RIGHT, DROPOUT_THRESHOLD=DROPOUT_THRESHOLD,
        DROPOUT_SCALE=DROPOUT_SCALE, LOG2_FACTOR=LOG2_FACTOR, BIAS_SN=BIAS_SN, DQ_ATOMIC=DQ_ATOMIC,
        DQ_TMA=DQ_TMA, LSE_FACTOR=1.0 if LOG2_FACTOR == LOG2E else LOG2E,
    )  # fmt: skip
    P = MaskTables(qsid_ptr, ksid_ptr, qpos_ptr, kpos_ptr, qseg_ptr, kseg_ptr)
    K: tl.constexpr = N // G
    # Heaviest key blocks first (causal: the first ones).
    pid_n, pid_bk = grid_order(False)
    b = pid_bk // K
    kh = pid_bk % K
    b64 = b.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    kv_off = b64 * (S * K * H) + kh * H  # of dk and dv
    k_base, v_base = kv_bases(k_ptr, v_ptr, b64, kh, S, K, H, KV_PAIR)
    kv_row: tl.constexpr = 2 * K * H if KV_PAIR else K * H  # k's and v's row stride
    key0 = pid_n * BLOCK_N
    if WS:
        k = slab(k_base, S, H, kv_row, BLOCK_N, H).load([key0, 0])
        v = slab(v_base, S, H, kv_row, BLOCK_N, H).load([key0, 0])
    else:
        k = load_tile(k_base, offs_n, offs_d, kv_row, S, H, BLOCK_D, True)
        v = load_tile(v_base, offs_n, offs_d, kv_row, S, H, BLOCK_D, True)
    lo, full_lo, full_hi, hi = load_ranges(ranges_ptr, pid_n, b, HAS_SEG)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    n0 = kh * G  # the group's first query head; _dkdv_block offsets to the others
    q_off = b64 * (T * N * H) + n0 * H
    row_off = (b * N + n0) * T
    if DQ_TMA:
        dq_acc = slab(dq_acc_ptr + b64 * (T * N * H), T, N * H, N * H, BLOCK_M, BLOCK_D)
    else:
        dq_acc = dq_acc_ptr + q_off
    ctx = _DkDvContext(
        k, v, q_ptr + q_off, do_ptr + q_off, softmax_rows(lse_ptr, row_off, F), delta_ptr + row_off,
        bias_ptr + b64 * BIAS_SB + n0 * BIAS_SN, dbias_ptr + (b64 * N + n0) * (T * S),
        dq_acc, seed_ptr, b, n0, offs_n, offs_d,
    )  # fmt: skip
    if WS:
        rows = (b64 * N + n0) * LSE_T
        descs = (
            slab(q_ptr + q_off, T, G * H, N * H, BLOCK_M, H),
            slab(do_ptr + q_off, T, G * H, N * H, BLOCK_M, H),
            line(lse_ptr + rows, G * LSE_T, BLOCK_M),
            line(delta_ptr + rows, G * LSE_T, BLOCK_M),
        )
        dk, dv = _dkdv_ws_loop(dk, dv, lo, hi, ctx, P, F, G, BLOCK_M, descs, key0, LSE_T, INTERPRET)
        # Through TMA (clipped past S), as dq_kernel's store.
        slab(dk_ptr + kv_off, S, H, K * H, BLOCK_N, H).store(
            [key0, 0], (dk * SCALE).to(dk_ptr.dtype.element_ty)
        )
        slab(dv_ptr + kv_off, S, H, K * H, BLOCK_N, H).store(
            [key0, 0], dv.to(dv_ptr.dtype.element_ty)
        )
    else:
        dk, dv = _dkdv_loop(dk, dv, lo, full_lo, ctx, P, F, G, BLOCK_M, N * H, True, INTERPRET)
        dk, dv = _dkdv_loop(
            dk, dv, full_lo, full_hi, ctx, P, F, G, BLOCK_M, N * H, False, INTERPRET
        )
        dk, dv = _dkdv_loop(dk, dv, full_hi, hi, ctx, P, F, G, BLOCK_M, N * H, True, INTERPRET)
        store_tile(dk_ptr + kv_off, offs_n, offs_d, dk * SCALE, K * H, S, H)
        store_tile(dv_ptr + kv_off, offs_n, offs_d, dv, K * H, S, H)
