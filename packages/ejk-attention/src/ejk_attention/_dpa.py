"""`dot_product_attention`: ``jax.nn.dot_product_attention``'s signature, ejk's backends.

The arguments map onto `flash_attention`'s: ``is_causal`` -> ``causal``,
``local_window_size`` -> ``sliding_window``, ``scale`` -> ``softmax_scale``, the
sequence lengths -> ``(q_ids, kv_ids)`` segment ids (0 inside the length, -1,
padding, past it), and a boolean ``mask`` -> an additive bias with jax's large negative value,
so masked-out logits behave exactly as in ``jax.nn``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jaxtyping import Bool, Float, Int

from ._flash import flash_attention

__all__ = ["dot_product_attention"]

AnyArray = Array | np.ndarray

# jax.nn's masking value: the float32 maximum, negated (softmax runs in float32).
_LARGE_NEGATIVE = float(-np.finfo(np.float32).max)


def _rank4(x: AnyArray, name: str) -> Array:
    x = jnp.asarray(x)
    if x.ndim > 4:
        raise ValueError(f"{name} must have rank <= 4, got {name}.shape={x.shape}")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _lengths_to_ids(lengths: AnyArray | None, batch: int, size: int, name: str) -> Array:
    """Segment ids ``[B, size]``: 0 before ``lengths[b]``, -1 (padding) from it on."""
    if lengths is None:
        return jnp.zeros((batch, size), jnp.int32)
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(
            f"{name} must be an integer array of shape ({batch},), got shape {lengths.shape} "
            f"dtype {lengths.dtype}"
        )
    return jnp.where(jnp.arange(size)[None, :] < lengths[:, None], 0, -1).astype(jnp.int32)


def _bias_with_mask(
    bias: AnyArray | None, mask: AnyArray | None, batch: int, heads: int, q_len: int, kv_len: int
) -> Array | None:
    """``bias`` and ``mask`` folded into one ``[1|B, 1|N, T, S]`` float32 bias (or None)."""
    if bias is None and mask is None:
        return None
    full = (batch, heads, q_len, kv_len)
    parts = []
    if bias is not None:
        bias = _rank4(bias, "bias")
        parts.append(bias.shape)
    if mask is not None:
        mask = _rank4(mask, "mask")
        if mask.dtype != jnp.bool_:
            raise TypeError(f"mask must be a boolean array, got mask.dtype={mask.dtype}")
        parts.append(mask.shape)
    try:
        np.broadcast_shapes(*parts, full)
    except ValueError:
        raise ValueError(
            f"bias and mask must broadcast to [B, N, T, S]={full}, got shapes {parts}"
        ) from None
    # Batch and head axes stay 1 where every input has 1: the kernels broadcast them.
    keep = (max(p[0] for p in parts), max(p[1] for p in parts), q_len, kv_len)
    out = jnp.zeros(keep, jnp.float32)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    if mask is not None:
        out = jnp.where(mask, out, _LARGE_NEGATIVE)
    return out


def dot_product_attention(
    query: Float[AnyArray, "*B T N H"],
    key: Float[AnyArray, "*B S K H"],
    value: Float[AnyArray, "*B S K H"],
    bias: Float[AnyArray, "*bias_dims"] | None = None,
    mask: Bool[AnyArray, "*mask_dims"] | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Int[AnyArray, " B"] | None = None,
    key_value_seq_lengths: Int[AnyArray, " B"] | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | Sequence[str] | None = None,
    return_residual: bool = False,
) -> Float[Array, "*B T N H"] | tuple[Float[Array, "*B T N H"], Float[Array, "*B T N"]]:
    """A drop-in for ``jax.nn.dot_product_attention`` that runs ejk's backends.

    Args:
        query: ``[B, T, N, H]`` or ``[T, N, H]``.
        key: ``[B, S, K, H]`` or ``[S, K, H]``, ``N % K == 0``.
        value: same shape and dtype as ``key``.
        bias: additive logits bias broadcastable to ``[B, N, T, S]``.
        mask: boolean, True where a logit takes part; broadcastable to ``[B, N, T, S]``.
        scale: logits scale; default ``H ** -0.5``.
        is_causal: query i sees keys ``j <= i``.
        query_seq_lengths: int32 ``[B]``; query rows from the length on output zeros.
        key_value_seq_lengths: int32 ``[B]``; keys from the length on are ignored.
        local_window_size: ``(left, right)`` or ``w`` for ``(w, w)``.
        implementation: None (ejk's choice for the platform), ``"xla"``, ``"cudnn"``, or any
            of ejk's ``"triton"``, ``"pallas"``, or a sequence tried in order.
        return_residual: also return the log-sum-exp ``[B, T, N]`` (in key's dtype, no gradient).

    Returns:
        The attention output shaped like ``query`` (and the residual with ``return_residual``).

    One difference from ``jax.nn``'s xla path, on query rows that no key may see: here
    they output zeros (or, when ``mask`` is what empties them, the average of the values
    causality, window and lengths allow), where ``jax.nn`` averages every value.
    """
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    unbatched = query.ndim == 3
    if unbatched != (key.ndim == 3) or unbatched != (value.ndim == 3):
        raise ValueError(
            f"query, key and value must all be rank 4 or all rank 3, got shapes "
            f"{query.shape}, {key.shape}, {value.shape}"
        )
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    if query.ndim != 4:
        raise ValueError(f"query must be rank 3 or 4, got query.shape={query.shape}")
    batch, q_len, heads, _ = query.shape
    kv_len = key.shape[1] if key.ndim == 4 else 0
    bias = _bias_with_mask(bias, mask, batch, heads, q_len, kv_len)
    segment_ids = None
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        segment_ids = (
            _lengths_to_ids(query_seq_lengths, batch, q_len, "query_seq_lengths"),
            _lengths_to_ids(key_value_seq_lengths, batch, kv_len, "key_value_seq_lengths"),
        )
    result = flash_attention(
        query,
        key,
        value,
        bias,
        softmax_scale=scale,
        causal=is_causal,
        sliding_window=local_window_size,
        segment_ids=segment_ids,
        return_lse=return_residual,
        implementation=implementation,
    )
    if not return_residual:
        return result[0] if unbatched else result
    out, lse = result
    residual = jax.lax.stop_gradient(jnp.swapaxes(lse, 1, 2).astype(key.dtype))
    return (out[0], residual[0]) if unbatched else (out, residual)
