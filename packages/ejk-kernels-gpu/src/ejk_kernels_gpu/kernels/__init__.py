"""Every Triton (`triton/`) and Gluon (`gluon/`) kernel. Nothing here is imported before the
backend is chosen: `build._triton.kernels` imports `_all` once the interpreter switch is set."""
