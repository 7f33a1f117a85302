"""Every `@triton.jit` kernel, imported only through `ejk_kernels_gpu._triton.kernels`."""

import triton

from ._forward import fwd_kernel as fwd_kernel

INTERPRET: bool = bool(triton.knobs.runtime.interpret)
