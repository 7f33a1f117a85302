"""FP8 (e4m3) key/value pages: what a quantised page means, and the quantiser.

A serving cache may hold its pages in ``float8_e4m3fn`` (half the bytes of bfloat16)
with float32 scales: ``scales`` ``[P, page_size, K]`` (one per stored token and kv
head) or a scalar (one for the whole pool). The value a page slot holds is
``page.astype(float32) * scale`` (`dequantize_kv`); every paged backend computes with
that value, and `quantize_kv` is the per-token, per-kv-head quantiser a cache uses on
append (scale = amax / 448, the largest finite e4m3 value).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

__all__ = ["FP8_KV_DTYPE", "FP8_KV_MAX", "dequantize_kv", "quantize_kv"]

AnyArray = Array | np.ndarray

#: The dtype of quantised key/value pages.
FP8_KV_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
#: The largest finite ``float8_e4m3fn`` value (448): a token's amax maps to it.
FP8_KV_MAX = float(jnp.finfo(FP8_KV_DTYPE).max)
_INV_FP8_KV_MAX = np.float32(1.0 / FP8_KV_MAX)


def dequantize_kv(pages: Any, scales: Any) -> Float[Array, "*rows H"]:
    """The float32 values of quantised pages: ``pages * scales`` over the head dim.

    Args:
        pages: ``[..., H]`` (``[P, page_size, K, H]`` for a pool, or gathered rows), fp8.
        scales: ``[...]`` (``pages.shape[:-1]``: one per token and kv head) or a scalar.

    Returns:
        float32, ``pages.shape``.
    """
    scales = jnp.asarray(scales, jnp.float32)
    if scales.ndim:
        scales = scales[..., None]
    return jnp.asarray(pages).astype(jnp.float32) * scales


def quantize_kv(
    x: Float[AnyArray, "*rows H"],
) -> tuple[Float[Array, "*rows H"], Float[Array, " *rows"]]:
    """``x`` in ``float8_e4m3fn`` with one float32 scale per row (every axis but the last).

    Each row (a token's head vector of one kv head) is divided by ``amax / 448``, so its
    largest magnitude lands on e4m3's largest finite value and nothing saturates; a row of
    zeros gets scale 1 (its quantised values are 0). ``dequantize_kv(q, scales)`` recovers
    ``x`` within e4m3's rounding: a relative error of at most ``2**-4`` per element, for
    elements in e4m3's normal range (``>= 2**-6 * scale``; smaller ones within
    ``2**-10 * scale``).

    Args:
        x: ``[..., H]``, any floating dtype.

    Returns:
        ``(q, scales)``: ``q`` fp8 ``x.shape``, ``scales`` float32 ``x.shape[:-1]``.
    """
    x = jnp.asarray(x).astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    # amax · (1/448), not amax / 448: jit rewrites a division by a constant into this
    # product, so eager and jitted calls give the same scales bit for bit.
    scales = jnp.where(amax > 0, amax * _INV_FP8_KV_MAX, 1.0)
    return (x / scales[..., None]).astype(FP8_KV_DTYPE), scales
