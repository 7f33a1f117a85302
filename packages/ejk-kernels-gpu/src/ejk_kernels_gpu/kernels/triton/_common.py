"""Triton device functions shared by the forward and backward kernels.

Imported only through `ejk_kernels_gpu.build._triton.kernels`, after the Triton
backend (GPU or interpreter) has been chosen.

Two named tuples travel through every helper so that signatures stay short and
every option is read by name: `Options` (``F``), the compile-time options of a call
(``F.CAUSAL``, ``F.SCALE``, ...), which each kernel builds from its constexpr
arguments and passes on as a constexpr; and `MaskTables` (``P``), the runtime
pointers of the masking tables. Triton (3.6, compiled and interpreted) keeps a
NamedTuple's fields and their constexpr-ness through calls and attribute access.

Softmax runs in base 2 (``exp2`` is the hardware instruction; FlashAttention-2
and the Triton tutorial do the same): `logits` returns a tile ``x`` whose logits
in log2 units are ``x * LOG2_FACTOR``. In the plain case (no bias, no soft cap)
``x`` is the raw ``q·kᵀ`` and the factor is ``scale·log2(e)``, so scaling and
max-subtraction fuse into one FMA; otherwise ``x`` is the natural
logit, the running max and the lse stay in natural units, and the max is
subtracted before ``exp`` (``exp2`` of the difference times ``log2(e)``, the same
instructions on a GPU, overflowing silently where the interpreter's NumPy warns):
a finite bias as low as -FLT_MAX stays finite (``-FLT_MAX·log2(e)`` would overflow
to -inf and hide the key).

With a bias the backward cannot rebuild ``P = exp(s - lse)`` from the float32 lse: where
the row max ``m`` is huge (a whole row of -1e30 or -FLT_MAX bias), ``lse = m + log(l)``
rounds to ``m`` and ``log(l)`` is lost. The forward then keeps the two apart, as the
rows ``[B, N, 2, T]`` of ``(m, log l)`` (`softmax_rows`), and the backward computes
``P = exp((s - m) - log l)``; the lse for the caller is their sum.
"""

from typing import NamedTuple

import triton
import triton.language as tl

# The dropout counter hash (reference-spec: mix = MurmurHash3's fmix32 after a golden-ratio xor).
_GOLDEN = tl.constexpr(0x9E3779B1)
_MUR1 = tl.constexpr(0x85EBCA6B)
_MUR2 = tl.constexpr(0xC2B2AE35)
# Rows of the grid scheduled together by `grid_order`: four (batch, head) rows of 32
# 128-row blocks (4k tokens) fill an H100's 132 SMs about once.
GRID_GROUP = tl.constexpr(4)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


class Options(NamedTuple):
    """The compile-time options of one kernel launch (each kernel builds it from its
    constexpr arguments; the forward and dq kernels set the dk/dv-only fields False)."""

    T: int  # query rows
    S: int  # key rows
    H: int  # head dim
    BLOCK_D: int  # head dim padded to a power of two
    SCALE: float  # softmax scale
    SOFT_CAP: float  # 0.0: none
    HAS_BIAS: bool
    VARLEN: bool  # masks on per-token positions (packed sequences, context-parallel blocks)
    SEQ_IDS: bool  # with VARLEN: also compare sequence ids (packed sequences)
    HAS_SEG: bool  # segment ids
    CAUSAL: bool
    WINDOW_LEFT: int  # -1: no window
    WINDOW_RIGHT: int
    DROPOUT_THRESHOLD: int  # 0: no dropout
    DROPOUT_SCALE: float
    LOG2_FACTOR: float  # see the module docstring
    BIAS_SN: int  # the bias's head stride (0: broadcast over heads)
    DQ_ATOMIC: bool  # dk/dv kernel: add dq into a float32 buffer
    DQ_TMA: bool  # ... by TMA reduces
    LSE_FACTOR: float  # the backward's lse units: log2 (LOG2E, plain case) or natural (1.0)
    # With HAS_BIAS the backward reads (row max, log row sum) rather than the lse (see above).


class MaskTables(NamedTuple):
    """Runtime pointers of the masking tables: packed sequence ids and positions, segment ids."""

    qsid: object
    ksid: object
    qpos: object
    kpos: object
    qseg: object
    kseg: object


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
def dropout_keep(key_ptr, b, n, offs_m, offs_n, THRESHOLD: tl.constexpr, TRANS: tl.constexpr):
    """bool tile: keep-mask of rows offs_m, columns offs_n for (batch b, head n).

    ``key_ptr``: uint32 ``[seed, b0, n0, i0, j0]`` (`ejk_sequtils.dropout_key`): the
    hash takes the global indices ``b0 + b``, ``n0 + n``, ``i0 + row``, ``j0 + column``,
    so a shard of a sharded call draws its slice of the whole call's mask.
    """
    seed = tl.load(key_ptr)
    b = b.to(tl.uint32) + tl.load(key_ptr + 1)
    n = n.to(tl.uint32) + tl.load(key_ptr + 2)
    rows = offs_m.to(tl.uint32) + tl.load(key_ptr + 3)
    cols = offs_n.to(tl.uint32) + tl.load(key_ptr + 4)
    h = _mix(_mix(seed, b), n)
    h = along_q(_mix(h, rows), TRANS)
    h = _mix(h, along_k(cols, TRANS))
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
    m_ok = offs_m < F.T
    n_ok = offs_n < F.S
    visible = along_q(m_ok, TRANS) & along_k(n_ok, TRANS)
    if F.VARLEN:
        # Packed input: sequence ids (padding rows/columns get ids that never match)
        # and positions local to their sequence; context-parallel blocks: global
        # positions alone.
        if F.SEQ_IDS:
            qsid = tl.load(P.qsid + offs_m, mask=m_ok, other=-1)
            ksid = tl.load(P.ksid + offs_n, mask=n_ok, other=-2)
            visible = visible & (along_q(qsid, TRANS) == along_k(ksid, TRANS))
        pos_q = along_q(tl.load(P.qpos + offs_m, mask=m_ok, other=0), TRANS)
        pos_k = along_k(tl.load(P.kpos + offs_n, mask=n_ok, other=0), TRANS)
    else:
        pos_q = along_q(offs_m, TRANS)
        pos_k = along_k(offs_n, TRANS)
    if F.CAUSAL:
        visible = visible & (pos_k <= pos_q)
    if F.WINDOW_LEFT >= 0:
        visible = visible & (pos_k >= pos_q - F.WINDOW_LEFT) & (pos_k <= pos_q + F.WINDOW_RIGHT)
    if F.HAS_SEG:
        # Equal ids see each other; a negative id is padding (0 is an ordinary segment).
        qs = along_q(tl.load(P.qseg + b * F.T + offs_m, mask=m_ok, other=-1), TRANS)
        ks = along_k(tl.load(P.kseg + b * F.S + offs_n, mask=n_ok, other=-1), TRANS)
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
def kv_bases(k_ptr, v_ptr, b64, kh, S: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
             KV_PAIR: tl.constexpr):  # fmt: skip
    """``(k, v)`` slab bases of one (batch, kv head): apart, or with ``KV_PAIR`` the two
    halves of each head's columns of one ``[B, S, K, 2H]`` array (k first; ``k_ptr`` and
    ``v_ptr`` both point at it; rows then ``2·K·H`` apart, `kv_row`)."""
    if KV_PAIR:
        base = b64 * (S * K * 2 * H) + kh * (2 * H)
        return k_ptr + base, v_ptr + base + H
    else:
        base = b64 * (S * K * H) + kh * H
        return k_ptr + base, v_ptr + base


@triton.jit
def lse_from_log2(m, total):
    """The lse in natural units from a running max ``m`` in log2 units and its sum ``total``."""
    return (m + tl.math.log2(total)) * LN2


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
    warpgroup's half of the rows, 64 too far (docs/performance-history.md#step-6-2026-11-23);
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
    s = tl.dot(a, tl.trans(c))
    if F.LOG2_FACTOR == LOG2E:  # natural logits (see the module docstring)
        s = s * F.SCALE
    if F.HAS_BIAS:
        # Masked on both axes even in fully visible blocks: the resident side of a
        # program (rows in fwd/dq, columns in dk/dv) may run past the end. -inf there:
        # P = 0 past the end of the keys whatever the row's max m (a logit of 0 would
        # give exp(0 - m) = inf for m = -1e30, and inf · 0 = NaN in an atomic dq).
        qi = along_q(offs_m, TRANS)
        kj = along_k(offs_n, TRANS)
        b_off = qi * F.S + kj
        bmask = (qi < F.T) & (kj < F.S)
        s += tl.load(bias_base + b_off, mask=bmask, other=float("-inf")).to(tl.float32)
    if F.SOFT_CAP > 0.0:
        s = F.SOFT_CAP * tanh(s / F.SOFT_CAP)
    if MASKED:
        s = tl.where(visibility(offs_m, offs_n, b, P, F, TRANS), s, float("-inf"))
    return s


@triton.jit
def dropout_weights(p, key_ptr, b, n, offs_m, offs_n, F: tl.constexpr):
    """``p`` with dropped entries zeroed and kept ones scaled by ``1 / (1 - rate)``."""
    if F.DROPOUT_THRESHOLD > 0:
        keep = dropout_keep(key_ptr, b, n, offs_m, offs_n, F.DROPOUT_THRESHOLD, False)
        p = tl.where(keep, p * F.DROPOUT_SCALE, 0.0)
    return p


@triton.jit
def grad_logits(q, k, v, do, lse, delta, bias_base, key_ptr, b, n, offs_m, offs_n, P,
                F: tl.constexpr, MASKED: tl.constexpr, TRANS: tl.constexpr, diag,
                BLOCK_CAUSAL: tl.constexpr):  # fmt: skip
    """Recompute one tile's probabilities and the gradient of the pre-cap logits.

    FlashAttention-2, Alg. 2: ``P = exp(s - lse)`` (in base 2; ``lse`` comes in log2
    units in the plain case, in natural units with natural logits: ``F.LSE_FACTOR``;
    with a bias it is the pair ``(m, log l)`` and ``P = exp((s - m) - log l)``, see the
    module docstring and `load_softmax_rows`), ``dP = dO·vᵀ`` (times the dropout scale
    where kept), ``dS = P ∘ (dP - delta)`` with ``delta = rowsum(dO ∘ O)``; through the
    soft cap ``1 - (s/cap)²``.
    With TRANS every tile is transposed ([BLOCK_N, BLOCK_M]: ``Pᵀ = exp(k·qᵀ ...)``,
    ``dPᵀ = v·dOᵀ``), as the dk/dv kernel consumes them (FlashAttention-2's dK, dV loop).
    BLOCK_CAUSAL: the causal mask of the warp-specialised loops (`block_causal`).

    Returns:
        (P after dropout, dX), float32 tiles.
    """
    if TRANS:
        s = logits(k, q, bias_base, offs_m, offs_n, b, P, F, MASKED, TRANS)
        dp = tl.dot(v, tl.trans(do))
    else:
        s = logits(q, k, bias_base, offs_m, offs_n, b, P, F, MASKED, TRANS)
        dp = tl.dot(do, tl.trans(v))
    if BLOCK_CAUSAL:
        s = block_causal(s, diag, TRANS)
    if F.HAS_BIAS:  # the row max and log row sum apart (a huge m would round log l away)
        m, log_l = lse
        p = tl.exp((s - along_q(m, TRANS)) - along_q(log_l, TRANS))
    elif F.LOG2_FACTOR == LOG2E:  # natural logits and lse: subtract before scaling
        p = tl.exp(s - along_q(lse, TRANS))
    else:
        p = tl.math.exp2(s * F.LOG2_FACTOR - along_q(lse, TRANS))
    if F.DROPOUT_THRESHOLD > 0:
        keep = dropout_keep(key_ptr, b, n, offs_m, offs_n, F.DROPOUT_THRESHOLD, TRANS)
        p_drop = tl.where(keep, p * F.DROPOUT_SCALE, 0.0)
        dp = tl.where(keep, dp * F.DROPOUT_SCALE, 0.0)
    else:
        p_drop = p
    ds = p * (dp - along_q(delta, TRANS))
    if F.SOFT_CAP > 0.0:
        t = tl.where(s == float("-inf"), 0.0, s / F.SOFT_CAP)
        ds = ds * (1.0 - t * t)
    return p_drop, ds


@triton.jit
def load_rows(base, offs, N_ROWS: tl.constexpr, MASKED: tl.constexpr, FACTOR: tl.constexpr):
    """Per-row float32 statistics times ``FACTOR`` (the lse with ``F.LSE_FACTOR``, delta
    with 1.0).

    A -inf lse (a row with no visible key) becomes 0, so ``exp2(-inf - 0)`` gives 0.
    """
    if MASKED:
        x = tl.load(base + offs, mask=offs < N_ROWS, other=0.0)
    else:
        x = tl.load(base + offs)
    return row_stats(x, FACTOR)


@triton.jit
def softmax_rows(base, offset, F: tl.constexpr):
    """Where the softmax statistics of a (batch, head) start, ``offset`` being that of its
    row of ``[B, N, T]`` (``(b·N + n)·T``): the lse itself, or with a bias the rows
    ``[B, N, 2, T]`` of (row max, log row sum), twice as far."""
    if F.HAS_BIAS:
        return base + 2 * offset
    else:
        return base + offset


@triton.jit
def load_softmax_rows(base, offs, MASKED: tl.constexpr, F: tl.constexpr):
    """What `grad_logits` rebuilds P from, for rows ``offs`` (``base``: `softmax_rows`): the
    lse in units of ``F.LSE_FACTOR``, or with a bias the pair (m, log l), natural units.

    A row with no visible key has m = -inf and log l = 0 (the forward's l = 1 there):
    loaded as (0, 0), its P is exp(-inf) = 0, as `load_rows` makes of a -inf lse.
    """
    if F.HAS_BIAS:
        m = load_rows(base, offs, F.T, MASKED, 1.0)
        log_l = load_rows(base + F.T, offs, F.T, MASKED, 1.0)
        return m, log_l
    else:
        return load_rows(base, offs, F.T, MASKED, F.LSE_FACTOR)


@triton.jit
def row_stats(x, FACTOR: tl.constexpr):
    """Loaded per-row statistics as `load_rows` returns them (``x * FACTOR``, -inf as 0)."""
    return tl.where(x == float("-inf"), 0.0, x * FACTOR)


@triton.jit
def load_ranges(ranges_ptr, pid, b, PER_BATCH: tl.constexpr):
    """This program's ``(lo, full_lo, full_hi, hi)`` from the block table (see `flash._tables.block_table`).

    ``PER_BATCH`` (segment ids, whose ranges differ by batch row): the table is
    ``[B, blocks, 4]``, blocks being the grid's first axis; else ``[blocks, 4]``.
    """
    if PER_BATCH:
        base = ranges_ptr + (b * tl.num_programs(0) + pid) * 4
    else:
        base = ranges_ptr + pid * 4
    return tl.load(base), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3)
