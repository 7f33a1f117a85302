"""A dense boolean mask as an additive bias: ``-inf`` on the keys it hides."""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

__all__ = ["hiding_bias"]


def hiding_bias(bias: Array | None, mask: Array | None, q_len: int, kv_len: int) -> Array | None:
    """One float32 ``[1|B, 1|N, T, S]`` bias: ``bias`` where ``mask`` holds, ``-inf`` (hidden) elsewhere."""
    if bias is None and mask is None:
        return None
    parts = [x.shape for x in (bias, mask) if x is not None]
    # Batch and head axes stay 1 where every input has 1: the kernels broadcast them.
    shape = (max(p[0] for p in parts), max(p[1] for p in parts), q_len, kv_len)
    out = jnp.zeros(shape, jnp.float32)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    if mask is not None:
        out = jnp.where(mask, out, -jnp.inf)
    return out
