"""Every kernel (`@triton.jit`, and the Gluon forward and dk/dv kernels), imported only through
`ejk_kernels_gpu._triton.kernels` (after the Triton backend, GPU or interpreter, is chosen)."""

import triton

from ._backward_kernels import dkdv_kernel as dkdv_kernel
from ._backward_kernels import dq_kernel as dq_kernel
from ._forward_kernel import fwd_kernel as fwd_kernel
from ._gluon_backward_kernel import gluon_dkdv_kernel as gluon_dkdv_kernel
from ._gluon_backward_kernel import gluon_dq_kernel as gluon_dq_kernel
from ._gluon_backward_wide import gluon_dkdv_wide_kernel as gluon_dkdv_wide_kernel
from ._gluon_forward_kernel import gluon_fwd_kernel as gluon_fwd_kernel
from ._table_kernel import segment_table_kernel as segment_table_kernel

INTERPRET: bool = bool(triton.knobs.runtime.interpret)
