"""The float32 reference: attention in plain jnp, every feature, the definition every backend matches.

It favours clarity over speed: it materialises the full ``[B, N, T, S]`` score matrix.
Gradients come from JAX's autodiff and stay finite on emptied rows (see `_masked_softmax`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Integer

from ._checks import describe_value
from ._cu_seqlens import cu_seqlens_valid, poison_unless
from ._dropout import dropout_keep_mask
from ._visibility import SegmentIds, visibility_mask

__all__ = ["fold_sinks", "reference_attention"]

AnyArray = Array | np.ndarray


def fold_sinks(softmax_sinks: Float[AnyArray, " N *num_sinks"]) -> Float[Array, " N"]:
    """Sinks ``[N]`` as they are, or ``[N, num_sinks]`` folded to one logit per head.

    Sinks enter only the softmax denominator, ``sum_j exp(s_j) + sum_k exp(sink_k)``,
    so several sinks of a head act as one of logit ``logsumexp_k sink_k`` (gradients
    included: autodiff through the fold splits a head's gradient over its sinks by
    their softmax weights). ``[N, 0]`` folds to ``-inf``: no sink.
    """
    sinks = jnp.asarray(softmax_sinks)
    if sinks.ndim == 1:
        return sinks
    if sinks.shape[1] == 0:
        return jnp.full(sinks.shape[:1], -jnp.inf, sinks.dtype)
    return jax.nn.logsumexp(sinks.astype(jnp.float32), axis=1).astype(sinks.dtype)


def _masked_softmax(
    logits: Float[Array, "B N T S"], visible: Bool[Array, "#B #N T S"], sinks: Array | None
) -> tuple[Float[Array, "B N T S"], Float[Array, "B N T"]]:
    """Softmax over visible keys (and the sink), its log-normaliser, NaN-free.

    Masked logits become -inf before the max and the exp, so no masked value can
    overflow (a ``where`` after ``exp`` would pass ``0 * inf = NaN`` to the gradient).
    The running max is a constant for autodiff: the result does not depend on it.
    A row with no mass (no visible key, no sink) gives zeros and lse -inf.
    """
    s = jnp.where(visible, logits, -jnp.inf)
    m = jnp.max(s, axis=-1, initial=-jnp.inf)
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
    softmax_sinks: Float[AnyArray, " N *num_sinks"] | None = None,
    segment_ids: SegmentIds | None = None,
    mask: Bool[AnyArray, "#B #N T S"] | None = None,
    cu_seqlens_q: Int[AnyArray, " L"] | None = None,
    cu_seqlens_k: Int[AnyArray, " L"] | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: int | Integer[ArrayLike, ""] | None = None,
    return_lse: bool = False,
) -> Float[Array, "B T N Hv"] | tuple[Float[Array, "B T N Hv"], Float[Array, "B N T"]]:
    """Multi-head attention in float32 jnp, the definition every ejk backend matches.

    ``out[b, i, n] = sum_j p_ij v[b, j, n // G]`` with ``p = softmax_j(logits)`` over the
    keys query ``i`` sees (`visibility_mask`) and the sinks, where
    ``logits = cap·tanh((scale·q·kᵀ + bias) / cap)`` (no tanh without a cap), then
    dropout. A query with no visible key and no sink outputs zeros, with zero gradients
    (lse -inf); with sinks it outputs zeros too (lse = the folded sink logit).

    Args:
        q: queries ``[B, T, N, H]``.
        k: keys ``[B, S, K, H]`` with ``N % K == 0``; query head n reads kv head ``n // (N // K)``.
        v: values ``[B, S, K, Hv]``.
        bias: additive logits bias broadcastable from ``[1|B, 1|N, T, S]``. A finite bias,
            even ``-FLT_MAX``, is a bias: the row's softmax is taken over it; ``-inf``
            hides the key.
        softmax_scale: multiplies ``q·kᵀ``; default ``H ** -0.5``.
        causal: query i sees keys ``j <= i`` (top-left aligned, positions local to a packed sequence).
        sliding_window: ``(left, right)`` or ``w`` for ``(w, w)``: keys in ``[i - left, i + right]``.
        logits_soft_cap: ``cap * tanh(logits / cap)`` with ``logits = scale * q·kᵀ + bias``.
        softmax_sinks: ``[N]`` one logit per query head, or ``[N, num_sinks]``, in the softmax
            denominator only (several fold to one by logsumexp, `fold_sinks`).
        segment_ids: ``[B, T]`` (self attention) or ``(q_ids [B, T], kv_ids [B, S])``;
            tokens attend within equal ids >= 0; negative ids are padding.
        mask: bool ``[1|B, 1|N, T, S]``, True where a query may see a key; it joins the
            rules above (it is visibility, not a bias: a soft cap cannot unmask a key).
        cu_seqlens_q: ``[num_seqs + 1]`` query offsets of packed sequences (needs B == 1).
            Concrete offsets are checked (start at 0, non-decreasing, at most T); traced
            ones (under jit) cannot be, and invalid ones make every output and lse NaN.
        cu_seqlens_k: key offsets; defaults to ``cu_seqlens_q``; the same rules, against S.
        dropout_rate: probability of dropping a normalised attention weight.
        dropout_seed: seed of the counter-based keep mask (see `dropout_keep_mask`).
        return_lse: also return the float32 log-sum-exp of each row.

    Returns:
        ``out [B, T, N, Hv]`` in ``q.dtype``, and with ``return_lse`` the pair ``(out, lse [B, N, T])``.
    """
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if not hasattr(x, "ndim"):
            raise TypeError(f"{name} must be a jax or NumPy array, got {describe_value(x)}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k, v must be rank 4 [B, T, N, H]; got {q.shape}, {k.shape}, {v.shape}"
        )
    batch, q_len, heads, head_dim = q.shape
    _, kv_len, kv_heads, _ = k.shape
    if kv_heads == 0 or heads % kv_heads != 0:
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
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.ndim != 4 or mask.dtype != jnp.bool_:
            raise ValueError(
                f"mask must be a bool [B|1, N|1, T, S] array, got shape {mask.shape} dtype {mask.dtype}"
            )
        visible = visible & mask
    sinks = None if softmax_sinks is None else fold_sinks(softmax_sinks).astype(f32)
    probs, lse = _masked_softmax(logits, visible, sinks)
    if dropout_rate > 0.0:
        keep = dropout_keep_mask(dropout_seed, batch, heads, q_len, kv_len, dropout_rate)
        probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
    out = jnp.einsum("bnts,bsnh->btnh", probs, vf, precision=hi).astype(q.dtype)
    offsets = [
        (cu, n) for cu, n in ((cu_seqlens_q, q_len), (cu_seqlens_k, kv_len)) if cu is not None
    ]
    if offsets:  # traced offsets cannot be checked: invalid ones give NaN, not plausible numbers
        valid = functools.reduce(jnp.logical_and, [cu_seqlens_valid(cu, n) for cu, n in offsets])
        out, lse = poison_unless(valid, out, lse)
    return (out, lse) if return_lse else out
