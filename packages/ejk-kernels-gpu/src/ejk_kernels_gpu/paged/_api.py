"""Paged attention for serving: `paged_attention` (validates), `paged_attention_request`
(a validated request), `unsupported_paged_reason`. Forward only: serving takes no gradients."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ejk_sequtils import PagedAttentionRequest, validate_paged_attention

from ._config import PagedConfig, paged_heuristic, tile_shape
from ._launch import PagedCall, paged_forward, query_tiles, uniform_tiles

__all__ = ["paged_attention", "paged_attention_request", "unsupported_paged_reason"]

AnyArray = Array | np.ndarray
_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


def unsupported_paged_reason(request: PagedAttentionRequest) -> str | None:
    """Why the paged Triton kernel cannot serve a valid request, or None if it can.

    Args:
        request: from `ejk_sequtils.validate_paged_attention`.

    Returns:
        A sentence naming the unsupported part and its value, or None.
    """
    if request.head_dim > 256:
        return f"the paged Triton kernel takes head_dim <= 256, got head_dim={request.head_dim}"
    if request.q.dtype not in _DTYPES:
        return (
            "the paged Triton kernel takes float16, bfloat16 or float32 inputs, got "
            f"q.dtype={request.q.dtype}"
        )
    if request.heads // request.kv_heads > 256:
        return (
            "the paged Triton kernel holds a whole kv group in one tile: at most 256 query "
            f"heads per kv head, got heads={request.heads}, kv_heads={request.kv_heads}"
        )
    return None


def default_paged_config(request: PagedAttentionRequest) -> PagedConfig:
    """`paged_heuristic` for a request."""
    return paged_heuristic(
        batch=request.batch,
        q_len=request.num_q_rows,
        ragged=request.is_ragged,
        heads=request.heads,
        kv_heads=request.kv_heads,
        head_dim=request.head_dim,
        capacity=request.capacity,
        itemsize=request.q.dtype.itemsize,
        kv_itemsize=request.k_pages.dtype.itemsize,
    )


def paged_attention_request(
    request: PagedAttentionRequest, *, config: PagedConfig | None = None
) -> Float[Array, "B T N H"] | Float[Array, "total_q N H"]:
    """Paged attention of an already validated request (not checked again): the split-KV
    kernel (`kernels.triton._paged`).

    Args:
        request: from `ejk_sequtils.validate_paged_attention`.
        config: tiles, splits, warps, stages; default `paged_heuristic`.

    Returns:
        ``out`` shaped like ``q``, in ``q.dtype``.

    Raises:
        NotImplementedError: the request is valid but this kernel cannot serve it
            (`unsupported_paged_reason`).
        TypeError: ``config`` is not a `PagedConfig`.
    """
    reason = unsupported_paged_reason(request)
    if reason is not None:
        raise NotImplementedError(reason)
    if config is not None and not isinstance(config, PagedConfig):
        raise TypeError(f"config must be a PagedConfig or None, got {config!r}")
    cfg = config or default_paged_config(request)
    q = jnp.asarray(request.q)
    batch, heads, head_dim = request.batch, request.heads, request.head_dim
    group = heads // request.kv_heads
    kv_lens = jnp.asarray(request.kv_lens, jnp.int32)
    if request.is_ragged:
        rows = q.shape[0]
        tile = tile_shape(cfg, group, rows)
        cu = jnp.asarray(request.cu_q_lens, jnp.int32)
        # Rows past cu_q_lens[-1] (traced calls only) form one more sequence with no keys,
        # so the kernel writes their zeros too.
        q_lens = jnp.append(cu[1:] - cu[:-1], rows - cu[-1])
        q_starts = cu
        kv_lens = jnp.append(kv_lens, 0)
        max_tiles = -(-rows // tile.tokens) + batch + 1
    else:
        rows = batch * q.shape[1]
        tile = tile_shape(cfg, group, q.shape[1])
    if rows == 0 or heads == 0 or request.num_pages == 0:
        # Nothing to compute, or no page to read (every kv_len is 0): zeros.
        return jnp.zeros(q.shape, q.dtype)
    if request.is_ragged:
        tiles = query_tiles(q_lens, q_starts, kv_lens, tokens=tile.tokens, max_tiles=max_tiles)
    else:
        tiles = uniform_tiles(kv_lens, q_len=q.shape[1], tokens=tile.tokens)
    call = PagedCall(
        scale=float(request.softmax_scale),
        causal=True,
        window=request.sliding_window,
        soft_cap=0.0 if request.logits_soft_cap is None else float(request.logits_soft_cap),
        config=cfg,
        tile=tile,
    )
    sinks = request.softmax_sinks
    out = paged_forward(
        call,
        q.reshape(rows, heads, head_dim),
        jnp.asarray(request.k_pages),
        jnp.asarray(request.v_pages),
        jnp.asarray(request.page_table, jnp.int32),
        tiles,
        None if sinks is None else jnp.asarray(sinks),
        request.k_scales,
        request.v_scales,
    )
    return out.reshape(q.shape)


def paged_attention(
    q: Float[AnyArray, "B T N H"] | Float[AnyArray, "total_q N H"],
    k_pages: Float[AnyArray, "P page_size K H"],
    v_pages: Float[AnyArray, "P page_size K H"],
    page_table: Int[AnyArray, "B pages_per_seq"],
    kv_lens: Int[AnyArray, " B"],
    *,
    cu_q_lens: Int[AnyArray, " B1"] | None = None,
    softmax_scale: float | None = None,
    sliding_window: int | Sequence[int] | None = None,
    logits_soft_cap: float | None = None,
    softmax_sinks: Float[AnyArray, " N"] | Float[AnyArray, "N num_sinks"] | None = None,
    k_scales: Float[AnyArray, "P page_size K"] | Float[AnyArray, ""] | float | None = None,
    v_scales: Float[AnyArray, "P page_size K"] | Float[AnyArray, ""] | float | None = None,
    config: PagedConfig | None = None,
) -> Float[Array, "B T N H"] | Float[Array, "total_q N H"]:
    """Paged attention for serving (split-KV / flash-decoding Triton kernel), forward only.

    Validates through `ejk_sequtils.validate_paged_attention`, then
    `paged_attention_request`. The queries are each sequence's last tokens; causal is
    bottom-right (token ``t`` of ``T`` sits at ``kv_lens[b] - T + t``); idle slots and
    negative positions give zeros; table entries past a sequence's last page are never read.

    Args:
        q: ``[B, T, N, H]``, or ``[total_q, N, H]`` with ``cu_q_lens`` (ragged form: sequence
            ``b`` owns rows ``cu_q_lens[b]:cu_q_lens[b + 1]``).
        k_pages, v_pages: ``[P, page_size, K, H]``, ``N % K == 0``; q's dtype or
            ``float8_e4m3fn`` (with ``k_scales``/``v_scales``).
        page_table: int32 ``[B, pages_per_seq]``.
        kv_lens: int32 ``[B]``, each sequence's length including its new tokens.
        cu_q_lens: int32 ``[B + 1]`` query-row offsets (ragged form).
        softmax_scale: multiplies ``q·kᵀ``; default ``H ** -0.5``.
        sliding_window: ``(left, right)`` or ``w`` for ``(w, w)``.
        logits_soft_cap: ``cap * tanh(logits / cap)``.
        softmax_sinks: ``[N]`` or ``[N, num_sinks]`` logits in the denominator only.
        k_scales, v_scales: with ``float8_e4m3fn`` pages: float32 ``[P, page_size, K]`` or
            scalars (a slot holds ``page * scale``); the kernel dequantises in registers.
        config: a `PagedConfig`; default `paged_heuristic`.

    Returns:
        ``out`` shaped like ``q``, in ``q.dtype``.
    """
    request = validate_paged_attention(
        q,
        k_pages,
        v_pages,
        page_table,
        kv_lens,
        cu_q_lens=cu_q_lens,
        softmax_scale=softmax_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        softmax_sinks=softmax_sinks,
        k_scales=k_scales,
        v_scales=v_scales,
    )
    return paged_attention_request(request, config=config)
