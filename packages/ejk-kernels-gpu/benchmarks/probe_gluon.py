"""Probe: an attention forward written in Gluon (Triton's explicit layer), against ejk and cuDNN.

Triton 3.6's automatic warp specialisation cannot overlap a warpgroup's softmax with its
next q·kᵀ (docs/performance.md, ejk-kernels-gpu, "Against the targets"). Gluon
(``triton.experimental.gluon``, shipped with Triton 3.6) states the schedule by hand:
one producer warp issues the TMA copies of k and v into a two-stage ring (mbarriers
``ready``/``empty``), two consumer warpgroups each own 64 of the block's 128 query rows.
``MODE`` picks the consumers' schedule (see `_consumer`): 0 each block in order (what
Triton's automatic specialisation builds), 1 the next block's q·kᵀ issued before this
block's softmax, 2 also p·v left running into the next block (FlashAttention-3's
intra-warpgroup pipeline).
Plain forward only: no mask, MHA, bf16, [B, T, N, H] with T a multiple of 128.

jax-triton 0.3.1 compiles kernels through the Triton front end only, so `install_gluon`
gives its kernel cache a path for Gluon kernels (compiled by ``triton.compile`` from a
``GluonASTSource``; the global-scratch and thread-count fixes of `_launch_fix` apply).

Usage (GPU machine, after ``source scripts/gpu/setup.sh``):
    python3 packages/ejk-kernels-gpu/benchmarks/probe_gluon.py [--rounds 9]
Built for sm_90 on the CPU (``--aot``): 384 threads, 168 registers, no spills. On an H100
(docs/performance.md, ejk-kernels-gpu step 9) both variants match the f32 reference
(relative error 2.2e-3); MODE 0 runs at 479 TFLOP/s, MODE 1 at 394. MODE 2 is built for
sm_90 only, not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import statistics
import tempfile

import jax
import jax.numpy as jnp
import triton
from bench_flash import _rounds  # this folder (run as a script)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from ejk_kernels_gpu import _launch_fix, flash_attention


@gluon.jit
def _producer(
    k_desc, v_desc, k_smem, v_smem, ready, empty, n_blocks, BN: gl.constexpr, STAGES: gl.constexpr
):
    for j in range(n_blocks):
        s = j % STAGES
        # wait until both consumers released this stage (first pass: phase trick)
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [j * BN, 0], ready.index(s), k_smem.index(s))
        tma.async_copy_global_to_shared(v_desc, [j * BN, 0], ready.index(s), v_smem.index(s))


@gluon.jit
def _softmax(s, m_i, l_i, QK: gl.constexpr):
    """Online-softmax update for one S tile: (p, alpha, m, l)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * QK)
    p = gl.exp2(s * QK - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _qk(q, k_smem, zero_s):
    """Issue S = q·kᵀ (asynchronous; wait with warpgroup_mma_wait)."""
    return hopper.warpgroup_mma(q, k_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)


@gluon.jit
def _pv(p, alpha, acc, v_smem, orow_layout: gl.constexpr, p_layout: gl.constexpr):
    """Issue acc·alpha + p·v (asynchronous); ``acc`` must be complete."""
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
    p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    return hopper.warpgroup_mma(p16, v_smem, acc, is_async=True)


@gluon.jit
def _pipelined_step(s, m_i, l_i, o_tok, j, v_smem, empty, QK: gl.constexpr,
                    STAGES: gl.constexpr, orow_layout: gl.constexpr,
                    p_layout: gl.constexpr):  # fmt: skip
    """MODE 2, block j: softmax of its S while p·v of block j-1 (``o_tok``) may still run;
    then finish that p·v, free its stage, and issue this block's p·v."""
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, QK)
    acc = hopper.warpgroup_mma_wait(1, deps=[o_tok])  # p·v of block j-1 (older than q·kᵀ)
    prev = j - 1 + STAGES
    mbarrier.arrive(empty.index(prev % STAGES), count=1, pred=j > 0)
    o_tok = _pv(p, alpha, acc, v_smem.index(j % STAGES), orow_layout, p_layout)
    return m_i, l_i, o_tok


@gluon.jit
def _consumer(
    bufs,
    row0,
    n_blocks,
    QK: gl.constexpr,
    HALF: gl.constexpr,
    BN: gl.constexpr,
    H: gl.constexpr,
    STAGES: gl.constexpr,
    MODE: gl.constexpr,
    C: gl.constexpr,
):
    """MODE 0: each block in order (q·kᵀ, wait, softmax, p·v, wait). 1: the next block's
    q·kᵀ is issued before this block's softmax, p·v waited at once. 2: besides, p·v is
    waited only at the next block's rescale (FlashAttention-3's intra-warpgroup pipeline;
    the last block runs after the loop)."""
    q_all, k_smem, v_smem, q_bars, ready, empty, o_desc = bufs
    q_smem = q_all.index(C)
    q_bar = q_bars.index(C)
    row0 = row0 + C * HALF
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    mbarrier.wait(q_bar, 0)
    q = q_smem
    m_i = gl.full([HALF], float("-inf"), gl.float32, row_layout)
    l_i = gl.full([HALF], 0.0, gl.float32, row_layout)
    acc = gl.zeros([HALF, H], gl.float32, o_layout)
    zero_s = gl.zeros([HALF, BN], gl.float32, s_layout)
    if MODE == 0:
        for j in range(n_blocks):
            st = j % STAGES
            mbarrier.wait(ready.index(st), (j // STAGES) & 1)
            s = hopper.warpgroup_mma_wait(0, deps=[_qk(q, k_smem.index(st), zero_s)])
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, QK)
            o_tok = _pv(p, alpha, acc, v_smem.index(st), orow_layout, p_layout)
            acc = hopper.warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(empty.index(st), count=1)
    else:
        mbarrier.wait(ready.index(0), 0)
        s = hopper.warpgroup_mma_wait(0, deps=[_qk(q, k_smem.index(0), zero_s)])
        if MODE == 1:
            for j in range(n_blocks):
                st = j % STAGES
                nxt = j + 1
                nst = nxt % STAGES
                # The last block issues one q·kᵀ more (on a stage nobody writes any more).
                mbarrier.wait(ready.index(nst), (nxt // STAGES) & 1, pred=nxt < n_blocks)
                s_next_tok = _qk(q, k_smem.index(nst), zero_s)
                p, alpha, m_i, l_i = _softmax(s, m_i, l_i, QK)
                o_tok = _pv(p, alpha, acc, v_smem.index(st), orow_layout, p_layout)
                s = hopper.warpgroup_mma_wait(1, deps=[s_next_tok])
                acc = hopper.warpgroup_mma_wait(0, deps=[o_tok])
                mbarrier.arrive(empty.index(st), count=1)
        else:
            o_tok = hopper.warpgroup_mma_init(acc)
            for j in range(n_blocks - 1):
                nxt = j + 1
                nst = nxt % STAGES
                mbarrier.wait(ready.index(nst), (nxt // STAGES) & 1)
                s_next_tok = _qk(q, k_smem.index(nst), zero_s)
                m_i, l_i, o_tok = _pipelined_step(s, m_i, l_i, o_tok, j, v_smem, empty, QK,
                                                  STAGES, orow_layout, p_layout)  # fmt: skip
                s = hopper.warpgroup_mma_wait(1, deps=[s_next_tok])
            last = n_blocks - 1
            m_i, l_i, o_tok = _pipelined_step(s, m_i, l_i, o_tok, last, v_smem, empty, QK,
                                              STAGES, orow_layout, p_layout)  # fmt: skip
            acc = hopper.warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(empty.index(last % STAGES), count=1)
    out = acc / gl.expand_dims(gl.convert_layout(l_i, orow_layout), 1)
    o_smem = gl.allocate_shared_memory(gl.bfloat16, [HALF, H], o_desc.layout, out.to(gl.bfloat16))
    hopper.fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row0, 0], o_smem)
    tma.store_wait(0)


@gluon.jit
def gl_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    scratch_ptr,
    T: gl.constexpr,
    N: gl.constexpr,
    H: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    QK: gl.constexpr,
    STAGES: gl.constexpr,
    MODE: gl.constexpr,
):
    HALF: gl.constexpr = BM // 2
    pid_m = gl.program_id(0)
    bn = gl.program_id(1)
    b = (bn // N).to(gl.int64)
    n = bn % N
    base = b * T * N * H + n * H
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2
    )
    q_desc = tma.make_tensor_descriptor(q_ptr + base, [T, H], [N * H, 1], [HALF, H], smem_layout)
    o_desc = tma.make_tensor_descriptor(o_ptr + base, [T, H], [N * H, 1], [HALF, H], smem_layout)
    k_desc = tma.make_tensor_descriptor(k_ptr + base, [T, H], [N * H, 1], [BN, H], smem_layout)
    v_desc = tma.make_tensor_descriptor(v_ptr + base, [T, H], [N * H, 1], [BN, H], smem_layout)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, HALF, H], smem_layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, H], smem_layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, H], smem_layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    hopper.fence_async_shared()  # the barriers' initialisation before TMA signals them
    row0 = pid_m * BM
    for i in gl.static_range(2):
        mbarrier.expect(q_bar.index(i), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            q_desc, [row0 + i * HALF, 0], q_bar.index(i), q_smem.index(i)
        )
    n_blocks = T // BN
    # The two consumers differ only in their half of the query block (C).
    bufs = (q_smem, k_smem, v_smem, q_bar, ready, empty, o_desc)
    gl.warp_specialize(
        [
            (_consumer, (bufs, row0, n_blocks, QK, HALF, BN, H, STAGES, MODE, 0)),
            (_consumer, (bufs, row0, n_blocks, QK, HALF, BN, H, STAGES, MODE, 1)),
            (_producer, (k_desc, v_desc, k_smem, v_smem, ready, empty, n_blocks, BN, STAGES)),
        ],
        [4, 1],
        [232, 40],
    )


def _signature(arg_names, arg_dtypes, metaparams):
    signature = dict(zip(arg_names[: len(arg_dtypes)], arg_dtypes, strict=True))
    signature.update({name: "constexpr" for name in metaparams})
    attrs = {(i,): [["tt.divisibility", 16]] for i, d in enumerate(arg_dtypes) if d[0] == "*"}
    return signature, attrs


def compile_gluon(fn, arg_dtypes, metaparams, num_warps, capability=90):
    """``triton.compile`` of a Gluon kernel for ``sm_<capability>``."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature, attrs = _signature(fn.arg_names, arg_dtypes, metaparams)
    source = GluonASTSource(fn, signature, dict(metaparams), attrs)
    target = GPUTarget("cuda", capability, 32)
    if not triton.knobs.cache.dir:  # jax-triton empties TRITON_CACHE_DIR when it imports
        triton.knobs.cache.dir = os.path.join(tempfile.gettempdir(), "ejk-gluon-cache")
    return triton.compile(source, target=target, options=dict(num_warps=num_warps)), attrs


@functools.cache
def install_gluon() -> None:
    """Let jax-triton's `triton_call` run Gluon kernels (see the module docstring)."""
    from jax_triton import triton_lib

    _launch_fix.install()
    _launch_fix.SCRATCH_KERNELS.add("gl_fwd_kernel")
    original = triton_lib.get_or_create_triton_kernel
    cache = {}

    def get_or_create(backend_init_func, platform, fn, arg_dtypes, scalar_args, **kw):
        if not getattr(fn, "is_gluon", lambda: False)():
            return original(backend_init_func, platform, fn, arg_dtypes, scalar_args, **kw)
        metaparams = kw["metaparams"]
        key = (fn, tuple(arg_dtypes), tuple(sorted(metaparams.items())), kw["num_warps"])
        if key not in cache:
            cc = kw["compute_capability"] or 90
            compiled, attrs = compile_gluon(fn, arg_dtypes, metaparams, kw["num_warps"], cc)
            name = compiled.metadata.name
            ptx = _launch_fix.redirect_scratch(compiled.asm["ptx"], name)
            kernel = triton_lib.triton_kernel_call_lib.TritonKernel(
                name, kw["num_warps"], kw["num_ctas"], compiled.metadata.shared, ptx, "", cc
            )
            cache[key] = (kernel, attrs)
        return cache[key]

    triton_lib.get_or_create_triton_kernel = get_or_create


MODES = (0, 1, 2)


def gluon_attention(q, k, v, mode=0):
    import jax_triton as jt

    install_gluon()
    B, T, N, H = q.shape
    grid = (T // 128, B * N)
    out, _ = jt.triton_call(
        q, k, v, kernel=gl_fwd_kernel, grid=grid, num_warps=4,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((_launch_fix.scratch_bytes(grid),), jnp.uint8)],
        T=T, N=N, H=H, BM=128, BN=128, QK=H**-0.5 * math.log2(math.e), STAGES=2,
        MODE=mode,
    )  # fmt: skip
    return out


def _aot() -> None:
    """Build every MODE for sm_90 here (no GPU) and print its resources."""
    dtypes = ["*bf16"] * 4 + ["*u8"]
    meta = dict(T=4096, N=32, H=128, BM=128, BN=128, QK=0.1275, STAGES=2)
    for mode in MODES:
        compiled, _ = compile_gluon(gl_fwd_kernel, dtypes, dict(meta, MODE=mode), 4)
        ptx = compiled.asm["ptx"]
        threads = re.findall(r"\.reqntid (\d+)", ptx)
        print(json.dumps(dict(mode=mode, shared=compiled.metadata.shared, threads=threads,
                              wgmma=ptx.count("wgmma.mma_async"))))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--aot", action="store_true", help="build for sm_90 only (no GPU)")
    args = parser.parse_args()
    if args.aot:
        return _aot()
    from ejk_attention import reference_attention

    print("#", jax.devices(), jax.__version__, triton.__version__)
    f32 = lambda x: x.astype(jnp.float32)
    for B, T, N in ((1, 1024, 4), (2, 2048, 8)):  # against the f32 reference
        keys = jax.random.split(jax.random.key(T), 3)
        q, k, v = (jax.random.normal(key, (B, T, N, 128), jnp.bfloat16) for key in keys)
        ref = reference_attention(f32(q), f32(k), f32(v))
        for mode in MODES:
            got = f32(jax.jit(functools.partial(gluon_attention, mode=mode))(q, k, v))
            err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
            print(json.dumps(dict(check=(B, T, N), mode=mode, rel_err=err,
                                  nan=bool(jnp.any(jnp.isnan(got))))))  # fmt: skip
    B, T, N, H = 4, 4096, 32, 128
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (B, T, N, H), jnp.bfloat16) for key in keys)
    impls = {
        "ejk": jax.jit(lambda q, k, v: flash_attention(q, k, v)),
        "cudnn": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")),
        **{f"gluon MODE {m}": jax.jit(functools.partial(gluon_attention, mode=m)) for m in MODES},
    }  # fmt: skip
    for fn in impls.values():
        jax.block_until_ready(fn(q, k, v))
    per = {name: [] for name in impls}
    for _ in range(args.rounds):  # interleaved, as bench_flash.bench_shape
        for name, fn in impls.items():
            per[name].append(_rounds(fn, q, k, v))
    flops = 4 * B * N * T * T * H
    for name, times in per.items():
        med, best = statistics.median(times), min(times)
        print(json.dumps(dict(impl=name, shape=(B, T, N, H), ms=med * 1e3, best_ms=best * 1e3,
                              tflops=flops / med * 1e-12)))  # fmt: skip


if __name__ == "__main__":
    main()
