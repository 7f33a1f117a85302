"""`dot_product_attention`: ``jax.nn.dot_product_attention``'s signature and behaviour, ejk's backends.

Values and gradients equal ``jax.nn.dot_product_attention``'s on every backend,
including the rows it treats specially:

- a query row that ``mask``, causality, the window and the key lengths leave with no
  key ("emptied") averages *every* value uniformly (jax.nn's masked logits all equal
  its large negative number, so its softmax is uniform); its gradient reaches only v;
- a query row past ``query_seq_lengths`` outputs zeros with zero gradients;
- the residual is the log-sum-exp of jax.nn's padded logits (``large_negative + log S``
  on those rows), in the key's dtype, without gradient.

``"xla"`` and ``"cudnn"`` are jax.nn itself. ``"triton"`` and ``"pallas"`` run
`flash_attention` with the mask as a ``-inf`` bias (a hidden key) and the lengths as
segment ids, then give emptied rows jax.nn's average. One difference remains, on
purpose: a row whose every visible logit is ``-inf`` (from ``bias``) is NaN in jax.nn
and zeros here.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jaxtyping import Bool, Float, Int

from ejk_sequtils import describe_value, normalize_window, visibility_mask

from ._backends import BACKENDS, default_order, resolve_implementation
from ._bias import hiding_bias
from ._eager import eager_jit
from ._flash import flash_attention

__all__ = ["dot_product_attention"]

AnyArray = Array | np.ndarray

# jax.nn's masking value for float32 logits (softmax runs in float32 for every input dtype).
_LARGE_NEGATIVE = -0.7 * float(np.finfo(np.float32).max)


def _rank4(x: AnyArray, name: str) -> Array:
    x = jnp.asarray(x)
    if x.ndim > 4:
        raise ValueError(f"{name} must have rank <= 4, got {name}.shape={x.shape}")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _lengths(lengths: AnyArray | None, batch: int, name: str) -> Array | None:
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(
            f"{name} must be an integer array of shape ({batch},), got {name}.shape={lengths.shape} "
            f"{name}.dtype={lengths.dtype}"
        )
    return lengths


def _check_inputs(query: Array, key: Array, value: Array, scale: Any) -> None:
    """jax.nn's rules for ``query``/``key``/``value`` and ``scale``, checked before any backend
    runs, so every backend refuses a bad call with the same message in this function's names.

    Like jax.nn there is no dtype promotion: the three share one floating dtype after
    ``jnp.asarray`` (which makes a float64 NumPy array float32 unless x64 is on). Shape and
    dtype errors are ``ValueError``, as jax.nn raises them.
    """
    if query.ndim != 4:
        raise ValueError(f"query must be rank 3 or 4, got query.shape={query.shape}")
    dtypes = f"query.dtype={query.dtype}, key.dtype={key.dtype}, value.dtype={value.dtype}"
    if not jnp.issubdtype(query.dtype, jnp.floating):
        raise ValueError(f"query, key and value must have a floating dtype, got {dtypes}")
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(
            f"query, key and value must share one dtype (as in jax.nn, no promotion: cast "
            f"them first), got {dtypes}"
        )
    if key.shape != value.shape:
        raise ValueError(
            f"key and value must have one shape [B, S, K, H], got key.shape={key.shape}, "
            f"value.shape={value.shape}"
        )
    if query.shape[0] != key.shape[0] or query.shape[3] != key.shape[3]:
        raise ValueError(
            f"query [B, T, N, H] must have key's B and H, got query.shape={query.shape}, "
            f"key.shape={key.shape}"
        )
    if key.shape[2] == 0 or query.shape[2] % key.shape[2] != 0:
        raise ValueError(
            f"query heads N={query.shape[2]} must be a multiple of key heads K={key.shape[2]}"
        )
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be a real number or None, got {describe_value(scale)}")


def _ids(lengths: Array | None, batch: int, size: int) -> Array:
    """Segment ids ``[B, size]``: 0 before ``lengths[b]``, -1 (padding) from it on."""
    if lengths is None:
        return jnp.zeros((batch, size), jnp.int32)
    return jnp.where(jnp.arange(size)[None, :] < lengths[:, None], 0, -1).astype(jnp.int32)


def _masks(bias: Any, mask: Any, batch: int, heads: int, q_len: int, kv_len: int):
    """``bias`` and ``mask`` at rank 4, checked to broadcast to ``[B, N, T, S]``."""
    full = (batch, heads, q_len, kv_len)
    shapes = []
    if bias is not None:
        bias = _rank4(bias, "bias")
        shapes.append(bias.shape)
    if mask is not None:
        mask = _rank4(mask, "mask")
        if mask.dtype != jnp.bool_:
            raise TypeError(f"mask must be a boolean array, got mask.dtype={mask.dtype}")
        shapes.append(mask.shape)
    try:
        np.broadcast_shapes(*shapes, full)
    except ValueError:
        raise ValueError(
            f"bias and mask must broadcast to [B, N, T, S]={full}, got shapes {shapes}"
        ) from None
    return bias, mask


def _jax_nn(implementation: str, query, key, value, bias, mask, kw: dict) -> Any:
    try:
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, implementation=implementation, **kw
        )
    except (ValueError, NotImplementedError, RuntimeError) as err:
        if implementation == "xla":
            raise
        # jax raises these when cuDNN (or its version) cannot take the call.
        raise NotImplementedError(f"cuDNN refused the call: {err}") from err


def _flash(implementation: str, query, key, value, bias, mask, kw: dict) -> Any:
    """`flash_attention` on ``implementation``, with jax.nn's emptied rows and residual."""
    scale = kw["scale"]
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        # jax.nn takes any scale; the kernels a finite one > 0: the next backend serves it.
        raise NotImplementedError(f"{implementation} takes a finite scale > 0, got scale={scale}")
    batch, q_len, heads, _ = query.shape
    kv_len, kv_heads = key.shape[1], key.shape[2]
    q_lens, kv_lens = kw["query_seq_lengths"], kw["key_value_seq_lengths"]
    window = kw["local_window_size"]
    segment_ids = None
    if q_lens is not None or kv_lens is not None:
        segment_ids = (_ids(q_lens, batch, q_len), _ids(kv_lens, batch, kv_len))
    out, lse = flash_attention(
        query,
        key,
        value,
        hiding_bias(bias, mask, q_len, kv_len),
        softmax_scale=kw["scale"],
        causal=bool(kw["is_causal"]),
        sliding_window=window,
        segment_ids=segment_ids,
        return_lse=True,
        implementation=implementation,
    )
    # Rows with a key under every rule (jax.nn's combined mask): [B|1, N|1, T].
    visible = visibility_mask(
        q_len,
        kv_len,
        causal=kw["is_causal"],
        sliding_window=window,
        segment_ids=None if kv_lens is None else (_ids(None, batch, q_len), segment_ids[1]),
    )
    if mask is not None:
        visible = visible & mask
    seen = jnp.any(visible, axis=-1)
    seen = jnp.broadcast_to(seen, (batch, heads, q_len))
    inside = jnp.ones((batch, q_len), bool) if q_lens is None else segment_ids[0] >= 0
    emptied = (~seen) & inside[:, None, :]  # [B, N, T]
    if kv_len > 0:
        mean_v = jnp.mean(value.astype(jnp.float32), axis=1)  # [B, K, H]
        mean_v = jnp.repeat(mean_v, heads // kv_heads, axis=1).astype(out.dtype)  # [B, N, H]
        out = jnp.where(jnp.swapaxes(emptied, 1, 2)[..., None], mean_v[:, None], out)
    if not kw["return_residual"]:
        return out
    if kv_len > 0:
        lse = jnp.where(seen & inside[:, None, :], lse, _LARGE_NEGATIVE + np.log(kv_len))
    residual = jax.lax.stop_gradient(jnp.swapaxes(lse, 1, 2).astype(key.dtype))
    return out, residual


# How `dot_product_attention` runs on a backend, by its ``dot_product`` part (`_backends`).
_ROUTES = {"jax.nn": _jax_nn, "flash": _flash}


def _routes() -> tuple[tuple[str, Any], ...]:
    """Each backend's route, by name (read when called: a test replacing one is seen)."""
    return tuple(
        (name, _ROUTES[backend.dot_product])
        for name, backend in BACKENDS.items()
        if backend.dot_product is not None
    )


def _platform(query: Array) -> str:
    if isinstance(query, jax.Array) and not isinstance(query, jax.core.Tracer):
        return next(iter(query.devices())).platform
    return jax.default_backend()


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
    local_window_size: int | Sequence[int] | None = None,
    implementation: str | Sequence[str] | None = None,
    return_residual: bool = False,
) -> Float[Array, "*B T N H"] | tuple[Float[Array, "*B T N H"], Float[Array, "*B T N"]]:
    """A drop-in for ``jax.nn.dot_product_attention``: its values and gradients, on ejk's backends.

    Args:
        query: ``[B, T, N, H]`` or ``[T, N, H]``; any array-like (``jnp.asarray`` converts
            it, so a float64 NumPy array is float32 unless x64 is on).
        key: ``[B, S, K, H]`` or ``[S, K, H]``, ``N % K == 0``.
        value: same shape as ``key``. After conversion query, key and value share one
            floating dtype: jax.nn's rule, no promotion (ValueError otherwise).
        bias: additive logits bias broadcastable to ``[B, N, T, S]``.
        mask: boolean, True where a logit takes part; broadcastable to ``[B, N, T, S]``.
        scale: logits scale; default ``H ** -0.5``.
        is_causal: query i sees keys ``j <= i``.
        query_seq_lengths: int32 ``[B]``; query rows from the length on output zeros.
        key_value_seq_lengths: int32 ``[B]``; keys from the length on are masked.
        local_window_size: ``(left, right)`` or ``w`` for ``(w, w)``.
        implementation: None (the platform's order: triton, cudnn, xla on GPU; pallas, xla
            on TPU; xla elsewhere), ``"xla"`` or ``"cudnn"`` (jax.nn's own), ``"triton"``,
            ``"pallas"``, or a sequence tried in order (a backend that cannot serve the
            call is skipped with its reason).
        return_residual: also return the log-sum-exp ``[B, T, N]`` (in key's dtype, no gradient).

    Returns:
        The attention output shaped like ``query`` (and the residual with ``return_residual``).
        Emptied rows follow jax.nn (see the module docstring).
    """
    # Concrete arrays: one compiled function per signature instead of op-by-op dispatch.
    return _eager_attention(
        query,
        key,
        value,
        bias,
        mask,
        query_seq_lengths,
        key_value_seq_lengths,
        scale=scale,
        is_causal=is_causal,
        local_window_size=normalize_window(local_window_size, "local_window_size"),
        names=resolve_implementation(implementation),
        return_residual=return_residual,
        backends=_routes(),
    )


def _attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any,
    mask: Any,
    query_seq_lengths: Any,
    key_value_seq_lengths: Any,
    *,
    scale: Any,
    is_causal: Any,
    local_window_size: tuple[int, int] | None,
    names: tuple[str, ...] | None,
    return_residual: bool,
    backends: tuple[tuple[str, Any], ...],
) -> Any:
    """`dot_product_attention` with its window normalized and its implementation names
    resolved; ``backends`` is `_routes()` (a cache key of `_eager_attention`: a
    test replacing one gets a new trace). Checks look at shapes and dtypes only."""
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    unbatched = query.ndim == 3
    if unbatched != (key.ndim == 3) or unbatched != (value.ndim == 3):
        raise ValueError(
            f"query, key and value must all be rank 4 or all rank 3, got shapes "
            f"query.shape={query.shape}, key.shape={key.shape}, value.shape={value.shape}"
        )
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    _check_inputs(query, key, value, scale)
    batch, q_len, heads, _ = query.shape
    kv_len = key.shape[1]
    bias, mask = _masks(bias, mask, batch, heads, q_len, kv_len)
    kw = {
        "scale": scale,
        "is_causal": is_causal,
        "query_seq_lengths": _lengths(query_seq_lengths, batch, "query_seq_lengths"),
        "key_value_seq_lengths": _lengths(key_value_seq_lengths, batch, "key_value_seq_lengths"),
        "local_window_size": local_window_size,
        "return_residual": return_residual,
    }
    names = names or default_order(_platform(query))
    backends = dict(backends)
    reasons = []
    for name in names:
        if name not in backends:
            reasons.append(f"{name}: it runs no dot_product_attention")
            continue
        try:
            result = backends[name](name, query, key, value, bias, mask, kw)
            break
        except NotImplementedError as err:
            reasons.append(f"{name}: {err}")
    else:
        raise NotImplementedError(
            "no implementation could serve this dot_product_attention call; " + "; ".join(reasons)
        )
    if not unbatched:
        return result
    return (result[0][0], result[1][0]) if return_residual else result[0]


_eager_attention = eager_jit(
    _attention,
    ("scale", "is_causal", "local_window_size", "names", "return_residual", "backends"),
)
