"""The random attention inputs the benchmarks time: one draw shared by every script, so
each contender of a row sees the same arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def attention_inputs(
    b: int, t: int, n: int, k: int, h: int, *, seed: int = 0, dtype=jnp.bfloat16
) -> tuple[
    Float[Array, "B T N H"],
    Float[Array, "B T K H"],
    Float[Array, "B T K H"],
    Float[Array, "B T N H"],
]:
    """Standard-normal ``(q, k, v, d_out)`` of one self-attention shape.

    Args:
        b, t, n, k, h: batch, sequence length, query heads, key/value heads, head dim.
        seed: the draw's PRNG seed.
        dtype: the arrays' dtype (bf16, as the benchmarks time).

    Returns:
        ``q [B, T, N, H]``, ``k`` and ``v [B, T, K, H]``, and the cotangent ``d_out``
        ``[B, T, N, H]`` that the forward+backward timings pull back.
    """
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    kk = jax.random.normal(keys[1], (b, t, k, h), dtype)
    v = jax.random.normal(keys[2], (b, t, k, h), dtype)
    d_out = jax.random.normal(keys[3], (b, t, n, h), dtype)
    return q, kk, v, d_out
