"""The public entry points: `flash_attention` (validates), `attention` (a validated request),
`unsupported_reason`, and the custom VJP that joins the forward and backward launches."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, Integer

from ejk_sequtils import AttentionRequest, validate_attention

from ._config import FlashBackwardConfig, FlashConfig, as_backward_config
from ._decode import decode_route
from ._select import call_options
from ._tables import kernel_tables
from ._vjp import flash_vjp

__all__ = ["attention", "flash_attention", "unsupported_reason"]

AnyArray = Array | np.ndarray
_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


def unsupported_reason(request: AttentionRequest) -> str | None:
    """Why the Triton kernels cannot serve a valid request, or None if they can.

    Args:
        request: a request from `ejk_sequtils.validate_attention`.

    Returns:
        A sentence naming the unsupported part and its value, or None.
    """
    q, v = request.q, request.v
    head_dim = q.shape[3]
    if v.shape[3] != head_dim:
        return f"the Triton kernels need v's head_dim == q's, got {q.shape=} and {v.shape=}"
    if head_dim > 256:
        return f"the Triton kernels take head_dim <= 256, got {head_dim=}"
    if q.dtype not in _DTYPES:
        return f"the Triton kernels take float16, bfloat16 or float32 inputs, got {q.dtype=}"
    return None


def attention(
    request: AttentionRequest,
    *,
    config: FlashConfig | None = None,
    bwd_config: FlashBackwardConfig | FlashConfig | None = None,
) -> Float[Array, "B T N H"] | tuple[Float[Array, "B T N H"], Float[Array, "B N T"]]:
    """Flash attention of an already validated request (not checked again).

    Args:
        request: from `ejk_sequtils.validate_attention`.
        config: forward tile config; default `fwd_heuristic`.
        bwd_config: backward tile config (`FlashBackwardConfig`: the dk/dv kernel's, and
            the dq kernel's tiles); default `bwd_heuristic`. A `FlashConfig` is converted
            field by field with a DeprecationWarning (the spelling before
            `FlashBackwardConfig`; for one release).

    Returns:
        ``out [B, T, N, H]`` in ``q.dtype``; with ``request.return_lse`` the pair
        ``(out, lse [B, N, T])``, the lse in float32.

    Raises:
        NotImplementedError: the request is valid but these kernels cannot serve it
            (`unsupported_reason`).
        TypeError, ValueError: a config of the wrong type, or a deprecated `FlashConfig`
            ``bwd_config`` that is no valid `FlashBackwardConfig`.
    """
    reason = unsupported_reason(request)
    if reason is not None:
        raise NotImplementedError(reason)
    if config is not None and not isinstance(config, FlashConfig):
        raise TypeError(f"config must be a FlashConfig or None, got {config!r}")
    bwd_config = as_backward_config(bwd_config)
    routed = decode_route(request, config, bwd_config)  # decoding: the split-KV kernel
    if routed is not None:
        return routed
    opts = call_options(request, config, bwd_config)
    tables = kernel_tables(opts, request)
    arrays = (request.q, request.k, request.v, request.bias, request.softmax_sinks)
    q, k, v, bias, sinks = (None if x is None else jnp.asarray(x) for x in arrays)
    out, lse = flash_vjp(opts, q, k, v, bias, sinks, tables)
    return (out, lse) if request.return_lse else out


def flash_attention(
    q: Float[AnyArray, "B T N H"],
    k: Float[AnyArray, "B S K H"],
    v: Float[AnyArray, "B S K Hv"],
    bias: Float[AnyArray, "#B #N T S"] | None = None,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | Sequence[int] | None = None,
    logits_soft_cap: float | None = None,
    softmax_sinks: Float[AnyArray, " N"] | Float[AnyArray, "N num_sinks"] | None = None,
    segment_ids: Int[AnyArray, "B T"]
    | tuple[Int[AnyArray, "B T"], Int[AnyArray, "B S"]]
    | None = None,
    cu_seqlens_q: Int[AnyArray, " L"] | None = None,
    cu_seqlens_k: Int[AnyArray, " L"] | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: int | Integer[ArrayLike, ""] | None = None,
    return_lse: bool = False,
    config: FlashConfig | None = None,
    bwd_config: FlashBackwardConfig | FlashConfig | None = None,
) -> Float[Array, "B T N H"] | tuple[Float[Array, "B T N H"], Float[Array, "B N T"]]:
    """Flash attention in Triton (FlashAttention-2), forward and backward kernels.

    Same semantics and validation as ``ejk_sequtils.reference_attention`` (through
    ``ejk_sequtils.validate_attention``): softmax over the keys each query sees, computed
    blockwise with an online softmax in float32. Then `attention`.

    Args:
        q: queries ``[B, T, N, H]`` (float16, bfloat16 or float32).
        k: keys ``[B, S, K, H]`` with ``N % K == 0``; query head n reads kv head ``n // (N // K)``.
        v: values ``[B, S, K, H]``.
        bias: additive logits bias ``[1|B, 1|N, T, S]``.
        softmax_scale: multiplies ``q·kᵀ``; default ``H ** -0.5``.
        causal: query i sees keys ``j <= i`` (top-left aligned; local to a packed sequence).
        sliding_window: ``(left, right)`` or ``w`` for ``(w, w)``: keys in ``[i - left, i + right]``.
        logits_soft_cap: ``cap * tanh(logits / cap)``.
        softmax_sinks: ``[N]`` or ``[N, num_sinks]`` logits in the softmax denominator only.
        segment_ids: ``[B, T]`` (needs ``T == S``) or ``(q_ids [B, T], kv_ids [B, S])``;
            negative ids are padding (0 is an ordinary segment).
        cu_seqlens_q: int32 ``[num_seqs + 1]`` offsets of packed query sequences (needs B == 1).
        cu_seqlens_k: int32 ``[num_seqs + 1]`` key offsets; default ``cu_seqlens_q``.
        dropout_rate: probability of dropping a normalised attention weight, in ``[0, 1)``.
        dropout_seed: int or uint32/int32 scalar seed of the counter-hash keep mask.
        return_lse: also return the float32 log-sum-exp ``[B, N, T]``.
        config: forward tile config; default `fwd_heuristic`.
        bwd_config: backward tile config (`FlashBackwardConfig`); default `bwd_heuristic`
            (a `FlashConfig`: deprecated, see `attention`).

    Returns:
        ``out [B, T, N, H]`` in ``q.dtype``; with ``return_lse`` the pair ``(out, lse)``.
    """
    request = validate_attention(
        q,
        k,
        v,
        bias,
        softmax_scale=softmax_scale,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        softmax_sinks=softmax_sinks,
        segment_ids=segment_ids,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        dropout_rate=dropout_rate,
        dropout_seed=dropout_seed,
        return_lse=return_lse,
    )
    return attention(request, config=config, bwd_config=bwd_config)
