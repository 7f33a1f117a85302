"""Every kernel (`@triton.jit`, and the Gluon forward), imported only through `ejk_kernels_gpu._triton.kernels`."""

import triton

from ._backward import dkdv_kernel as dkdv_kernel
from ._backward import dq_kernel as dq_kernel
from ._forward import fwd_kernel as fwd_kernel
from ._gluon_forward import gluon_fwd_kernel as gluon_fwd_kernel

INTERPRET: bool = bool(triton.knobs.runtime.interpret)
