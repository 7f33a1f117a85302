"""Triton flash attention kernels (forward and backward) called from JAX."""

__all__: list[str] = []
