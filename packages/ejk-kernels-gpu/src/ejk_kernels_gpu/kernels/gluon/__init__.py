"""The Gluon kernels for Hopper: the warp-specialised forward (`_forward`), the dk/dv and dq
backward (`_backward`, head_dim 256's column split `_backward_wide`), shared parts (`_common`)."""
