"""The Hopper forward written in Gluon (Triton's explicit layer): FlashAttention-3's schedule.

Triton 3.6's automatic warp specialisation cannot overlap a warpgroup's softmax with its
matmuls (docs/performance.md, ejk-kernels-gpu step 9); here the schedule is written out.
One program owns ``BM`` = 128 query rows of one (batch, query head):

- a producer warp copies k and v of every key block into two rings of ``STAGES`` slots
  by TMA, each slot with a ``ready`` barrier (the copy landed) and an ``empty`` one (both
  consumers are done with it), k and v apart, so k of block j is freed before v is;
- two consumer warpgroups own 64 rows each. Per key block j they issue ``q·kⱼᵀ`` and
  ``pⱼ₋₁·vⱼ₋₁`` together, wait for the first, run block j's online softmax while the
  second runs, then wait for it (FlashAttention-3's intra-warpgroup pipeline). Nothing
  is in flight across the loop's back edge: ptxas spills and serialises wgmma
  accumulators that are (C7513).

Calls it takes (`_options.can_run_gluon`): 16-bit inputs, head_dim 128, no mask or causal
alone, no bias, dropout or soft cap, softmax sinks allowed, a positive scale, key length a
multiple of ``BN`` (> 0); any query length (TMA zero-fills the rows past T on load and
clips them on store). Causal programs visit key blocks up to their diagonal only, the
heaviest query blocks first, and mask only the blocks that cross the diagonal.

Gluon kernels do not run in Triton's interpreter: on CPU the ordinary kernels run
instead, and the tests build this one for sm_90 ahead of time (`_aot`).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

_LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _barriers(n: gl.constexpr, count: gl.constexpr):
    """``n`` mbarriers, each completing after ``count`` arrivals."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)
    return bars


@gluon.jit
def _slot(j, STAGES: gl.constexpr):
    """(slot, phase of its ready barrier) of key block j in a ring of STAGES slots."""
    return j % STAGES, (j // STAGES) & 1


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, bars, n_blocks, BN: gl.constexpr,
              STAGES: gl.constexpr):  # fmt: skip
    """Copy k and v of key blocks ``0 .. n_blocks - 1`` into their rings."""
    k_ready, k_empty, v_ready, v_empty = bars
    for j in range(n_blocks):
        s, phase = _slot(j, STAGES)
        phase = phase ^ 1  # a slot's first use waits for nothing
        mbarrier.wait(k_empty.index(s), phase)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [j * BN, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), phase)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [j * BN, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _softmax(s, m_i, l_i, j, row_c, QK: gl.constexpr, BN: gl.constexpr, MASK: gl.constexpr):
    """Online-softmax update for the S tile of key block j: (p, alpha, m, l), in log2 units.

    MASK: the block crosses the causal diagonal (key index > row index is masked). Every
    row sees key 0, so the running max is finite after block 0 (or starts at a sink).
    """
    if MASK:
        rows = row_c + gl.arange(0, s.shape[0], layout=gl.SliceLayout(1, s.type.layout))
        keys = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s.type.layout))
        s = gl.where(gl.expand_dims(keys, 0) <= gl.expand_dims(rows, 1), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * QK)
    p = gl.exp2(s * QK - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _issue_qk(q, k_smem, zero_s):
    """Issue S = q·kᵀ (asynchronous)."""
    return hopper.warpgroup_mma(q, k_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)


@gluon.jit
def _issue_pv(p, alpha, acc, v_smem, layouts: gl.constexpr):
    """Issue acc·alpha + p·v (asynchronous); ``acc`` must be complete."""
    orow_layout, p_layout = layouts
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
    p16 = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    return hopper.warpgroup_mma(p16, v_smem, acc, is_async=True)


@gluon.jit
def _step(j, state, q, zero_s, bufs, row_c, QK: gl.constexpr, BN: gl.constexpr,
          STAGES: gl.constexpr, layouts: gl.constexpr, MASK: gl.constexpr):  # fmt: skip
    """Key block j: issue q·kⱼᵀ and p·v of block j-1, softmax of block j meanwhile."""
    p, alpha, m_i, l_i, acc = state
    k_smem, v_smem, k_ready, k_empty, v_ready, v_empty = bufs
    ks, kph = _slot(j, STAGES)
    vs, vph = _slot(j - 1, STAGES)
    mbarrier.wait(k_ready.index(ks), kph)
    mbarrier.wait(v_ready.index(vs), vph)
    s_tok = _issue_qk(q, k_smem.index(ks), zero_s)
    o_tok = _issue_pv(p, alpha, acc, v_smem.index(vs), layouts)
    s = hopper.warpgroup_mma_wait(1, deps=[s_tok])
    mbarrier.arrive(k_empty.index(ks), count=1)
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, j, row_c, QK, BN, MASK)
    acc = hopper.warpgroup_mma_wait(0, deps=[o_tok])
    mbarrier.arrive(v_empty.index(vs), count=1)
    return p, alpha, m_i, l_i, acc


@gluon.jit
def _consumer(smem, bars, dest, row0, n_blocks, sink, QK: gl.constexpr, HALF: gl.constexpr,
              BN: gl.constexpr, H: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              HAS_SINKS: gl.constexpr, C: gl.constexpr):  # fmt: skip
    """Rows ``row0 + C·HALF ..`` of the program's query block (consumer C of two)."""
    q_all, k_smem, v_smem = smem
    q_bars, kv_bars = bars
    k_ready, k_empty, v_ready, v_empty = kv_bars
    o_desc, lse_ptr, T = dest
    q = q_all.index(C)
    row_c = row0 + C * HALF
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    layouts: gl.constexpr = (
        orow_layout,
        gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2),
    )
    if HAS_SINKS:  # the sink is a key of logit `sink` and no value (mass 1 at m = sink)
        m_i = gl.full([HALF], 0.0, gl.float32, row_layout) + sink
        l_i = gl.full([HALF], 1.0, gl.float32, row_layout)
    else:
        m_i = gl.full([HALF], float("-inf"), gl.float32, row_layout)
        l_i = gl.full([HALF], 0.0, gl.float32, row_layout)
    acc = gl.zeros([HALF, H], gl.float32, o_layout)
    zero_s = gl.zeros([HALF, BN], gl.float32, s_layout)
    # Causal: blocks below n_full lie wholly left of every row's diagonal.
    n_full = gl.minimum((row_c + 1) // BN, n_blocks) if CAUSAL else n_blocks
    mbarrier.wait(q_bars.index(C), 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = hopper.warpgroup_mma_wait(0, deps=[_issue_qk(q, k_smem.index(0), zero_s)])
    mbarrier.arrive(k_empty.index(0), count=1)
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, 0, row_c, QK, BN, CAUSAL)
    state = (p, alpha, m_i, l_i, acc)
    ring = (k_smem, v_smem, k_ready, k_empty, v_ready, v_empty)
    for j in range(1, n_full):
        state = _step(j, state, q, zero_s, ring, row_c, QK, BN, STAGES, layouts, False)
    if CAUSAL:
        for j in range(gl.maximum(n_full, 1), n_blocks):
            state = _step(j, state, q, zero_s, ring, row_c, QK, BN, STAGES, layouts, True)
    p, alpha, m_i, l_i, acc = state
    last, lph = _slot(n_blocks - 1, STAGES)
    mbarrier.wait(v_ready.index(last), lph)
    acc = hopper.warpgroup_mma_wait(0, deps=[_issue_pv(p, alpha, acc, v_smem.index(last), layouts)])
    mbarrier.arrive(v_empty.index(last), count=1)
    out = acc / gl.expand_dims(gl.convert_layout(l_i, orow_layout), 1)
    q.store(out.to(q.dtype))  # q's buffer is free now: o leaves through it
    hopper.fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row_c, 0], q)
    rows = row_c + gl.arange(0, HALF, layout=row_layout)
    gl.store(lse_ptr + rows, (m_i + gl.log2(l_i)) * 0.6931471805599453, mask=rows < T)
    tma.store_wait(0)


@gluon.jit
def gluon_fwd_kernel(
    q_ptr, k_ptr, v_ptr, sinks_ptr, o_ptr, lse_ptr, scratch_ptr,
    T: gl.constexpr, S: gl.constexpr, N: gl.constexpr, G: gl.constexpr, H: gl.constexpr,
    QK: gl.constexpr, CAUSAL: gl.constexpr, HAS_SINKS: gl.constexpr,
    BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, INTERPRET: gl.constexpr,
):  # fmt: skip
    """out [B, T, N, H], lse [B, N, T] (natural log). ``QK`` = softmax scale · log2(e);
    ``scratch_ptr`` holds the TMA descriptors (see _jax_triton_fix); INTERPRET is unused."""
    HALF: gl.constexpr = BM // 2
    K: gl.constexpr = N // G
    n_m = gl.cdiv(T, BM)
    pid_m = n_m - 1 - gl.program_id(0) if CAUSAL else gl.program_id(0)  # heaviest first
    bn = gl.program_id(1)
    b = (bn // N).to(gl.int64)
    n = bn % N
    q_base = b * T * N * H + n * H
    kv_base = b * S * K * H + (n // G) * H
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2
    )
    q_desc = tma.make_tensor_descriptor(q_ptr + q_base, [T, H], [N * H, 1], [HALF, H], smem_layout)
    o_desc = tma.make_tensor_descriptor(o_ptr + q_base, [T, H], [N * H, 1], [HALF, H], smem_layout)
    k_desc = tma.make_tensor_descriptor(k_ptr + kv_base, [S, H], [K * H, 1], [BN, H], smem_layout)
    v_desc = tma.make_tensor_descriptor(v_ptr + kv_base, [S, H], [K * H, 1], [BN, H], smem_layout)
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, H], smem_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, H], smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, H], smem_layout)
    q_bars = _barriers(2, 1)
    # ready: the copy landed (one arrival + bytes); empty: both consumers released the slot.
    kv_bars = (_barriers(STAGES, 1), _barriers(STAGES, 2), _barriers(STAGES, 1),
               _barriers(STAGES, 2))  # fmt: skip
    hopper.fence_async_shared()  # the barriers' initialisation before TMA signals them
    row0 = pid_m * BM
    for i in gl.static_range(2):
        mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            q_desc, [row0 + i * HALF, 0], q_bars.index(i), q_smem.index(i)
        )
    n_blocks = S // BN
    if CAUSAL:  # keys up to the block's last row (top-left aligned)
        n_blocks = gl.minimum(gl.cdiv(row0 + BM, BN), n_blocks)
    sink = gl.load(sinks_ptr + n).to(gl.float32) * _LOG2E if HAS_SINKS else 0.0
    smem = (q_smem, k_smem, v_smem)
    bars = (q_bars, kv_bars)
    dest = (o_desc, lse_ptr + bn.to(gl.int64) * T, T)  # where o and lse go
    # Consumers get 240 registers a thread (the default partition gets what is left: 240),
    # the producer 24: 128 · (240 + 240 + 24) <= 64 Ki. ptxas spills at 232.
    # fmt: off
    gl.warp_specialize(
        [
            (_consumer, (smem, bars, dest, row0, n_blocks, sink, QK, HALF, BN, H, STAGES,
                         CAUSAL, HAS_SINKS, 0)),
            (_consumer, (smem, bars, dest, row0, n_blocks, sink, QK, HALF, BN, H, STAGES,
                         CAUSAL, HAS_SINKS, 1)),
            (_producer, (k_desc, v_desc, k_smem, v_smem, kv_bars, n_blocks, BN, STAGES)),
        ],
        [4, 1],
        [240, 24],
    )
    # fmt: on
