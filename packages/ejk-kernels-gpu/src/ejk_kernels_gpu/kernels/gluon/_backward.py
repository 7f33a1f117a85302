"""The Hopper backward written in Gluon: the dk/dv kernel (key-resident) and the dq kernel.

One program owns ``BN`` = 128 keys of one (batch, kv head) and visits every query block
that can see them, for each query head of the group (FlashAttention-2's dk/dv loop,
Alg. 2, on Hopper's warpgroup matrix instructions). With a window, packed sequences or
segment ids the query blocks come from the dk/dv block table (`flash._tables.block_table`,
``(lo, full_lo, full_hi, hi)`` in query rows): blocks outside ``[lo, hi)`` are never
loaded, blocks inside ``[full_lo, full_hi)`` run without a mask, the others hide pairs by
the forward's rule (`kernels.gluon._common.visible`); causal alone needs no table. Programs take
their tiles in the grid's order (each group's heaviest first) or, with ``ORDERED``, in the
launch's (`flash._schedule.launch_order`, `program_tile`): a few groups at a time, the heaviest
first.

- a program whose keys no query block sees stores zeros as their dk and dv and ends,
  before it builds descriptors, barriers or warp partitions (causal keys past the rows;
  in context parallelism's all-gather call, most programs at n = 4; `store_zero_dkdv`);
- a producer warp copies the program's k and v once, then q and dO of each visited query block into a
  ring of ``STAGES`` slots by TMA (``ready``: the copy landed; ``empty``: both consumers
  are done with the slot);
- two consumer warpgroups own 64 keys each. Per query block they issue ``Sᵀ = k·qᵀ``
  and ``dPᵀ = v·dOᵀ`` together, rebuild ``Pᵀ`` from the saved lse while the second runs,
  issue ``dV += Pᵀ·dO``, form ``dSᵀ = Pᵀ ∘ (dPᵀ - delta)`` while that runs, then issue
  ``dK += dSᵀ·q``. ``Pᵀ`` and ``dSᵀ`` stay in registers as the matmuls' first operand.

With ``DQ`` (a config with ``atomic_dq``, head_dim 128) the kernel computes dq too: both
consumers' ``dSᵀ`` go through shared memory, each multiplies ``dS`` by its half of k's
columns and adds the result into a float32 buffer by a TMA reduce (`_add_dq`,
`_store_dq`). Otherwise dq comes from `gluon_dq_kernel` below (the forward's schedule:
consumer warpgroups of 64 query rows, k and v streamed; three consumers, 192 rows a
program, without a block table; two, 128 rows, pipelined with three slots, with one at
head_dim 128; 64 keys a step, 32 at head_dim 256 where 128 rows of q and dO take 128 KiB:
`flash._select.DQ_RULES`), or the ordinary dq kernel. Calls the dk/dv kernel takes
(`flash._select.can_run_gluon_dkdv`): 16-bit, head_dim 64 or 128, a positive scale, no bias or
dropout (every mask, the soft cap and sinks are fine: the sinks
live in the lse; the soft cap's slope ``1 - tanh²`` scales dS), and query rows on whole
64-row tiles (q and dO are read through one descriptor over every (batch, head)); the
Gluon dq kernel takes the same masks (through the dq block table). Keys past the end are zero-filled on load
and clipped on store.
"""

from typing import NamedTuple

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from ._common import (
    barriers,
    operand_layout,
    pair_descriptors,
    reduce_add,
    ring_slot,
    tanh,
    token_info,
    visible,
    wgmma_layout,
)

_LOG2E = gl.constexpr(1.4426950408889634)


class DkdvOptions(NamedTuple):
    """The compile-time options of one launch (built in the kernel, passed as a constexpr)."""

    T: int  # query rows
    S: int  # key rows
    N: int  # query heads
    G: int  # query heads per kv head
    H: int  # head_dim
    BM: int  # query rows per step
    BN: int  # keys per program (two consumers of BN / 2)
    STAGES: int  # slots of the q/dO ring
    QK: float  # scale · log2(e)
    SOFT_CAP: float  # 0.0: none
    CAP_IN: float  # scale / soft cap: tanh's argument per q·kᵀ
    CAP_OUT: float  # soft cap · log2(e): capped logits in log2 units
    CAUSAL: bool
    WINDOW_LEFT: int  # -1: no window
    WINDOW_RIGHT: int
    VARLEN: bool  # positions per token (packed sequences, context-parallel blocks)
    SEQ_IDS: bool  # with VARLEN: sequence ids per token too (packed sequences)
    HAS_SEG: bool  # segment ids per (batch, token)
    TABLE: bool  # query ranges from the block table (window, packing, segment ids)
    DQ: bool  # dq too, added into a float32 buffer by TMA reduce (head_dim 128)


@gluon.jit
def program_tile(order_ptr, blocks: gl.constexpr, ORDERED: gl.constexpr,
                 GRID_BLOCK: gl.constexpr = False):  # fmt: skip
    """(block, group) of this program of a (blocks, groups) grid: the tile ``order_ptr``
    gives its linear index (`flash._schedule.tile_order`: heaviest first within blocks of
    groups, a group being one (batch, head) or (batch, kv head)); without ``ORDERED`` the
    grid's own. ``GRID_BLOCK``: with one block, the grid's block index (0) rather than a
    constant the compiler folds (the dk/dv kernel's masks then fold and fail to lower,
    `_forward._tile` says why)."""
    if ORDERED and GRID_BLOCK and blocks == 1:
        block = gl.program_id(0)
        group = gl.load(order_ptr + gl.program_id(1))
    elif ORDERED:
        tile = gl.load(order_ptr + gl.program_id(1) * blocks + gl.program_id(0))
        block = tile % blocks
        group = tile // blocks
    else:
        block = gl.program_id(0)
        group = gl.program_id(1)
    return block, group


@gluon.jit
def query_blocks(pid_n, b, ranges_ptr, F: gl.constexpr):
    """(first, full_lo, full_hi, end) query blocks of a program's keys: it visits
    ``[first, end)`` and needs no mask in ``[full_lo, full_hi)``. From the block table
    (``TABLE``), else causal programs skip the blocks wholly before their first key (and
    mask every block they visit: the full range is unused)."""
    n_m: gl.constexpr = F.T // F.BM
    if F.TABLE:
        n_n: gl.constexpr = (F.S + F.BN - 1) // F.BN
        table = ranges_ptr + ((b * n_n + pid_n) * 4 if F.HAS_SEG else pid_n * 4)
        first = gl.load(table) // F.BM
        end = gl.cdiv(gl.load(table + 3), F.BM)
        return first, gl.load(table + 1) // F.BM, gl.load(table + 2) // F.BM, end
    first = gl.minimum((pid_n * F.BN) // F.BM, n_m) if F.CAUSAL else 0
    return first, first, first, n_m


@gluon.jit
def probabilities(s_t, lse_rows, m, full, masks, F: gl.constexpr):
    """``Pᵀ`` of step ``m`` (query block) from its logits ``s_t`` ([keys, rows]) and the
    rows' saved lse (``lse_rows``: a pointer to them, natural log, one per column of
    ``s_t``): ``(p, t)``, the call's masks applied, ``t`` the soft cap's tanh whose slope
    ``1 - t²`` dS takes (``s_t`` itself without a cap: unused). ``full``: the step range
    that needs no mask (``TABLE``); ``masks``: (keys, their `token_info`, the rows' first
    index, the columns' offsets, batch row, the rows' mask tables). The dk/dv kernels'
    shared step (`gluon_dkdv_kernel`, `kernels.gluon._backward_wide`)."""
    keys, key_info, row0, cols, b, row_tabs = masks
    # Rows without mass (lse -inf) have P = 0: +inf keeps exp2 at 0 instead of NaN.
    lse = gl.load(lse_rows + cols) * _LOG2E
    lse = gl.where(lse == float("-inf"), float("inf"), lse)
    t = s_t
    if F.SOFT_CAP > 0.0:  # logits cap·tanh(x / cap)
        t = tanh(s_t * F.CAP_IN)
        p = gl.exp2(t * F.CAP_OUT - gl.expand_dims(lse, 0))
    else:
        p = gl.exp2(s_t * F.QK - gl.expand_dims(lse, 0))
    if F.TABLE:
        if (m < full[0]) | (m >= full[1]):  # a block some pair of which is hidden
            row_info = token_info(row0 + cols, F.T, b, row_tabs, F, -1)
            p = gl.where(visible(row_info, key_info, 1, F), p, 0.0)
    elif F.CAUSAL:
        p = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(row0 + cols, 0), p, 0.0)
    return p, t


@gluon.jit
def store_dkdv(dk, dv, bufs, dests, coord):
    """Store ``dk`` (times the scale) and ``dv`` through the buffers ``bufs`` (k's and v's,
    no longer read) to the descriptors of ``dests`` = (dk's, dv's, scale) at ``coord``."""
    k_buf, v_buf = bufs
    dk_desc, dv_desc, scale = dests
    k_buf.store((dk * scale).to(k_buf.dtype))
    v_buf.store(dv.to(v_buf.dtype))
    hopper.fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, coord, k_buf)
    tma.async_copy_shared_to_global(dv_desc, coord, v_buf)
    tma.store_wait(0)


@gluon.jit
def store_zero_dkdv(dests, b, kh, pid_n, S: gl.constexpr, K: gl.constexpr, H: gl.constexpr,
                    BN: gl.constexpr, JOINT: gl.constexpr):  # fmt: skip
    """Zeros as dk and dv of keys ``pid_n·BN ..`` (clipped at S) of batch ``b``, kv head
    ``kh``, by plain stores: what a program whose keys no query block sees writes, before
    it would build descriptors, barriers and warp partitions. ``dests``: dk's and dv's
    pointers ([B, S, K, H] each; with ``JOINT`` dk's [B, S, K, 2H] holds both)."""
    dk_ptr, dv_ptr = dests
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    rows = gl.expand_dims(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, layout)), 1)
    cols = gl.expand_dims(gl.arange(0, H, layout=gl.SliceLayout(0, layout)), 0)
    width: gl.constexpr = 2 * H if JOINT else H
    at = ((b.to(gl.int64) * S + rows) * K + kh) * width + cols
    keep = (rows < S) & (cols < H)
    zeros = gl.zeros([BN, H], dk_ptr.dtype.element_ty, layout)
    gl.store(dk_ptr + at, zeros, mask=keep)
    if JOINT:
        gl.store(dk_ptr + H + at, zeros, mask=keep)
    else:
        gl.store(dv_ptr + at, zeros, mask=keep)


@gluon.jit
def _producer(descs, smem, bars, ranges_ptr, b, kh, pid_n, F: gl.constexpr):
    """Copy the program's k and v, then q and dO of every (head of the group, query block)."""
    q_desc, do_desc, k_desc, v_desc = descs
    q_smem, do_smem, k_smem, v_smem = smem[:4]
    kv_ready, ready, empty = bars[:3]
    HALF: gl.constexpr = F.BN // 2
    first, _, _, end = query_blocks(pid_n, b, ranges_ptr, F)
    steps = end - first  # (at least one: programs without are done in `gluon_dkdv_kernel`)
    mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for c in gl.static_range(2):
        key = pid_n * F.BN + c * HALF
        tma.async_copy_global_to_shared(k_desc, [key, 0], kv_ready, k_smem.index(c))
        tma.async_copy_global_to_shared(v_desc, [key, 0], kv_ready, v_smem.index(c))
    for i in range(F.G * steps):
        n = kh * F.G + i // steps
        m = first + i % steps
        s, phase = ring_slot(i, F.STAGES)
        mbarrier.wait(empty.index(s), phase ^ 1)  # a slot's first use waits for nothing
        mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        row = b * F.T + m * F.BM
        tma.async_copy_global_to_shared(q_desc, [row, n * F.H], ready.index(s), q_smem.index(s))
        tma.async_copy_global_to_shared(do_desc, [row, n * F.H], ready.index(s), do_smem.index(s))


@gluon.jit
def _add_dq(ds, i, smem, ds_ready, F: gl.constexpr, C: gl.constexpr):
    """Issue this step's ``dQ = dS·k`` for its ``BM`` query rows over the program's 128 keys,
    columns ``C·H/2 ..`` (``DQ``); returns the matmul's token ([BM, H/2] float32).

    Each consumer puts its ``dSᵀ`` (``ds``: [its 64 keys, BM rows]) into shared memory
    (buffer pair by step parity) and signals ``ds_ready``; once both halves are in, it
    multiplies ``dS`` by its half of k's columns. A buffer pair is written again two steps
    later, after the other consumer has signalled the step between, so after its matmuls
    on it ended (each consumer waits for its matmuls before its next step).
    """
    k_smem, ds_smem = smem
    HQ: gl.constexpr = F.H // 2
    pair = (i % 2) * 2
    ds_smem.index(pair + C).store(ds)
    hopper.fence_async_shared()  # before the other warpgroup's matmul reads it
    gl.thread_barrier()
    mbarrier.arrive(ds_ready.index(i % 2), count=1)
    mbarrier.wait(ds_ready.index(i % 2), (i // 2) & 1)
    zero = gl.zeros([F.BM, HQ], gl.float32, wgmma_layout(HQ))
    tok = hopper.warpgroup_mma(
        ds_smem.index(pair).permute((1, 0)), k_smem.index(0).slice(C * HQ, HQ, dim=1), zero,
        use_acc=False, is_async=True,
    )  # fmt: skip
    return hopper.warpgroup_mma(
        ds_smem.index(pair + 1).permute((1, 0)), k_smem.index(1).slice(C * HQ, HQ, dim=1),
        tok, is_async=True,
    )  # fmt: skip


@gluon.jit
def _store_dq(dq, smem, dq_desc, row, n, F: gl.constexpr, C: gl.constexpr):
    """Add ``dq`` ([BM, H/2] float32) at (``row``, head ``n``, columns ``C·H/2 ..``) of the
    float32 buffer by a TMA reduce, through this consumer's staging tile."""
    HQ: gl.constexpr = F.H // 2
    stage = smem.index(C)
    tma.store_wait(0)  # the previous step's reduce has read the staging tile
    gl.thread_barrier()
    stage.store(dq)
    hopper.fence_async_shared()
    gl.thread_barrier()
    reduce_add(dq_desc, [row, n * F.H + C * HQ], stage)


@gluon.jit
def _consumer(smem, bars, stats, tabs, dest, b, kh, pid_n, F: gl.constexpr, C: gl.constexpr):
    """dk and dv of keys ``pid_n·BN + C·BN/2 ..`` (consumer C of two); with ``DQ`` its
    half of dq's columns too (`_add_dq`). ``tabs``: the rows' and keys' mask tables and
    the block table."""
    q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem = smem
    kv_ready, ready, empty, ds_ready, done = bars
    lse_ptr, delta_ptr = stats
    row_tabs, key_tabs, ranges_ptr = tabs
    dk_desc, dv_desc, dq_desc, scale = dest
    HALF: gl.constexpr = F.BN // 2
    # Sᵀ and dPᵀ: [keys, query rows]; dK and dV: [keys, head_dim].
    s_layout: gl.constexpr = wgmma_layout(F.BM)
    o_layout: gl.constexpr = wgmma_layout(F.H)
    a_layout: gl.constexpr = operand_layout(o_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype
    k_c = k_smem.index(C)
    v_c = v_smem.index(C)
    dk = gl.zeros([HALF, F.H], gl.float32, o_layout)
    dv = gl.zeros([HALF, F.H], gl.float32, o_layout)
    zero_s = gl.zeros([HALF, F.BM], gl.float32, s_layout)
    keys = pid_n * F.BN + C * HALF + gl.arange(0, HALF, layout=key_layout)
    key_info = token_info(keys, F.S, b, key_tabs, F, -2)  # what the masks read per key
    cols = gl.arange(0, F.BM, layout=col_layout)
    first, full_lo, full_hi, end = query_blocks(pid_n, b, ranges_ptr, F)
    steps = end - first  # (at least one, see `_producer`)
    mbarrier.wait(kv_ready, 0)
    for i in range(F.G * steps):
        n = kh * F.G + i // steps
        m = first + i % steps
        s, phase = ring_slot(i, F.STAGES)
        mbarrier.wait(ready.index(s), phase)
        q_s = q_smem.index(s)
        do_s = do_smem.index(s)
        s_tok = hopper.warpgroup_mma(k_c, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp_tok = hopper.warpgroup_mma(
            v_c, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True
        )
        row0 = m * F.BM
        stat = (b * F.N + n).to(gl.int64) * F.T + row0  # lse and delta of these rows
        s_t = hopper.warpgroup_mma_wait(1, deps=[s_tok])
        masks = (keys, key_info, row0, cols, b, row_tabs)
        p, t = probabilities(s_t, lse_ptr + stat, m, (full_lo, full_hi), masks, F)
        p16 = gl.convert_layout(p.to(dtype), a_layout)
        if F.SOFT_CAP > 0.0:  # dS takes the logits' slope 1 - tanh²: folded in now, so
            p = p * (1.0 - t * t)  # that t is not held across the matmuls
        dv_tok = hopper.warpgroup_mma(p16, do_s, dv, is_async=True)
        dp = hopper.warpgroup_mma_wait(1, deps=[dp_tok])
        delta = gl.load(delta_ptr + stat + cols)
        ds = (p * (dp - gl.expand_dims(delta, 0))).to(dtype)
        dk_tok = hopper.warpgroup_mma(gl.convert_layout(ds, a_layout), q_s, dk, is_async=True)
        if F.DQ:
            row = b * F.T + row0
            dq_tok = _add_dq(ds, i, (k_smem, ds_smem), ds_ready, F, C)
            dv = hopper.warpgroup_mma_wait(2, deps=[dv_tok])
            dk = hopper.warpgroup_mma_wait(2, deps=[dk_tok])
            mbarrier.arrive(empty.index(s), count=1)
            dq = hopper.warpgroup_mma_wait(0, deps=[dq_tok])
            _store_dq(dq, dq_smem, dq_desc, row, n, F, C)
        else:
            dv = hopper.warpgroup_mma_wait(1, deps=[dv_tok])
            dk = hopper.warpgroup_mma_wait(0, deps=[dk_tok])
            mbarrier.arrive(empty.index(s), count=1)
    if F.DQ:  # the other consumer's last dq matmul reads this one's k: wait for it
        mbarrier.arrive(done, count=1)
        mbarrier.wait(done, 0)
    # k and v are no longer read: dk and dv leave through their buffers.
    store_dkdv(dk, dv, (k_c, v_c), (dk_desc, dv_desc, scale), [pid_n * F.BN + C * HALF, 0])


@gluon.jit
def gluon_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr,
    qsid_ptr, ksid_ptr, qpos_ptr, kpos_ptr, qseg_ptr, kseg_ptr, ranges_ptr, order_ptr,
    dk_ptr, dv_ptr, dq_acc_ptr, scratch_ptr,
    B: gl.constexpr, T: gl.constexpr, S: gl.constexpr, N: gl.constexpr, G: gl.constexpr,
    H: gl.constexpr, SCALE: gl.constexpr, QK: gl.constexpr, SOFT_CAP: gl.constexpr,
    CAP_IN: gl.constexpr, CAP_OUT: gl.constexpr, CAUSAL: gl.constexpr,
    WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
    SEQ_IDS: gl.constexpr,
    HAS_SEG: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
    DQ: gl.constexpr, ORDERED: gl.constexpr, JOINT: gl.constexpr, KV_PAIR: gl.constexpr,
    INTERPRET: gl.constexpr,
):  # fmt: skip
    """dk, dv [B, S, K, H] (with ``JOINT`` side by side in ``dk_ptr``'s [B, S, K, 2H],
    `pair_descriptors`) from q, dO [B, T, N, H], k, v [B, S, K, H] (``KV_PAIR``: one
    ``[B, S, K, 2H]``), lse and delta
    [B, N, T] (lse in natural log); grid (key blocks of BN, B·K). ``QK`` = scale · log2(e);
    with ``SOFT_CAP`` the logits are ``cap·tanh(scale·q·kᵀ / cap)`` (``CAP_IN``, ``CAP_OUT``
    as the forward's); the mask tables (sequence ids, positions, segment ids of rows and
    keys) and ``ranges_ptr``, the dk/dv block table (``[key blocks, 4]``, ``[B, key blocks,
    4]`` with segment ids), as the ordinary dk/dv kernel's; ``order_ptr`` with ``ORDERED``
    each program's tile (int32 ``[B·K·key blocks]``, `program_tile`), else the grid's; with
    ``DQ``, ``dq_acc_ptr`` [B, T, N, H] float32, zeros on entry, gains ``dS·k`` (unscaled;
    head_dim 128), else it is unused; ``scratch_ptr`` holds the TMA descriptors (see
    _jax_triton_fix); INTERPRET is unused."""
    F: gl.constexpr = DkdvOptions(
        T=T,
        S=S,
        N=N,
        G=G,
        H=H,
        BM=BM,
        BN=BN,
        STAGES=STAGES,
        QK=QK,
        SOFT_CAP=SOFT_CAP,
        CAP_IN=CAP_IN,
        CAP_OUT=CAP_OUT,
        CAUSAL=CAUSAL,
        WINDOW_LEFT=WINDOW_LEFT,
        WINDOW_RIGHT=WINDOW_RIGHT,
        VARLEN=VARLEN,
        SEQ_IDS=SEQ_IDS,
        HAS_SEG=HAS_SEG,
        TABLE=WINDOW_LEFT >= 0 or VARLEN or HAS_SEG,
        DQ=DQ,
    )
    HALF: gl.constexpr = BN // 2
    K: gl.constexpr = N // G
    pid_n, group = program_tile(order_ptr, (S + BN - 1) // BN, ORDERED, GRID_BLOCK=True)
    b = group // K
    kh = group % K
    if F.TABLE or CAUSAL:  # (without either every program sees every query block)
        first, _, _, end = query_blocks(pid_n, b, ranges_ptr, F)
        if end <= first:  # no query block sees these keys (causal keys past the rows; in
            # context parallelism's all-gather call three programs in four at n = 4):
            # zeros, and nothing else
            store_zero_dkdv((dk_ptr, dv_ptr), b, kh, pid_n, S, K, H, BN, JOINT)
            return
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # q and dO: every (batch, row) by every (head, column), T on whole tiles; k, v, dk, dv:
    # this program's (batch, kv head), zero-filled and clipped past S.
    q_desc = tma.make_tensor_descriptor(q_ptr, [B * T, N * H], [N * H, 1], [BM, H], layout)
    do_desc = tma.make_tensor_descriptor(do_ptr, [B * T, N * H], [N * H, 1], [BM, H], layout)
    k_desc, v_desc = pair_descriptors(k_ptr, v_ptr, b, kh, S, K, H, [HALF, H], layout, KV_PAIR)
    dk_desc, dv_desc = pair_descriptors(dk_ptr, dv_ptr, b, kh, S, K, H, [HALF, H], layout, JOINT)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, H], layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, H], layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, HALF, H], layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, HALF, H], layout)
    kv_ready = barriers(1, 1).index(0)
    ready = barriers(STAGES, 1)
    empty = barriers(STAGES, 2)
    if DQ:  # dSᵀ of both consumers (two step parities), their dq staging tiles
        ds_smem = gl.allocate_shared_memory(dtype, [4, HALF, BM], layout)
        f32: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=32, rank=2
        )
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BM, H // 2], f32)
        dq_desc = tma.make_tensor_descriptor(
            dq_acc_ptr, [B * T, N * H], [N * H, 1], [BM, H // 2], f32
        )
        ds_ready = barriers(2, 2)
        done = barriers(1, 2).index(0)
    else:  # unused
        ds_smem, dq_smem, dq_desc, ds_ready, done = q_smem, q_smem, dk_desc, ready, kv_ready
    hopper.fence_async_shared()  # the barriers' initialisation before TMA signals them
    smem = (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem)
    bars = (kv_ready, ready, empty, ds_ready, done)
    stats = (lse_ptr, delta_ptr)
    tabs = ((qsid_ptr, qpos_ptr, qseg_ptr), (ksid_ptr, kpos_ptr, kseg_ptr), ranges_ptr)
    dest = (dk_desc, dv_desc, dq_desc, SCALE)
    # fmt: off
    gl.warp_specialize(
        [
            (_consumer, (smem, bars, stats, tabs, dest, b, kh, pid_n, F, 0)),
            (_consumer, (smem, bars, stats, tabs, dest, b, kh, pid_n, F, 1)),
            (_producer, ((q_desc, do_desc, k_desc, v_desc), smem, bars, ranges_ptr, b, kh,
                         pid_n, F)),
        ],
        [4, 1],
        [240, 24],
    )
    # fmt: on


class DqOptions(NamedTuple):
    """The compile-time options of one dq launch (built in the kernel, passed as a constexpr)."""

    T: int  # query rows
    S: int  # key rows
    BN: int  # keys per step
    NC: int  # consumer warpgroups of 64 rows: BM // 64 (three without a block table, else two)
    STAGES: int  # slots of the k/v ring
    PIPELINED: bool  # three slots or more: each block's dS·k issued in the next one's step
    PARTIAL: bool  # T not a multiple of BM: the last tile's consumers past T idle
    QK: float  # scale · log2(e)
    SOFT_CAP: float  # 0.0: none
    CAP_IN: float  # scale / soft cap
    CAP_OUT: float  # soft cap · log2(e)
    CAUSAL: bool
    WINDOW_LEFT: int  # -1: no window
    WINDOW_RIGHT: int
    VARLEN: bool  # positions per token (packed sequences, context-parallel blocks)
    SEQ_IDS: bool  # with VARLEN: sequence ids per token too (packed sequences)
    HAS_SEG: bool  # segment ids per (batch, token)
    TABLE: bool  # key ranges from the block table (window, packing, segment ids)


@gluon.jit
def _dq_key_blocks(b, pid_m, row0, ranges_ptr, BM: gl.constexpr, F: gl.constexpr):
    """(first, full_lo, full_hi, end) key blocks of a program of query rows ``pid_m·BM ..``:
    it visits ``[first, end)`` and the rows from ``row0`` on (a consumer's) need no mask in
    ``[full_lo, full_hi)``. From the dq block table (``TABLE``), else causal ones stop at
    the block of its last row's key and need no mask on the blocks wholly before ``row0``
    within the keys; without either every block needs none where the keys end on one."""
    if F.TABLE:
        n_m: gl.constexpr = (F.T + BM - 1) // BM
        table = ranges_ptr + ((b * n_m + pid_m) * 4 if F.HAS_SEG else pid_m * 4)
        first = gl.load(table) // F.BN
        end = gl.cdiv(gl.load(table + 3), F.BN)
        return first, gl.load(table + 1) // F.BN, gl.load(table + 2) // F.BN, end
    if F.CAUSAL:
        end = gl.cdiv(gl.minimum((pid_m + 1) * BM, F.S), F.BN)
        full_hi = gl.maximum(gl.minimum((row0 + 1) // F.BN, gl.minimum(end, F.S // F.BN)), 0)
        return 0, 0, full_hi, end
    end = gl.cdiv(F.S, F.BN)
    return 0, 0, 0 if F.S % F.BN != 0 else end, end


@gluon.jit
def _dq_rows_copy(descs, smem, row_ready, row, c):
    """Copy consumer c's rows of q and dO from ``row`` on."""
    q_desc, do_desc = descs[0], descs[1]
    mbarrier.expect(row_ready.index(c), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row, 0], row_ready.index(c), smem[0].index(c))
    tma.async_copy_global_to_shared(do_desc, [row, 0], row_ready.index(c), smem[1].index(c))


@gluon.jit
def _dq_producer(descs, smem, bars, b, pid_m, ranges_ptr, BM: gl.constexpr, F: gl.constexpr):
    """Copy the program's q and dO (64 rows per consumer), then k and v of each key block."""
    k_desc, v_desc = descs[2], descs[3]
    k_smem, v_smem = smem[2], smem[3]
    row_ready, ready, empty = bars
    ROWS: gl.constexpr = BM // F.NC
    for c in gl.static_range(F.NC):
        row = pid_m * BM + c * ROWS
        if F.PARTIAL:  # no copy for a consumer without rows (`_dq_idle`): none is
            if row < F.T:  # left in flight when the program ends
                _dq_rows_copy(descs, smem, row_ready, row, c)
        else:
            _dq_rows_copy(descs, smem, row_ready, row, c)
    first, _, _, end = _dq_key_blocks(b, pid_m, pid_m * BM, ranges_ptr, BM, F)
    for j in range(first, end):
        s, phase = ring_slot(j - first, F.STAGES)
        mbarrier.wait(empty.index(s), phase ^ 1)  # a slot's first use waits for nothing
        mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [j * F.BN, 0], ready.index(s), k_smem.index(s))
        tma.async_copy_global_to_shared(v_desc, [j * F.BN, 0], ready.index(s), v_smem.index(s))


@gluon.jit
def _dq_step(j, first, dq, ds_prev, ctx, F: gl.constexpr, MASK, PREV: gl.constexpr):
    """dS of key block j (the consumer's ``j - first``-th), 16-bit, laid out as the
    matmul's first operand: ``(dq, ds)``. With ``PREV`` it issues ``dq += dS·k`` of block
    j - 1 (``ds_prev``) after S and dP of block j, so that the tensor cores run it while
    this block's softmax runs, and frees block j - 1's slot when it is done. ``MASK``: the
    call's masks (every one the block may break: keys past the end among them, whose
    zero-filled k would add to dq), a constant or decided per block."""
    smem, bars, q_c, do_c, rows, row_info, lse, delta, zero_s, b, key_tabs = ctx
    _, _, k_smem, v_smem = smem
    _, ready, empty = bars
    s_layout: gl.constexpr = wgmma_layout(F.BN)
    a_layout: gl.constexpr = operand_layout(wgmma_layout(q_c.shape[1]))
    key_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    s, phase = ring_slot(j - first, F.STAGES)
    mbarrier.wait(ready.index(s), phase)
    s_tok = hopper.warpgroup_mma(q_c, k_smem.index(s).permute((1, 0)), zero_s, use_acc=False,
                                 is_async=True)  # fmt: skip
    dp_tok = hopper.warpgroup_mma(
        do_c, v_smem.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True
    )
    if PREV:
        prev, _ = ring_slot(j - 1 - first, F.STAGES)
        dq_tok = hopper.warpgroup_mma(ds_prev, k_smem.index(prev), dq, is_async=True)
        s_ij = hopper.warpgroup_mma_wait(2, deps=[s_tok])
    else:
        s_ij = hopper.warpgroup_mma_wait(1, deps=[s_tok])
    if F.SOFT_CAP > 0.0:  # logits cap·tanh(x / cap); dS takes their slope 1 - tanh²
        t = tanh(s_ij * F.CAP_IN)
        p = gl.exp2(t * F.CAP_OUT - gl.expand_dims(lse, 1)) * (1.0 - t * t)
    else:
        p = gl.exp2(s_ij * F.QK - gl.expand_dims(lse, 1))
    if MASK:
        keys = j * F.BN + gl.arange(0, F.BN, layout=key_layout)
        if F.TABLE:
            key_info = token_info(keys, F.S, b, key_tabs, F, -2)
            p = gl.where(visible(row_info, key_info, 0, F), p, 0.0)
        else:
            if F.CAUSAL:
                p = gl.where(gl.expand_dims(keys, 0) <= gl.expand_dims(rows, 1), p, 0.0)
            if F.S % F.BN != 0:  # keys past the end (zero-filled k) would add to dq
                p = gl.where(gl.expand_dims(keys < F.S, 0), p, 0.0)
    dp = hopper.warpgroup_mma_wait(1 if PREV else 0, deps=[dp_tok])
    ds = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(q_c.dtype), a_layout)
    if PREV:
        dq, _ = hopper.warpgroup_mma_wait(0, deps=[dq_tok, ds_prev])
        mbarrier.arrive(empty.index(prev), count=1)
    return dq, ds


@gluon.jit
def _dq_add(j, first, dq, ds, ctx, F: gl.constexpr):
    """dq += dS·k of key block j (the consumer's ``j - first``-th), and free its slot."""
    smem, bars = ctx[0], ctx[1]
    s, _ = ring_slot(j - first, F.STAGES)
    dq_tok = hopper.warpgroup_mma(ds, smem[2].index(s), dq, is_async=True)
    # (The wait follows at once, so ds needs no keeping: the unpipelined builds without it
    # are the SASS of before the pipelining, the head_dim 64 soft cap's 2680 instructions
    # against 2808 with it; the pipelined ones keep it, as measured.)
    if F.PIPELINED:
        dq, _ = hopper.warpgroup_mma_wait(0, deps=[dq_tok, ds])
    else:
        dq = hopper.warpgroup_mma_wait(0, deps=[dq_tok])
    mbarrier.arrive(bars[2].index(s), count=1)
    return dq


@gluon.jit
def _dq_block(j, first, dq, ds, ctx, F: gl.constexpr, MASK):
    """Key block j: pipelined, its dS and block j - 1's product (`_dq_step`); else its dS
    and its own product."""
    if F.PIPELINED:
        dq, ds = _dq_step(j, first, dq, ds, ctx, F, MASK, True)
    else:
        dq, ds = _dq_step(j, first, dq, ds, ctx, F, MASK, False)
        dq = _dq_add(j, first, dq, ds, ctx, F)
    return dq, ds


@gluon.jit
def _dq_idle(bars, b, pid_m, row0, ranges_ptr, BM: gl.constexpr, F: gl.constexpr):
    """A consumer whose rows all lie past T (the last tile of a T that is not a multiple of
    BM): it passes each key block's slot on once the block has landed, so the ring's
    ``empty`` barriers still count every consumer, and computes nothing."""
    _, ready, empty = bars
    first, _, _, end = _dq_key_blocks(b, pid_m, row0, ranges_ptr, BM, F)
    for j in range(first, end):
        s, phase = ring_slot(j - first, F.STAGES)
        mbarrier.wait(ready.index(s), phase)
        mbarrier.arrive(empty.index(s), count=1)


@gluon.jit
def _dq_consumer(smem, bars, stats, tabs, dest, b, pid_m, BM: gl.constexpr, F: gl.constexpr,
                 C: gl.constexpr):  # fmt: skip
    """dq of rows ``pid_m·BM + C·BM/NC ..`` (consumer C of NC); ``tabs``: the rows' and
    keys' mask tables and the block table. With a partial last tile (T not a multiple of
    BM) a consumer without rows idles (`_dq_idle`)."""
    ROWS: gl.constexpr = BM // F.NC
    row0 = pid_m * BM + C * ROWS
    if F.PARTIAL:
        if row0 < F.T:
            _dq_rows(smem, bars, stats, tabs, dest, b, pid_m, row0, BM, F, C)
        else:
            _dq_idle(bars, b, pid_m, row0, tabs[2], BM, F)
    else:
        _dq_rows(smem, bars, stats, tabs, dest, b, pid_m, row0, BM, F, C)


@gluon.jit
def _dq_rows(smem, bars, stats, tabs, dest, b, pid_m, row0, BM: gl.constexpr, F: gl.constexpr,
             C: gl.constexpr):  # fmt: skip
    """dq of consumer C's rows ``row0 ..`` (`_dq_consumer`)."""
    q_smem, do_smem, _, _ = smem
    row_ready, _, _ = bars
    lse_ptr, delta_ptr = stats
    row_tabs, key_tabs, ranges_ptr = tabs
    dq_desc, scale = dest
    ROWS: gl.constexpr = BM // F.NC
    H: gl.constexpr = q_smem.shape[2]
    s_layout: gl.constexpr = wgmma_layout(F.BN)
    o_layout: gl.constexpr = wgmma_layout(H)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype
    q_c = q_smem.index(C)
    do_c = do_smem.index(C)
    rows = row0 + gl.arange(0, ROWS, layout=row_layout)
    row_info = token_info(rows, F.T, b, row_tabs, F, -1)  # what the masks read per row
    ok = rows < F.T
    # Rows past the end or without mass have P = 0: +inf keeps exp2 at 0.
    lse = gl.load(lse_ptr + rows, mask=ok, other=float("inf")) * _LOG2E
    lse = gl.where(lse == float("-inf"), float("inf"), lse)
    delta = gl.load(delta_ptr + rows, mask=ok, other=0.0)
    dq = gl.zeros([ROWS, H], gl.float32, o_layout)
    zero_s = gl.zeros([ROWS, F.BN], gl.float32, s_layout)
    first, full_lo, full_hi, end = _dq_key_blocks(b, pid_m, row0, ranges_ptr, BM, F)
    mbarrier.wait(row_ready.index(C), 0)
    ctx = (smem, bars, q_c, do_c, rows, row_info, lse, delta, zero_s, b, key_tabs)
    # The blocks that hide no pair of these rows (`_dq_key_blocks`' full range) run without
    # the masks, the blocks before and after them with the masks. Pipelined (three slots:
    # block j - 1's keys stay while block j's land), each step issues the previous block's
    # product (`_dq_step`): the first block's step comes before the loops and issues none,
    # the last block's product comes after them.
    ds = gl.zeros([ROWS, F.BN], dtype, operand_layout(o_layout))  # the previous block's dS
    start = first
    if F.PIPELINED:
        if end > first:
            masked = (first < full_lo) | (first >= full_hi)
            dq, ds = _dq_step(first, first, dq, ds, ctx, F, masked, False)
        start = first + 1
    if F.TABLE and H > 128:  # (three loops spill at head_dim 256: one, masked per block)
        for j in range(start, end):
            dq, ds = _dq_block(j, first, dq, ds, ctx, F, (j < full_lo) | (j >= full_hi))
    else:
        lo, hi = full_lo, full_hi
        if F.TABLE:  # (a table's full range may lie partly outside [first, end))
            lo = gl.minimum(gl.maximum(full_lo, first), end)
            hi = gl.minimum(gl.maximum(full_hi, lo), end)
        for j in range(start, lo):
            dq, ds = _dq_block(j, first, dq, ds, ctx, F, True)
        # (pipelined, the first block ran before the loops; unpipelined, lo and hi are not
        # before start, and the builds keep their SASS of before the pipelining)
        for j in range(gl.maximum(lo, start) if F.PIPELINED else lo, hi):
            dq, ds = _dq_block(j, first, dq, ds, ctx, F, False)
        for j in range(gl.maximum(hi, start) if F.PIPELINED else hi, end):
            dq, ds = _dq_block(j, first, dq, ds, ctx, F, True)
    if F.PIPELINED:
        if end > first:
            dq = _dq_add(end - 1, first, dq, ds, ctx, F)
    q_c.store((dq * scale).to(dtype))  # q's buffer is free now: dq leaves through it
    hopper.fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [row0, 0], q_c)
    tma.store_wait(0)


@gluon.jit
def gluon_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr,
    qsid_ptr, ksid_ptr, qpos_ptr, kpos_ptr, qseg_ptr, kseg_ptr, ranges_ptr, order_ptr,
    dq_ptr, scratch_ptr,
    B: gl.constexpr, T: gl.constexpr, S: gl.constexpr, N: gl.constexpr, G: gl.constexpr,
    H: gl.constexpr, SCALE: gl.constexpr, QK: gl.constexpr, SOFT_CAP: gl.constexpr,
    CAP_IN: gl.constexpr, CAP_OUT: gl.constexpr, CAUSAL: gl.constexpr,
    WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
    SEQ_IDS: gl.constexpr,
    HAS_SEG: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
    ORDERED: gl.constexpr, KV_PAIR: gl.constexpr, INTERPRET: gl.constexpr,
):  # fmt: skip
    """dq [B, T, N, H] from q, dO [B, T, N, H], k, v [B, S, K, H] (``KV_PAIR``: one
    ``[B, S, K, 2H]``, `pair_descriptors`), lse and delta [B, N, T],
    the mask tables and ``ranges_ptr``, the dq block table (``[query blocks, 4]``,
    ``[B, query blocks, 4]`` with segment ids; used with a window, packing or segment ids);
    grid (query blocks of BM, B·N), programs taking their tiles from ``order_ptr`` with
    ``ORDERED`` (`program_tile`), else causal ones heaviest first. BM / 64 consumer
    warpgroups of 64 rows (three, BM = 192, without a block table; else two), a producer
    warp streaming k and v by TMA through a ring of STAGES slots (the forward's schedule, `kernels.gluon._forward`; with three slots or
    more pipelined as the forward is: each block's dS·k issued after the next block's
    q·kᵀ and dO·vᵀ, `_dq_step`); rows and keys past the ends are zero-filled on load,
    clipped on store."""
    NC: gl.constexpr = BM // 64
    F: gl.constexpr = DqOptions(
        T=T, S=S, BN=BN, NC=NC, STAGES=STAGES, PIPELINED=STAGES >= 3, PARTIAL=T % BM != 0,
        QK=QK, SOFT_CAP=SOFT_CAP,
        CAP_IN=CAP_IN, CAP_OUT=CAP_OUT, CAUSAL=CAUSAL, WINDOW_LEFT=WINDOW_LEFT, WINDOW_RIGHT=WINDOW_RIGHT,
        VARLEN=VARLEN, SEQ_IDS=SEQ_IDS, HAS_SEG=HAS_SEG, TABLE=WINDOW_LEFT >= 0 or VARLEN or HAS_SEG,
    )  # fmt: skip
    ROWS: gl.constexpr = BM // NC  # a consumer's
    K: gl.constexpr = N // G
    n_m: gl.constexpr = (T + BM - 1) // BM
    pid, bn = program_tile(order_ptr, n_m, ORDERED)
    pid_m = n_m - 1 - pid if CAUSAL and not ORDERED else pid  # the grid's: heaviest first
    b = (bn // N).to(gl.int64)
    n = bn % N
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_base = b * T * N * H + n * H
    q_desc = tma.make_tensor_descriptor(q_ptr + q_base, [T, H], [N * H, 1], [ROWS, H], layout)
    do_desc = tma.make_tensor_descriptor(do_ptr + q_base, [T, H], [N * H, 1], [ROWS, H], layout)
    dq_desc = tma.make_tensor_descriptor(dq_ptr + q_base, [T, H], [N * H, 1], [ROWS, H], layout)
    k_desc, v_desc = pair_descriptors(k_ptr, v_ptr, b, n // G, S, K, H, [BN, H], layout, KV_PAIR)
    q_smem = gl.allocate_shared_memory(dtype, [NC, ROWS, H], layout)
    do_smem = gl.allocate_shared_memory(dtype, [NC, ROWS, H], layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, H], layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, H], layout)
    row_ready = barriers(NC, 1)
    ready = barriers(STAGES, 1)
    empty = barriers(STAGES, NC)
    hopper.fence_async_shared()  # the barriers' initialisation before TMA signals them
    smem = (q_smem, do_smem, k_smem, v_smem)
    bars = (row_ready, ready, empty)
    stats = (lse_ptr + bn.to(gl.int64) * T, delta_ptr + bn.to(gl.int64) * T)
    tabs = ((qsid_ptr, qpos_ptr, qseg_ptr), (ksid_ptr, kpos_ptr, kseg_ptr), ranges_ptr)
    dest = (dq_desc, SCALE)
    descs = (q_desc, do_desc, k_desc, v_desc)
    # fmt: off
    if NC == 3:  # 160 registers a consumer thread (the default partition 168), as the
        # forward's three consumers: 128 · (168 + 160 + 160 + 24) <= 64 Ki
        gl.warp_specialize(
            [
                (_dq_consumer, (smem, bars, stats, tabs, dest, b, pid_m, BM, F, 0)),
                (_dq_consumer, (smem, bars, stats, tabs, dest, b, pid_m, BM, F, 1)),
                (_dq_consumer, (smem, bars, stats, tabs, dest, b, pid_m, BM, F, 2)),
                (_dq_producer, (descs, smem, bars, b, pid_m, ranges_ptr, BM, F)),
            ],
            [4, 4, 1],
            [160, 160, 24],
        )
    else:
        gl.warp_specialize(
            [
                (_dq_consumer, (smem, bars, stats, tabs, dest, b, pid_m, BM, F, 0)),
                (_dq_consumer, (smem, bars, stats, tabs, dest, b, pid_m, BM, F, 1)),
                (_dq_producer, (descs, smem, bars, b, pid_m, ranges_ptr, BM, F)),
            ],
            [4, 1],
            [240, 24],
        )
    # fmt: on
