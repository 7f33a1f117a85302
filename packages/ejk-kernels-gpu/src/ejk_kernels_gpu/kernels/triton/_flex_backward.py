"""The flex attention backward kernels (FlashAttention-2, Alg. 2, over block lists), Triton bodies only.

``flex_dq_kernel``: one program per (query block, batch, query head), visiting the key
blocks of its row of the block tables (as the forward). ``flex_dkdv_kernel``: one program
per (key block, batch, kv head), visiting, for each query head of its GQA group, the
query blocks of its column: the transposed tables (`BlockMask.q_blocks`), so k/v
gradients are summed over the group in registers. Both rebuild P from the forward's lse
and take the score_mod's derivative from ``DSCORE_FN`` (see `_flex_ops.flex_dscores`).
"""

import triton
import triton.language as tl

from ._common import load_rows, load_tile, store_tile
from ._flex_ops import (
    FlexOptions,
    flex_dscores,
    flex_probs,
    head_slab,
    kv_tiles,
    listed_tile,
    query_program,
    table_row,
)


@triton.jit
def _dq_tile(dq, start_n, q, do, lse, delta, k_base, v_base, b, n, offs_m, ints, floats,
             F: tl.constexpr, SCORE_FN: tl.constexpr, DSCORE_FN: tl.constexpr,
             MASK_FN: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """dq += dS·K for the key tile at ``start_n``."""
    offs_n, k, v = kv_tiles(k_base, v_base, start_n, F, BLOCK_N)
    raw, p = flex_probs(q, k, lse, b, n, offs_m, offs_n, ints, floats, F, SCORE_FN, MASK_FN,
                        PARTIAL, False)  # fmt: skip
    dp = tl.dot(do, tl.trans(v))
    ds = flex_dscores(raw, p, dp, delta, b, n, offs_m, offs_n, ints, floats, F, DSCORE_FN, False)
    return tl.dot(ds.to(k.dtype), k, dq)


@triton.jit
def _dq_list(dq, num_ptr, idx_ptr, row, q, do, lse, delta, k_base, v_base, b, n, offs_m, ints,
             floats, F: tl.constexpr, SCORE_FN: tl.constexpr, DSCORE_FN: tl.constexpr,
             MASK_FN: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_N: tl.constexpr,
             INTERPRET: tl.constexpr):  # fmt: skip
    """Every key tile of the blocks of one list of table row ``row`` (see `listed_tile`)."""
    tiles = tl.load(num_ptr + row) * (F.MASK_N // BLOCK_N)
    base = idx_ptr + row * F.SB
    if INTERPRET:  # see _flex_forward._fwd_list
        it = 0
        while it < tiles:
            dq = _dq_tile(dq, listed_tile(base, it, F.MASK_N, BLOCK_N), q, do, lse, delta, k_base,
                          v_base, b, n, offs_m, ints, floats, F, SCORE_FN, DSCORE_FN, MASK_FN,
                          PARTIAL, BLOCK_N)  # fmt: skip
            it += 1
    else:
        for it in range(0, tiles):
            dq = _dq_tile(dq, listed_tile(base, it, F.MASK_N, BLOCK_N), q, do, lse, delta, k_base,
                          v_base, b, n, offs_m, ints, floats, F, SCORE_FN, DSCORE_FN, MASK_FN,
                          PARTIAL, BLOCK_N)  # fmt: skip
    return dq


@triton.jit
def flex_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, ints_ptr, floats_ptr,
    pnum_ptr, pidx_ptr, fnum_ptr, fidx_ptr, dq_ptr,
    T: tl.constexpr, S: tl.constexpr, N: tl.constexpr, G: tl.constexpr, H: tl.constexpr,
    HV: tl.constexpr, SCALE: tl.constexpr, MB: tl.constexpr, MN: tl.constexpr, TB: tl.constexpr,
    SB: tl.constexpr, HAS_SCORE: tl.constexpr, SCORE_FN: tl.constexpr, DSCORE_FN: tl.constexpr,
    MASK_FN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, MASK_M: tl.constexpr, MASK_N: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """dq ``[B, T, N, H]`` of one query block. Grid: (query blocks, B·N)."""
    F: tl.constexpr = FlexOptions(
        T=T, S=S, N=N, G=G, H=H, HV=HV, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, SCALE=SCALE, MB=MB,
        MN=MN, TB=TB, SB=SB, HAS_SCORE=HAS_SCORE, MASK_M=MASK_M, MASK_N=MASK_N,
    )  # fmt: skip
    b, n, offs_m, q, k_base, v_base, row = query_program(q_ptr, k_ptr, v_ptr, F, BLOCK_M)
    do = load_tile(head_slab(do_ptr, b, n, T, N, HV), offs_m, tl.arange(0, BLOCK_DV), N * HV, T,
                   HV, BLOCK_DV, True)  # fmt: skip
    lse = load_rows(lse_ptr + (b * N + n) * T, offs_m, T, True, 1.0)
    delta = load_rows(delta_ptr + (b * N + n) * T, offs_m, T, True, 1.0)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq = _dq_list(dq, pnum_ptr, pidx_ptr, row, q, do, lse, delta, k_base, v_base, b, n, offs_m,
                  ints_ptr, floats_ptr, F, SCORE_FN, DSCORE_FN, MASK_FN, True, BLOCK_N,
                  INTERPRET)  # fmt: skip
    dq = _dq_list(dq, fnum_ptr, fidx_ptr, row, q, do, lse, delta, k_base, v_base, b, n, offs_m,
                  ints_ptr, floats_ptr, F, SCORE_FN, DSCORE_FN, MASK_FN, False, BLOCK_N,
                  INTERPRET)  # fmt: skip
    dq_base = head_slab(dq_ptr, b, n, T, N, H)
    store_tile(dq_base, offs_m, tl.arange(0, BLOCK_D), dq * SCALE, N * H, T, H)


@triton.jit
def _dkdv_tile(dk, dv, start_m, k, v, q_base, do_base, lse_base, delta_base, b, n, offs_n, ints,
               floats, F: tl.constexpr, SCORE_FN: tl.constexpr, DSCORE_FN: tl.constexpr,
               MASK_FN: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """dk += dSᵀ·q and dv += Pᵀ·dO for the query tile at ``start_m`` of head ``n``
    (transposed ``[BLOCK_N, BLOCK_M]`` tiles: no register transposes)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = load_tile(q_base, offs_m, tl.arange(0, F.BLOCK_D), F.N * F.H, F.T, F.H, F.BLOCK_D, True)
    do = load_tile(do_base, offs_m, tl.arange(0, F.BLOCK_DV), F.N * F.HV, F.T, F.HV, F.BLOCK_DV,
                   True)  # fmt: skip
    lse = load_rows(lse_base, offs_m, F.T, True, 1.0)
    delta = load_rows(delta_base, offs_m, F.T, True, 1.0)
    raw, pt = flex_probs(k, q, lse, b, n, offs_m, offs_n, ints, floats, F, SCORE_FN, MASK_FN,
                         PARTIAL, True)  # fmt: skip
    dpt = tl.dot(v, tl.trans(do))
    dst = flex_dscores(raw, pt, dpt, delta, b, n, offs_m, offs_n, ints, floats, F, DSCORE_FN,
                       True)  # fmt: skip
    dv = tl.dot(pt.to(do.dtype), do, dv)
    dk = tl.dot(dst.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _dkdv_list(dk, dv, num_ptr, idx_ptr, row, k, v, q_base, do_base, lse_base, delta_base, b, n,
               offs_n, ints, floats, F: tl.constexpr, SCORE_FN: tl.constexpr,
               DSCORE_FN: tl.constexpr, MASK_FN: tl.constexpr, PARTIAL: tl.constexpr,
               BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """Every query tile of the blocks of one list of column ``row`` (see `listed_tile`)."""
    tiles = tl.load(num_ptr + row) * (F.MASK_M // BLOCK_M)
    base = idx_ptr + row * F.TB
    if INTERPRET:  # see _flex_forward._fwd_list
        it = 0
        while it < tiles:
            dk, dv = _dkdv_tile(dk, dv, listed_tile(base, it, F.MASK_M, BLOCK_M), k, v, q_base,
                                do_base, lse_base, delta_base, b, n, offs_n, ints, floats, F,
                                SCORE_FN, DSCORE_FN, MASK_FN, PARTIAL, BLOCK_M)  # fmt: skip
            it += 1
    else:
        for it in range(0, tiles):
            dk, dv = _dkdv_tile(dk, dv, listed_tile(base, it, F.MASK_M, BLOCK_M), k, v, q_base,
                                do_base, lse_base, delta_base, b, n, offs_n, ints, floats, F,
                                SCORE_FN, DSCORE_FN, MASK_FN, PARTIAL, BLOCK_M)  # fmt: skip
    return dk, dv


@triton.jit
def flex_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, ints_ptr, floats_ptr,
    pnum_ptr, pidx_ptr, fnum_ptr, fidx_ptr, dk_ptr, dv_ptr,
    T: tl.constexpr, S: tl.constexpr, N: tl.constexpr, G: tl.constexpr, H: tl.constexpr,
    HV: tl.constexpr, SCALE: tl.constexpr, MB: tl.constexpr, MN: tl.constexpr, TB: tl.constexpr,
    SB: tl.constexpr, HAS_SCORE: tl.constexpr, SCORE_FN: tl.constexpr, DSCORE_FN: tl.constexpr,
    MASK_FN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, MASK_M: tl.constexpr, MASK_N: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """dk ``[B, S, K, H]`` and dv ``[B, S, K, HV]`` of one key block, summed over the GQA
    group. The tables are the transposed ones (rows of ``[MB, MN, SB]``, ``TB`` query block
    indices each). Grid: (key blocks, B·K)."""
    F: tl.constexpr = FlexOptions(
        T=T, S=S, N=N, G=G, H=H, HV=HV, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, SCALE=SCALE, MB=MB,
        MN=MN, TB=TB, SB=SB, HAS_SCORE=HAS_SCORE, MASK_M=MASK_M, MASK_N=MASK_N,
    )  # fmt: skip
    K: tl.constexpr = N // G
    pid_n = tl.program_id(0)
    b = tl.program_id(1) // K
    kh = tl.program_id(1) % K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = load_tile(head_slab(k_ptr, b, kh, S, K, H), offs_n, offs_d, K * H, S, H, BLOCK_D, True)
    v = load_tile(head_slab(v_ptr, b, kh, S, K, HV), offs_n, offs_dv, K * HV, S, HV, BLOCK_DV,
                  True)  # fmt: skip

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(0, G):
        n = kh * G + g
        q_base = head_slab(q_ptr, b, n, T, N, H)
        do_base = head_slab(do_ptr, b, n, T, N, HV)
        lse_base = lse_ptr + (b * N + n) * T
        delta_base = delta_ptr + (b * N + n) * T
        row = table_row(b, n, (pid_n * BLOCK_N) // F.MASK_N, F, SB)
        dk, dv = _dkdv_list(dk, dv, pnum_ptr, pidx_ptr, row, k, v, q_base, do_base, lse_base,
                            delta_base, b, n, offs_n, ints_ptr, floats_ptr, F, SCORE_FN,
                            DSCORE_FN, MASK_FN, True, BLOCK_M, INTERPRET)  # fmt: skip
        dk, dv = _dkdv_list(dk, dv, fnum_ptr, fidx_ptr, row, k, v, q_base, do_base, lse_base,
                            delta_base, b, n, offs_n, ints_ptr, floats_ptr, F, SCORE_FN,
                            DSCORE_FN, MASK_FN, False, BLOCK_M, INTERPRET)  # fmt: skip
    store_tile(head_slab(dk_ptr, b, kh, S, K, H), offs_n, offs_d, dk * SCALE, K * H, S, H)
    store_tile(head_slab(dv_ptr, b, kh, S, K, HV), offs_n, offs_dv, dv, K * HV, S, HV)
