"""The Gluon dk/dv kernel for head_dim 256: the two consumers split the columns.

At head_dim 256 a consumer warpgroup cannot hold dK and dV of its own keys (two float32
``[64, 256]`` tiles are 256 registers a thread). So one program owns ``BN`` = 64 keys
of one (batch, kv head), and consumer C owns columns ``C·128 ..`` of their dK and dV
(128 registers, as at head_dim 128). Per step of ``BM`` = 64 query rows:

- consumer C computes ``Sᵀ`` and ``dPᵀ`` for its half of the rows (``[64 keys, 32 rows]``,
  over all 256 columns: no matmul is done twice), rebuilds ``Pᵀ`` from the saved lse and
  forms ``dSᵀ`` (the masks and soft cap as `kernels.gluon._backward`'s);
- both put their ``Pᵀ`` and ``dSᵀ`` halves into shared memory (FlashAttention-3's
  exchange for this head_dim) and signal an mbarrier; once both halves are in, each
  issues ``dV[:, C] += Pᵀ·dO[:, C]`` and ``dK[:, C] += dSᵀ·q[:, C]`` over the 64 rows.

A producer warp copies k and v once (as two column halves) and q and dO of each visited
query block by TMA into a ring of ``STAGES`` slots, each as four ``[32 rows, 128
columns]`` boxes (a consumer's rows by a column half), so every matmul operand is a whole
buffer, no row slice of a swizzled tile. The query blocks visited and the masks come from
`query_blocks` (the block table with a window, packing or segment ids). dq comes from the
Gluon dq kernel beside it (`kernels.gluon._backward.gluon_dq_kernel` with 32 keys a step,
`flash._select.GLUON_DQ_256`). Keys past the end are zero-filled on load and clipped on
store.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from ._backward import (
    DkdvOptions,
    probabilities,
    program_tile,
    query_blocks,
    store_dkdv,
    store_zero_dkdv,
)
from ._common import barriers, pair_descriptors, ring_slot, token_info, wgmma_layout

_COLS = gl.constexpr(128)  # columns of a half (of head_dim 256)


@gluon.jit
def _producer(descs, smem, bars, ranges_ptr, b, kh, pid_n, F: gl.constexpr):
    """Copy the program's k and v (two column halves), then q and dO of every (head of the
    group, query block), each as four boxes: slot s holds rows half r, columns half h in
    buffer ``4s + 2r + h``."""
    q_desc, do_desc, k_desc, v_desc = descs
    q_smem, do_smem, k_smem, v_smem = smem[:4]
    kv_ready, ready, empty = bars[:3]
    first, _, _, end = query_blocks(pid_n, b, ranges_ptr, F)
    steps = end - first  # (at least one: programs without are done in the kernel)
    mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for h in gl.static_range(2):
        tma.async_copy_global_to_shared(
            k_desc, [pid_n * F.BN, h * _COLS], kv_ready, k_smem.index(h)
        )
        tma.async_copy_global_to_shared(
            v_desc, [pid_n * F.BN, h * _COLS], kv_ready, v_smem.index(h)
        )
    for i in range(F.G * steps):
        n = kh * F.G + i // steps
        m = first + i % steps
        s, phase = ring_slot(i, F.STAGES)
        mbarrier.wait(empty.index(s), phase ^ 1)  # a slot's first use waits for nothing
        mbarrier.expect(
            ready.index(s), 4 * q_desc.block_type.nbytes + 4 * do_desc.block_type.nbytes
        )
        for r in gl.static_range(2):
            row = b * F.T + m * F.BM + r * (F.BM // 2)
            for h in gl.static_range(2):
                col = n * F.H + h * _COLS
                x = 4 * s + 2 * r + h
                tma.async_copy_global_to_shared(q_desc, [row, col], ready.index(s), q_smem.index(x))
                tma.async_copy_global_to_shared(
                    do_desc, [row, col], ready.index(s), do_smem.index(x)
                )


@gluon.jit
def _exchange(p16, ds16, i, x_smem, x_ready, C: gl.constexpr):
    """Put this consumer's ``Pᵀ`` and ``dSᵀ`` halves into buffers ``4·(i % 2) + C`` and
    ``4·(i % 2) + 2 + C`` and wait until the other consumer's are in. A buffer is written
    again two steps later, after the other consumer has signalled the step between, so
    after its matmuls on it ended (each consumer waits for its matmuls before its next
    step)."""
    base = (i % 2) * 4
    x_smem.index(base + C).store(p16)
    x_smem.index(base + 2 + C).store(ds16)
    hopper.fence_async_shared()  # before the other warpgroup's matmuls read them
    gl.thread_barrier()
    mbarrier.arrive(x_ready.index(i % 2), count=1)
    mbarrier.wait(x_ready.index(i % 2), (i // 2) & 1)
    return base


@gluon.jit
def _consumer(smem, bars, stats, tabs, dest, b, kh, pid_n, F: gl.constexpr, C: gl.constexpr):
    """Columns ``C·128 ..`` of dk and dv of the program's keys (consumer C of two), from
    ``Sᵀ`` and ``dPᵀ`` of rows ``C·BM/2 ..`` of each step and the other consumer's."""
    q_smem, do_smem, k_smem, v_smem, x_smem = smem
    kv_ready, ready, empty, x_ready, done = bars
    lse_ptr, delta_ptr = stats
    row_tabs, key_tabs, ranges_ptr = tabs
    R: gl.constexpr = F.BM // 2  # rows of a step this consumer scores
    # Sᵀ and dPᵀ: [keys, R rows]; dK and dV: [keys, 128 columns].
    s_layout: gl.constexpr = wgmma_layout(R)
    o_layout: gl.constexpr = wgmma_layout(_COLS)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype
    dk = gl.zeros([F.BN, _COLS], gl.float32, o_layout)
    dv = gl.zeros([F.BN, _COLS], gl.float32, o_layout)
    zero_s = gl.zeros([F.BN, R], gl.float32, s_layout)
    keys = pid_n * F.BN + gl.arange(0, F.BN, layout=key_layout)
    key_info = token_info(keys, F.S, b, key_tabs, F, -2)  # what the masks read per key
    cols = gl.arange(0, R, layout=col_layout)
    first, full_lo, full_hi, end = query_blocks(pid_n, b, ranges_ptr, F)
    steps = end - first  # (at least one, see `_producer`)
    mbarrier.wait(kv_ready, 0)
    for i in range(F.G * steps):
        n = kh * F.G + i // steps
        m = first + i % steps
        s, phase = ring_slot(i, F.STAGES)
        mbarrier.wait(ready.index(s), phase)
        # Sᵀ = k·qᵀ and dPᵀ = v·dOᵀ of this consumer's rows, over both column halves.
        s_tok = zero_s
        dp_tok = zero_s
        for h in gl.static_range(2):
            q_rows = q_smem.index(4 * s + 2 * C + h).permute((1, 0))
            s_tok = hopper.warpgroup_mma(
                k_smem.index(h), q_rows, s_tok, use_acc=h > 0, is_async=True
            )
        for h in gl.static_range(2):
            do_rows = do_smem.index(4 * s + 2 * C + h).permute((1, 0))
            dp_tok = hopper.warpgroup_mma(
                v_smem.index(h), do_rows, dp_tok, use_acc=h > 0, is_async=True
            )
        row0 = m * F.BM + C * R
        stat = (b * F.N + n).to(gl.int64) * F.T + row0  # lse and delta of these rows
        s_t = hopper.warpgroup_mma_wait(1, deps=[s_tok])
        masks = (keys, key_info, row0, cols, b, row_tabs)
        p, t = probabilities(s_t, lse_ptr + stat, m, (full_lo, full_hi), masks, F)
        p16 = p.to(dtype)
        if F.SOFT_CAP > 0.0:  # dS takes the logits' slope 1 - tanh²
            p = p * (1.0 - t * t)
        dp = hopper.warpgroup_mma_wait(0, deps=[dp_tok])
        delta = gl.load(delta_ptr + stat + cols)
        ds16 = (p * (dp - gl.expand_dims(delta, 0))).to(dtype)
        base = _exchange(p16, ds16, i, x_smem, x_ready, C)
        # dV[:, C] += Pᵀ·dO[:, C] and dK[:, C] += dSᵀ·q[:, C] over both consumers' rows.
        dv_tok = dv
        dk_tok = dk
        for half in gl.static_range(2):
            rows = do_smem.index(4 * s + 2 * half + C)  # consumer half's rows, my columns
            dv_tok = hopper.warpgroup_mma(x_smem.index(base + half), rows, dv_tok, is_async=True)
        for half in gl.static_range(2):
            rows = q_smem.index(4 * s + 2 * half + C)
            dk_tok = hopper.warpgroup_mma(
                x_smem.index(base + 2 + half), rows, dk_tok, is_async=True
            )
        dv = hopper.warpgroup_mma_wait(2, deps=[dv_tok])
        dk = hopper.warpgroup_mma_wait(0, deps=[dk_tok])
        mbarrier.arrive(empty.index(s), count=1)
    # The other consumer's last matmuls read both halves of k and v: wait for them.
    mbarrier.arrive(done, count=1)
    mbarrier.wait(done, 0)
    # k and v are no longer read: dk and dv leave through their buffers.
    bufs = (k_smem.index(C), v_smem.index(C))
    store_dkdv(dk, dv, bufs, dest, [pid_n * F.BN, C * _COLS])


@gluon.jit
def gluon_dkdv_wide_kernel(
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
    """dk, dv [B, S, K, 256] (``JOINT``: side by side, [B, S, K, 512]): the arguments of
    `kernels.gluon._backward.gluon_dkdv_kernel` (``dq_acc_ptr`` unused: ``DQ`` must be
    False); grid (key blocks of BN = 64, B·K)."""
    F: gl.constexpr = DkdvOptions(
        T=T, S=S, N=N, G=G, H=H, BM=BM, BN=BN, STAGES=STAGES, QK=QK, SOFT_CAP=SOFT_CAP,
        CAP_IN=CAP_IN, CAP_OUT=CAP_OUT, CAUSAL=CAUSAL, WINDOW_LEFT=WINDOW_LEFT,
        WINDOW_RIGHT=WINDOW_RIGHT, VARLEN=VARLEN, SEQ_IDS=SEQ_IDS, HAS_SEG=HAS_SEG,
        TABLE=WINDOW_LEFT >= 0 or VARLEN or HAS_SEG, DQ=DQ,
    )  # fmt: skip
    gl.static_assert(H == 2 * _COLS and not DQ, "head_dim 256, dq beside")
    K: gl.constexpr = N // G
    R: gl.constexpr = BM // 2
    pid_n, group = program_tile(order_ptr, (S + BN - 1) // BN, ORDERED)
    b = group // K
    kh = group % K
    if F.TABLE or CAUSAL:  # (without either every program sees every query block)
        first, _, _, end = query_blocks(pid_n, b, ranges_ptr, F)
        if end <= first:  # no query block sees these keys (`gluon_dkdv_kernel`)
            store_zero_dkdv((dk_ptr, dv_ptr), b, kh, pid_n, S, K, H, BN, JOINT)
            return
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # q and dO: every (batch, row) by every (head, column), T on whole tiles; k, v, dk, dv:
    # this program's (batch, kv head), zero-filled and clipped past S. Boxes of 128 columns.
    q_desc = tma.make_tensor_descriptor(q_ptr, [B * T, N * H], [N * H, 1], [R, _COLS], layout)
    do_desc = tma.make_tensor_descriptor(do_ptr, [B * T, N * H], [N * H, 1], [R, _COLS], layout)
    k_desc, v_desc = pair_descriptors(k_ptr, v_ptr, b, kh, S, K, H, [BN, _COLS], layout,
                                      KV_PAIR)  # fmt: skip
    dk_desc, dv_desc = pair_descriptors(dk_ptr, dv_ptr, b, kh, S, K, H, [BN, _COLS], layout,
                                        JOINT)  # fmt: skip
    q_smem = gl.allocate_shared_memory(dtype, [4 * STAGES, R, _COLS], layout)
    do_smem = gl.allocate_shared_memory(dtype, [4 * STAGES, R, _COLS], layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, BN, _COLS], layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, BN, _COLS], layout)
    # Pᵀ and dSᵀ halves of both consumers, two step parities: [keys, R rows] each.
    x_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=2 * R, element_bitwidth=16, rank=2
    )
    x_smem = gl.allocate_shared_memory(dtype, [8, BN, R], x_layout)
    kv_ready = barriers(1, 1).index(0)
    ready = barriers(STAGES, 1)
    empty = barriers(STAGES, 2)
    x_ready = barriers(2, 2)
    done = barriers(1, 2).index(0)
    hopper.fence_async_shared()  # the barriers' initialisation before TMA signals them
    smem = (q_smem, do_smem, k_smem, v_smem, x_smem)
    bars = (kv_ready, ready, empty, x_ready, done)
    stats = (lse_ptr, delta_ptr)
    tabs = ((qsid_ptr, qpos_ptr, qseg_ptr), (ksid_ptr, kpos_ptr, kseg_ptr), ranges_ptr)
    dest = (dk_desc, dv_desc, SCALE)
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
