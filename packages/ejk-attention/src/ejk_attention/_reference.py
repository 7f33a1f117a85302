"""The XLA reference: attention in plain jnp, every feature, computed in float32.

It is the `xla` backend of the facade and the oracle every ejk package tests
against, so it favours clarity over speed: it materialises the full
``[B, N, T, S]`` score matrix. Gradients come from JAX's autodiff and stay
finite on fully masked rows (see ``_masked_softmax``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Integer

__all__ = ["dropout_keep_mask", "reference_attention", "visibility_mask"]

# Public functions take jax or NumPy arrays alike.
AnyArray = Array | np.ndarray

_GOLDEN = 0x9E3779B1
_MUR1 = 0x85EBCA6B
_MUR2 = 0xC2B2AE35


def _mix(h: Array, x: Array) -> Array:
    """One round of the dropout counter hash (uint32, wrapping arithmetic)."""
    h = h ^ (x * jnp.uint32(_GOLDEN))
    h = (h ^ (h >> 16)) * jnp.uint32(_MUR1)
    h = (h ^ (h >> 13)) * jnp.uint32(_MUR2)
    return h ^ (h >> 16)


def _seed_u32(seed: int | ArrayLike) -> Array:
    if isinstance(seed, int):
        return jnp.uint32(seed & 0xFFFFFFFF)
    seed = jnp.asarray(seed)
    if seed.shape != ():
        raise ValueError(f"dropout_seed must be a scalar, got shape {seed.shape}")
    if seed.dtype == jnp.uint32:
        return seed
    if seed.dtype == jnp.int32:
        return jax.lax.bitcast_convert_type(seed, jnp.uint32)
    raise TypeError(f"dropout_seed must be an int or a uint32/int32 scalar, got dtype {seed.dtype}")


def dropout_threshold(rate: float) -> int:
    """The 24-bit threshold under which a hashed element is dropped."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {rate=}")
    return round(rate * (1 << 24))


def dropout_keep_mask(
    seed: int | ArrayLike, batch: int, heads: int, q_len: int, kv_len: int, rate: float
) -> Bool[Array, "B N T S"]:
    """The dropout keep-mask every ejk backend uses, from a counter-based hash.

    ``h = mix(mix(mix(mix(seed, b), n), i), j)`` over uint32 with wrap-around, where
    ``mix(h, x) = fmix32(h ^ (x * 0x9E3779B1))`` (MurmurHash3's finaliser), ``b`` the
    batch index, ``n`` the query head, ``i`` the query row and ``j`` the key column.
    An element is kept when ``(h >> 8) >= round(rate * 2**24)``.

    Args:
        seed: a Python int or a uint32/int32 scalar array.
        batch, heads, q_len, kv_len: the shape ``[B, N, T, S]`` of the mask.
        rate: the dropout probability in ``[0, 1)``.

    Returns:
        bool ``[B, N, T, S]``, True where the probability is kept.
    """
    threshold = dropout_threshold(rate)
    shape = (batch, heads, q_len, kv_len)
    b, n, i, j = (jax.lax.broadcasted_iota(jnp.uint32, shape, d) for d in range(4))
    h = _mix(_mix(_mix(_mix(_seed_u32(seed), b), n), i), j)
    return (h >> 8) >= jnp.uint32(threshold)


def _window(sliding_window: int | Sequence[int] | None) -> tuple[int, int] | None:
    if sliding_window is None:
        return None
    if isinstance(sliding_window, int):
        left = right = sliding_window
    else:
        if len(sliding_window) != 2:
            raise ValueError(
                f"sliding_window must be an int or (left, right), got {sliding_window!r}"
            )
        left, right = sliding_window
    if not (isinstance(left, int) and isinstance(right, int)) or left < 0 or right < 0:
        raise ValueError(f"sliding_window sizes must be ints >= 0, got {sliding_window!r}")
    return left, right


def _sequence_of(cu_seqlens: Int[AnyArray, " L"], length: int) -> tuple[Array, Array]:
    """(sequence index, position inside it) of each of ``length`` packed tokens.

    Tokens past the last offset get sequence index ``num_seqs`` (padding).
    Empty sequences own no token, so ``searchsorted`` skips them.
    """
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    idx = jnp.arange(length, dtype=jnp.int32)
    seq = jnp.searchsorted(cu, idx, side="right").astype(jnp.int32) - 1
    num_seqs = cu.shape[0] - 1
    seq = jnp.where(idx >= cu[-1], num_seqs, seq)
    local = idx - cu[jnp.clip(seq, 0, num_seqs)]
    return seq, local


def visibility_mask(
    q_len: int,
    kv_len: int,
    *,
    causal: bool = False,
    sliding_window: int | Sequence[int] | None = None,
    segment_ids: Int[AnyArray, "B T"]
    | tuple[Int[AnyArray, "B T"], Int[AnyArray, "B S"]]
    | None = None,
    cu_seqlens_q: Int[AnyArray, " L"] | None = None,
    cu_seqlens_k: Int[AnyArray, " L"] | None = None,
) -> Bool[Array, "#B 1 T S"]:
    """Which keys each query sees, as the reference (and every backend) defines it.

    Returns:
        bool ``[B or 1, 1, T, S]``.
    """
    window = _window(sliding_window)
    q_pos = jnp.arange(q_len, dtype=jnp.int32)
    k_pos = jnp.arange(kv_len, dtype=jnp.int32)
    visible = jnp.ones((q_len, kv_len), bool)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if cu_seqlens_q is None:
            raise ValueError("cu_seqlens_k was given without cu_seqlens_q")
        cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
        if jnp.shape(cu_k) != jnp.shape(cu_seqlens_q):
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must have the same shape, got "
                f"{jnp.shape(cu_seqlens_q)} and {jnp.shape(cu_k)}"
            )
        q_seq, q_pos = _sequence_of(cu_seqlens_q, q_len)
        k_seq, k_pos = _sequence_of(cu_k, kv_len)
        num_seqs = jnp.shape(cu_seqlens_q)[0] - 1
        visible = (q_seq[:, None] == k_seq[None, :]) & (q_seq[:, None] < num_seqs)
    di = q_pos[:, None]
    dj = k_pos[None, :]
    if causal:
        visible &= dj <= di
    if window is not None:
        left, right = window
        visible &= (dj >= di - left) & (dj <= di + right)
    visible = visible[None, None]
    if segment_ids is not None:
        if isinstance(segment_ids, tuple | list):
            q_ids, kv_ids = segment_ids
        else:
            q_ids = kv_ids = segment_ids
        q_ids, kv_ids = jnp.asarray(q_ids), jnp.asarray(kv_ids)
        if q_ids.ndim != 2 or q_ids.shape[1] != q_len:
            raise ValueError(f"q segment_ids must be [B, {q_len}], got shape {q_ids.shape}")
        if kv_ids.ndim != 2 or kv_ids.shape[1] != kv_len:
            raise ValueError(f"kv segment_ids must be [B, {kv_len}], got shape {kv_ids.shape}")
        same = (q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids[:, :, None] > 0)
        visible = visible & (same & (kv_ids[:, None, :] > 0))[:, None]
    return visible


def _masked_softmax(
    logits: Float[Array, "B N T S"], visible: Bool[Array, "#B 1 T S"], sinks: Array | None
) -> tuple[Float[Array, "B N T S"], Float[Array, "B N T"]]:
    """Softmax over visible keys (and the sink), its log-normaliser, NaN-free.

    Masked logits become -inf before the max and the exp, so no masked value can
    overflow (a ``where`` after ``exp`` would pass ``0 * inf = NaN`` to the gradient).
    The running max is a constant for autodiff: the result does not depend on it.
    """
    s = jnp.where(visible, logits, -jnp.inf)
    m = jnp.max(s, axis=-1)
    if sinks is not None:
        m = jnp.maximum(m, sinks[None, :, None])
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.exp(s - m[..., None])
    denom = jnp.sum(e, axis=-1)
    if sinks is not None:
        denom = denom + jnp.exp(sinks[None, :, None] - m)
    has_mass = denom > 0
    safe = jnp.where(has_mass, denom, 1.0)
    lse = jnp.where(has_mass, m + jnp.log(safe), -jnp.inf)
    return e / safe[..., None], lse


def reference_attention(
    q: Float[AnyArray, "B T N H"],
    k: Float[AnyArray, "B S K H"],
    v: Float[AnyArray, "B S K Hv"],
    bias: Float[AnyArray, "#B #N T S"] | None = None,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | Sequence[int] | None = None,
    logits_soft_cap: float | None = None,
    softmax_sinks: Float[AnyArray, " N"] | None = None,
    segment_ids: Int[AnyArray, "B T"]
    | tuple[Int[AnyArray, "B T"], Int[AnyArray, "B S"]]
    | None = None,
    cu_seqlens_q: Int[AnyArray, " L"] | None = None,
    cu_seqlens_k: Int[AnyArray, " L"] | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: int | Integer[ArrayLike, ""] | None = None,
    return_lse: bool = False,
) -> Float[Array, "B T N Hv"] | tuple[Float[Array, "B T N Hv"], Float[Array, "B N T"]]:
    """Multi-head attention in float32 jnp, the definition every ejk backend matches.

    Args:
        q: queries ``[B, T, N, H]``.
        k: keys ``[B, S, K, H]`` with ``N % K == 0``; query head n reads kv head ``n // (N // K)``.
        v: values ``[B, S, K, Hv]``.
        bias: additive logits bias broadcastable from ``[1|B, 1|N, T, S]``.
        softmax_scale: multiplies ``q·kᵀ``; default ``H ** -0.5``.
        causal: query i sees keys ``j <= i`` (top-left aligned, positions local to a packed sequence).
        sliding_window: ``(left, right)`` or ``w`` for ``(w, w)``: keys in ``[i - left, i + right]``.
        logits_soft_cap: ``cap * tanh(logits / cap)`` with ``logits = scale * q·kᵀ + bias``.
        softmax_sinks: ``[N]`` one logit per query head in the softmax denominator only.
        segment_ids: ``[B, T]`` (self attention) or ``(q_ids [B, T], kv_ids [B, S])``; ids <= 0 are padding.
        cu_seqlens_q: ``[num_seqs + 1]`` query offsets of packed sequences (needs B == 1).
        cu_seqlens_k: key offsets; defaults to ``cu_seqlens_q``.
        dropout_rate: probability of dropping a normalised attention weight.
        dropout_seed: seed of the counter-based keep mask (see `dropout_keep_mask`).
        return_lse: also return the float32 log-sum-exp of each row.

    Returns:
        ``out [B, T, N, Hv]`` in ``q.dtype``, and with ``return_lse`` the pair ``(out, lse [B, N, T])``.
        Rows that see no key give zeros (lse -inf, or the sink's logit with sinks).
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k, v must be rank 4 [B, T, N, H]; got {q.shape}, {k.shape}, {v.shape}"
        )
    batch, q_len, heads, head_dim = q.shape
    _, kv_len, kv_heads, _ = k.shape
    if heads % kv_heads != 0:
        raise ValueError(f"{heads=} of q must be a multiple of {kv_heads=} of k and v")
    if (cu_seqlens_q is not None or cu_seqlens_k is not None) and batch != 1:
        raise ValueError(f"packed input (cu_seqlens) needs batch 1, got {batch=}")
    if dropout_rate > 0.0 and dropout_seed is None:
        raise ValueError(f"dropout_seed is required when {dropout_rate=} > 0")
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale

    f32 = jnp.float32
    group = heads // kv_heads
    kf = jnp.repeat(k.astype(f32), group, axis=2)
    vf = jnp.repeat(v.astype(f32), group, axis=2)
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("btnh,bsnh->bnts", q.astype(f32), kf, precision=hi) * scale
    if bias is not None:
        if bias.ndim != 4:
            raise ValueError(f"bias must be rank 4 [B|1, N|1, T, S], got shape {bias.shape}")
        logits = logits + jnp.asarray(bias, f32)
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)

    visible = visibility_mask(
        q_len,
        kv_len,
        causal=causal,
        sliding_window=sliding_window,
        segment_ids=segment_ids,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
    )
    sinks = None if softmax_sinks is None else jnp.asarray(softmax_sinks, f32)
    probs, lse = _masked_softmax(logits, visible, sinks)
    if dropout_rate > 0.0:
        keep = dropout_keep_mask(dropout_seed, batch, heads, q_len, kv_len, dropout_rate)
        probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
    out = jnp.einsum("bnts,bsnh->btnh", probs, vf, precision=hi).astype(q.dtype)
    return (out, lse) if return_lse else out
