"""Ahead-of-time sm_90 builds without a GPU: `python -m ejk_kernels_gpu.aot.flash` (the flash
kernels) and `python -m ejk_kernels_gpu.aot.paged` (the paged kernel)."""
