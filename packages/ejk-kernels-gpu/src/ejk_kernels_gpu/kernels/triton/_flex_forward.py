"""The flex attention forward kernel (FlashAttention-2, Alg. 1, over a block list), Triton bodies only.

One program computes ``BLOCK_M`` query rows of one (batch, query head) with an online
softmax in float32. It visits the key blocks its row of the block tables lists: first
the partial ones (the mask_mod applied per element), then the full ones (no mask_mod);
empty blocks are never loaded. The tables are FlexAttention's layout (`BlockIndices`):
per ``[MB, MN, TB]`` row a count and ``SB`` ascending block indices. The score_mod runs
on every visited element (see `_flex_ops.flex_scores`).
"""

import triton
import triton.language as tl

from ._common import lse_from_log2, store_tile
from ._flex_ops import FlexOptions, flex_scores, head_slab, kv_tiles, listed_tile, query_program


@triton.jit
def _fwd_tile(acc, m_i, l_i, start_n, q, k_base, v_base, b, n, offs_m, ints, floats,
              F: tl.constexpr, SCORE_FN: tl.constexpr, MASK_FN: tl.constexpr,
              PARTIAL: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The online-softmax update of (acc, m, l) by the key tile at ``start_n``; scores and m
    in log2 units (one multiply-add and an ``exp2`` an element)."""
    offs_n, k, v = kv_tiles(k_base, v_base, start_n, F, BLOCK_N)
    _, s = flex_scores(q, k, b, n, offs_m, offs_n, ints, floats, F, SCORE_FN, MASK_FN, PARTIAL,
                       False, True)  # fmt: skip
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead, so that
    # exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _fwd_list(acc, m_i, l_i, num_ptr, idx_ptr, row, q, k_base, v_base, b, n, offs_m, ints,
              floats, F: tl.constexpr, SCORE_FN: tl.constexpr, MASK_FN: tl.constexpr,
              PARTIAL: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """Every key tile of the blocks of one list (partial or full) of table row ``row``."""
    tiles = tl.load(num_ptr + row) * (F.MASK_N // BLOCK_N)
    base = idx_ptr + row * F.SB
    if INTERPRET:  # the interpreter takes no loaded range() bound (see _forward._fwd_loop)
        it = 0
        while it < tiles:
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, listed_tile(base, it, F.MASK_N, BLOCK_N), q,
                                      k_base, v_base, b, n, offs_m, ints, floats, F, SCORE_FN,
                                      MASK_FN, PARTIAL, BLOCK_N)  # fmt: skip
            it += 1
    else:
        for it in range(0, tiles):
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, listed_tile(base, it, F.MASK_N, BLOCK_N), q,
                                      k_base, v_base, b, n, offs_m, ints, floats, F, SCORE_FN,
                                      MASK_FN, PARTIAL, BLOCK_N)  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def flex_fwd_kernel(
    q_ptr, k_ptr, v_ptr, ints_ptr, floats_ptr, pnum_ptr, pidx_ptr, fnum_ptr, fidx_ptr,
    o_ptr, lse_ptr,
    T: tl.constexpr, S: tl.constexpr, N: tl.constexpr, G: tl.constexpr, H: tl.constexpr,
    HV: tl.constexpr, SCALE: tl.constexpr, MB: tl.constexpr, MN: tl.constexpr, TB: tl.constexpr,
    SB: tl.constexpr, HAS_SCORE: tl.constexpr, SCORE_FN: tl.constexpr, MASK_FN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK_M: tl.constexpr, MASK_N: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """out ``[B, T, N, HV]`` and the lse ``[B, N, T]`` (natural units; -inf and a zero output
    on a row with no visible key). Grid: (query blocks, B·N)."""
    F: tl.constexpr = FlexOptions(
        T=T, S=S, N=N, G=G, H=H, HV=HV, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, SCALE=SCALE, MB=MB,
        MN=MN, TB=TB, SB=SB, HAS_SCORE=HAS_SCORE, MASK_M=MASK_M, MASK_N=MASK_N,
    )  # fmt: skip
    b, n, offs_m, q, k_base, v_base, row = query_program(q_ptr, k_ptr, v_ptr, F, BLOCK_M)
    m_i = tl.zeros([BLOCK_M], tl.float32) + float("-inf")
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc, m_i, l_i = _fwd_list(acc, m_i, l_i, pnum_ptr, pidx_ptr, row, q, k_base, v_base, b, n,
                              offs_m, ints_ptr, floats_ptr, F, SCORE_FN, MASK_FN, True, BLOCK_N,
                              INTERPRET)  # fmt: skip
    acc, m_i, l_i = _fwd_list(acc, m_i, l_i, fnum_ptr, fidx_ptr, row, q, k_base, v_base, b, n,
                              offs_m, ints_ptr, floats_ptr, F, SCORE_FN, MASK_FN, False, BLOCK_N,
                              INTERPRET)  # fmt: skip

    has_mass = l_i > 0.0
    l_safe = tl.where(has_mass, l_i, 1.0)
    lse = tl.where(has_mass, lse_from_log2(m_i, l_safe), float("-inf"))
    tl.store(lse_ptr + (b * N + n) * T + offs_m, lse, mask=offs_m < T)
    o_base = head_slab(o_ptr, b, n, T, N, HV)
    store_tile(o_base, offs_m, tl.arange(0, BLOCK_DV), acc / l_safe[:, None], N * HV, T, HV)
