"""Kernel/Invocation/Executor, config selection chain, persistent cache and autotuning for JAX kernels."""

__all__: list[str] = []
