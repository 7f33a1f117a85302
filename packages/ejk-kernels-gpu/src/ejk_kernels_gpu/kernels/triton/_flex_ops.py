"""Triton device functions of the flex kernels: the tile of scores under a user's mods, its
gradient, the walk over a block list, and the operations the generated mod functions call.

Imported only through `ejk_kernels_gpu.build._triton.kernels` (and by the modules
`flex._plan` generates, which run after it), once the Triton backend is chosen.

The mods arrive as ``@triton.jit`` functions passed to the kernels as constexpr arguments
(``SCORE_FN``, ``DSCORE_FN``, ``MASK_FN``; generated per mod by `flex._plan`); each works
elementwise on broadcastable tiles, and the captured arrays they read come as two flat
buffers, ``ints`` and ``floats``. Scores are natural logits in float32 throughout (the
score_mod is defined on them), the lse in natural units.
"""

from typing import NamedTuple

import triton
import triton.language as tl

from ._common import LOG2E, along_k, along_q, grid_order, load_tile
from ._common import tanh as flex_tanh

__all__ = ["FlexOptions", "flex_dscores", "flex_load", "flex_probs", "flex_scores", "flex_tanh",
           "flex_trunc", "flex_trunc_div", "flex_trunc_rem", "head_slab", "kv_tiles", "listed_tile", "query_program",
           "table_row"]  # fmt: skip


class FlexOptions(NamedTuple):
    """The compile-time options of one flex launch (each kernel builds it from its constexprs)."""

    T: int  # query rows
    S: int  # key rows
    N: int  # query heads
    G: int  # query heads per kv head
    H: int  # q/k head dim
    HV: int  # v head dim
    BLOCK_D: int  # H padded to a power of two
    BLOCK_DV: int  # HV padded to a power of two
    SCALE: float  # softmax scale
    MB: int  # batch rows of the block tables (1: one table for every row)
    MN: int  # heads of the block tables (1: one table for every head)
    TB: int  # query blocks
    SB: int  # key blocks
    HAS_SCORE: bool  # a score_mod (else SCORE_FN and DSCORE_FN are not called)
    MASK_M: int  # query rows of a block of the tables (a multiple of the kernel's tile)
    MASK_N: int  # keys of a block of the tables


_INTERPRET = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def flex_load(ptr):
    """A captured array's elements at ``ptr`` (a tile of pointers into the ``ints`` or
    ``floats`` buffer), for the generated mods. Compiled, one ``ld.global.nc`` per element
    in inline PTX: a plain ``tl.load`` of a ``[BLOCK_M, BLOCK_N]`` gather (a relative-position
    table) is taken into the loop's software pipeline, as 4-byte ``cp.async`` copies
    through a tile-sized shared buffer (32 KB at 128 x 64 tiles) that the kernel pays for
    in occupancy and copies. The interpreter loads."""
    if _INTERPRET:
        return tl.load(ptr)
    else:
        return tl.inline_asm_elementwise(
            "ld.global.nc.b32 $0, [$1];", "=r,l", [ptr], dtype=ptr.dtype.element_ty,
            is_pure=True, pack=1,
        )  # fmt: skip


@triton.jit
def flex_trunc(x):
    """A float rounded towards zero (for lax.rem on floats)."""
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def flex_trunc_div(a, b):
    """Integer ``a / b`` rounded towards zero, as ``lax.div`` (the same in compiled code and
    the interpreter, whose NumPy would floor)."""
    q = tl.abs(a) // tl.abs(b)
    return tl.where((a < 0) != (b < 0), -q, q)


@triton.jit
def flex_trunc_rem(a, b):
    """Integer remainder with the dividend's sign, as ``lax.rem``."""
    return a - b * flex_trunc_div(a, b)


@triton.jit
def head_slab(ptr, b, head, ROWS: tl.constexpr, HEADS: tl.constexpr, DIM: tl.constexpr):
    """Where one (batch, head)'s ``[ROWS, DIM]`` slab of a ``[B, ROWS, HEADS, DIM]`` array
    starts (rows ``HEADS·DIM`` apart)."""
    return ptr + b.to(tl.int64) * (ROWS * HEADS * DIM) + head * DIM


@triton.jit
def query_program(q_ptr, k_ptr, v_ptr, F: tl.constexpr, BLOCK_M: tl.constexpr):
    """What a program of a ``(query blocks, B·N)`` grid (forward, dq) starts from:
    ``(b, n, offs_m, q, k_base, v_base, row)``: its batch row, query head, query rows,
    their resident q tile, its kv head's k and v slabs and its row of the block tables.
    Programs run last query block first (`grid_order`): under the lower-triangular masks
    most models use, the longest lists start early and the grid ends on short ones."""
    pid_m, pid_bn = grid_order(True)
    b = pid_bn // F.N
    n = pid_bn % F.N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_base = head_slab(q_ptr, b, n, F.T, F.N, F.H)
    q = load_tile(q_base, offs_m, tl.arange(0, F.BLOCK_D), F.N * F.H, F.T, F.H, F.BLOCK_D, True)
    k_base = head_slab(k_ptr, b, n // F.G, F.S, F.N // F.G, F.H)
    v_base = head_slab(v_ptr, b, n // F.G, F.S, F.N // F.G, F.HV)
    return b, n, offs_m, q, k_base, v_base, table_row(b, n, (pid_m * BLOCK_M) // F.MASK_M, F, F.TB)


@triton.jit
def kv_tiles(k_base, v_base, start_n, F: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(offs_n, k, v)``: the key rows from ``start_n`` and their k and v tiles (zeros past S)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_stride: tl.constexpr = (F.N // F.G) * F.H
    v_stride: tl.constexpr = (F.N // F.G) * F.HV
    k = load_tile(k_base, offs_n, tl.arange(0, F.BLOCK_D), k_stride, F.S, F.H, F.BLOCK_D, True)
    v = load_tile(v_base, offs_n, tl.arange(0, F.BLOCK_DV), v_stride, F.S, F.HV, F.BLOCK_DV, True)
    return offs_n, k, v


@triton.jit
def listed_tile(base, it, MASK: tl.constexpr, TILE: tl.constexpr):
    """Where tile ``it`` of a list starts: a list of blocks of ``MASK`` rows is walked as
    one flat loop of ``TILE``-row tiles (one loop body: unrolling the tiles of a block would
    give each its own buffers and pipeline)."""
    subs: tl.constexpr = MASK // TILE
    return tl.load(base + it // subs) * MASK + (it % subs) * TILE


@triton.jit
def table_row(b, n, block, F: tl.constexpr, BLOCKS: tl.constexpr):
    """Row of a ``[MB, MN, BLOCKS, ...]`` block table for batch row ``b``, query head ``n``."""
    if F.MB > 1:
        mb = b
    else:
        mb = 0
    if F.MN > 1:
        mn = n
    else:
        mn = 0
    return (mb * F.MN + mn) * BLOCKS + block


@triton.jit
def flex_scores(a, c, b, n, offs_m, offs_n, ints, floats, F: tl.constexpr, SCORE_FN: tl.constexpr,
                MASK_FN: tl.constexpr, PARTIAL: tl.constexpr, TRANS: tl.constexpr,
                LOG2: tl.constexpr = False):  # fmt: skip
    """``(raw, s)``: ``raw = scale·a·cᵀ`` and the modded scores ``s`` (-inf where hidden),
    in log2 units (``s·log2(e)``, for ``exp2``) with ``LOG2``.

    ``(a, c)`` is ``(q, k)`` for a ``[BLOCK_M, BLOCK_N]`` tile, or ``(k, q)`` with TRANS
    for its transpose (the dk/dv kernel's). The score_mod runs on every element; the
    mask_mod only in PARTIAL blocks (a FULL block is visible everywhere by its table).
    The streamed side's rows past its end (keys past S in the forward and dq kernels,
    queries past T in dk/dv) are hidden where the tiles do not divide that length: their
    zero-filled rows would count in the softmax or in dk and dv. The resident side's
    rows past its end are never stored, and reach no other row.
    """
    dot = tl.dot(a, tl.trans(c))
    raw = dot * F.SCALE
    q_idx = along_q(offs_m, TRANS)
    kv_idx = along_k(offs_n, TRANS)
    if TRANS:
        ragged: tl.constexpr = tl.constexpr(F.T) % offs_m.shape[0] != 0
        inside = q_idx < F.T
    else:
        ragged: tl.constexpr = tl.constexpr(F.S) % offs_n.shape[0] != 0
        inside = kv_idx < F.S
    if F.HAS_SCORE:
        s = SCORE_FN(raw, b, n, q_idx, kv_idx, ints, floats)
        if LOG2:
            s = s * LOG2E
    elif LOG2:  # one multiply: the scale and log2(e) folded
        s = dot * (F.SCALE * LOG2E)
    else:
        s = raw
    if PARTIAL:
        visible = MASK_FN(b, n, q_idx, kv_idx, ints, floats)
        if ragged:
            visible = visible & inside
        s = tl.where(visible, s, float("-inf"))
    elif ragged:
        s = tl.where(inside, s, float("-inf"))
    return raw, s


@triton.jit
def flex_probs(a, c, lse, b, n, offs_m, offs_n, ints, floats, F: tl.constexpr,
               SCORE_FN: tl.constexpr, MASK_FN: tl.constexpr, PARTIAL: tl.constexpr,
               TRANS: tl.constexpr):  # fmt: skip
    """``(raw, P)`` of a tile rebuilt from the row's lse (loaded by `load_rows`: an emptied
    row's -inf lse as 0, so its P, every score -inf, is 0)."""
    raw, s = flex_scores(a, c, b, n, offs_m, offs_n, ints, floats, F, SCORE_FN, MASK_FN,
                         PARTIAL, TRANS)  # fmt: skip
    return raw, tl.exp(s - along_q(lse, TRANS))


@triton.jit
def flex_dscores(raw, p, dp, delta, b, n, offs_m, offs_n, ints, floats, F: tl.constexpr,
                 DSCORE_FN: tl.constexpr, TRANS: tl.constexpr):  # fmt: skip
    """The gradient of the raw scores: ``dS = P ∘ (dP - delta)`` (FlashAttention-2, Alg. 2)
    through the score_mod, ``dS · ∂score_mod/∂score`` at ``raw``; 0 where P is (hidden
    elements, whose derivative may be anything)."""
    ds = p * (dp - along_q(delta, TRANS))
    if F.HAS_SCORE:
        d = DSCORE_FN(raw, b, n, along_q(offs_m, TRANS), along_k(offs_n, TRANS), ints, floats)
        ds = tl.where(p > 0.0, ds * d, 0.0)
    return ds
