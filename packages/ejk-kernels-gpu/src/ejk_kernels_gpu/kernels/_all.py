"""Every kernel (`@triton.jit`, and the Gluon forward and dk/dv kernels), imported only through
`ejk_kernels_gpu.build._triton.kernels` (after the Triton backend, GPU or interpreter, is chosen)."""

import triton

from .gluon._backward import gluon_dkdv_kernel as gluon_dkdv_kernel
from .gluon._backward import gluon_dq_kernel as gluon_dq_kernel
from .gluon._backward_wide import gluon_dkdv_wide_kernel as gluon_dkdv_wide_kernel
from .gluon._forward import gluon_fwd_kernel as gluon_fwd_kernel
from .triton._backward import dkdv_kernel as dkdv_kernel
from .triton._backward import dq_kernel as dq_kernel
from .triton._flex_backward import flex_dkdv_kernel as flex_dkdv_kernel
from .triton._flex_backward import flex_dq_kernel as flex_dq_kernel
from .triton._flex_forward import flex_fwd_kernel as flex_fwd_kernel
from .triton._forward import fwd_kernel as fwd_kernel
from .triton._segment_table import segment_table_kernel as segment_table_kernel

INTERPRET: bool = bool(triton.knobs.runtime.interpret)
