"""Helpers the Gluon kernels share (the forward and the dk/dv kernel)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
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
