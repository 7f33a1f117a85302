"""Packed sequences, cu_seqlens, segment ids and attention masks for JAX (jax + numpy only)."""

__all__: list[str] = []
