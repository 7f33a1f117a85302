"""Running the kernels from JAX: the backend choice and `launch` (`build._triton`: jax-triton on a GPU,
Triton's interpreter on a CPU), the jax-triton fixes Hopper kernels need (`build._jax_triton_fix`)
and the limits every kernel obeys (`_limits`)."""
