"""Helpers the Gluon kernels share (the forward, the dk/dv and the dq kernel)."""

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def barriers(n: gl.constexpr, count: gl.constexpr):
    """``n`` mbarriers, each completing after ``count`` arrivals."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)
    return bars


@gluon.jit
def ring_slot(i, STAGES: gl.constexpr):
    """(slot, phase of its ready barrier) of the i-th tile through a ring of STAGES slots."""
    return i % STAGES, (i // STAGES) & 1


@gluon.jit
def tanh(x):
    """tanh by the MUFU instruction (relative error about 2^-11; FlashAttention-3's soft cap)."""
    return gl.inline_asm_elementwise(
        "tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1
    )


@gluon.constexpr_function
def wgmma_layout(cols):
    """The register layout of one warpgroup's wgmma accumulator with ``cols`` columns."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16]
    )


@gluon.constexpr_function
def operand_layout(acc_layout):
    """The layout of a 16-bit wgmma first operand held in registers, for a matmul whose
    accumulator has ``acc_layout``."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)


@builtin
def reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add the shared-memory tile ``src`` into the global tile of ``tensor_desc`` at
    ``coord`` by a TMA reduce (``cp.reduce.async.bulk.tensor .add``), like
    `tma.async_copy_shared_to_global` (`tma.store_wait` waits for it). Triton 3.6 has the
    operation (``ttng.async_tma_reduce``) but Gluon no function for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
    )
