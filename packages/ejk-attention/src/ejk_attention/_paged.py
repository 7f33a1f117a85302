"""`paged_attention` and `ragged_paged_attention`: attention over a paged KV cache (serving).

Both validate the call once (`ejk_sequtils.validate_paged_attention`, where the
conventions are defined) and run the first backend whose paged part
(`_backends.BACKENDS[name].paged`, `_paged_backends`) serves it: ``triton`` (the
split-KV decode kernel of `ejk_kernels_gpu`) on GPU, ``pallas``
(the ragged paged kernel of `ejk_kernels_tpu`) on TPU, else ``xla`` (`_paged_xla`), which
runs everywhere. Named explicitly, ``triton`` and ``pallas`` also run off their device,
in their interpreters (slowly: for tests). FP8 caches (``float8_e4m3fn`` pages with
``k_scales``/``v_scales``) run on every backend: each dequantises the pages it reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax import Array
from jaxtyping import Float, Int

from ejk_sequtils import PagedAttentionRequest, validate_paged_attention

from ._backends import (
    Backend,
    default_order,
    paged_backends,
    platform_of,
    resolve_implementation,
    run_first,
)
from ._eager import eager_jit

__all__ = ["paged_attention", "ragged_paged_attention"]

AnyArray = Array | np.ndarray


def _call(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    page_table: Any,
    kv_lens: Any,
    cu_q_lens: Any,
    softmax_sinks: Any,
    k_scales: Any,
    v_scales: Any,
    *,
    softmax_scale: Any,
    sliding_window: Any,
    logits_soft_cap: Any,
    names: tuple[str, ...] | None,
    config: Any,
    backends: tuple[tuple[str, Backend], ...],
) -> Array:
    """A paged call (``cu_q_lens`` None: `paged_attention`) on the first backend of ``names``
    that serves it; ``backends`` is `_backends.paged_backends`' items (a cache key of
    `_eager_call`: a test replacing one gets a new trace)."""
    arrays = (
        q,
        k_pages,
        v_pages,
        page_table,
        kv_lens,
        cu_q_lens,
        softmax_sinks,
        k_scales,
        v_scales,
    )
    options = dict(
        softmax_scale=softmax_scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap
    )
    request = _validate(arrays, options)
    if names is None:
        names = tuple(n for n in default_order(platform_of(request)) if n in dict(backends))
    return run_first(request, names, config, backends=dict(backends))[1]


_eager_call = eager_jit(
    _call,
    ("softmax_scale", "sliding_window", "logits_soft_cap", "names", "config", "backends"),
)


def _validate(arrays: tuple[Any, ...], options: dict[str, Any]) -> PagedAttentionRequest:
    """`validate_paged_attention` of ``arrays`` (the call's, then ``cu_q_lens``,
    ``softmax_sinks``, ``k_scales``, ``v_scales``: `_call`'s order) and the static ``options``
    (``softmax_scale``, ``sliding_window``, ``logits_soft_cap``)."""
    q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, sinks, k_scales, v_scales = arrays
    return validate_paged_attention(
        q,
        k_pages,
        v_pages,
        page_table,
        kv_lens,
        cu_q_lens=cu_q_lens,
        softmax_sinks=sinks,
        k_scales=k_scales,
        v_scales=v_scales,
        **options,
    )


def _run(
    arrays: tuple[Any, ...], options: dict[str, Any], implementation: Any, config: Any
) -> Array:
    """``arrays`` and ``options`` (as `_validate` takes them) validated here (values too, where
    concrete), then run under one compiled function per signature when concrete (the checks
    that run while tracing see shapes and dtypes only)."""
    request = _validate(arrays, options)
    scales = (request.k_scales, request.v_scales)  # a scalar scale as a float32 array
    return _eager_call(
        *arrays[:-2],
        *scales,
        softmax_scale=request.softmax_scale,
        sliding_window=request.sliding_window,
        logits_soft_cap=request.logits_soft_cap,
        names=resolve_implementation(implementation),
        config=config,
        backends=tuple(paged_backends().items()),
    )


def paged_attention(
    q: Float[AnyArray, "B T N H"],
    k_pages: Float[AnyArray, "P page_size K H"],
    v_pages: Float[AnyArray, "P page_size K H"],
    page_table: Int[AnyArray, "B pages_per_seq"],
    kv_lens: Int[AnyArray, " B"],
    *,
    softmax_scale: float | None = None,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    softmax_sinks: Float[AnyArray, " N *num_sinks"] | None = None,
    k_scales: Float[AnyArray, "P page_size K"] | Float[AnyArray, ""] | float | None = None,
    v_scales: Float[AnyArray, "P page_size K"] | Float[AnyArray, ""] | float | None = None,
    implementation: str | Sequence[str] | None = None,
    config: Any = None,
) -> Float[Array, "B T N H"]:
    """Attention of each sequence's last ``T`` tokens over its keys in a paged KV cache.

    Query ``t`` of sequence ``b`` sits at position ``kv_lens[b] - T + t`` and sees the keys
    at positions ``<=`` its own (bottom-right causal), and ``>= position - left`` with a
    window. Sequences with ``kv_lens[b] == 0`` (idle slots) and queries at negative
    positions (``kv_lens[b] < T``) output zeros. Page-table entries past a sequence's last
    page, and page slots past ``kv_lens[b]``, are never read. Forward only: serving takes
    no gradients (the Triton and Pallas kernels have none; train with `flash_attention`).

    Args:
        q: ``[B, T, N, H]``, the last ``T`` tokens of each sequence (T = 1: decoding).
        k_pages: ``[P, page_size, K, H]``, the pool of key pages, q's dtype, ``N % K == 0``;
            or ``float8_e4m3fn`` with ``k_scales`` (an FP8 cache).
        v_pages: ``[P, page_size, K, H]``, the pool of value pages (k_pages' dtype).
        page_table: int32 ``[B, pages_per_seq]``: ``page_table[b, i]`` holds the keys of
            sequence ``b`` at positions ``i * page_size ...``.
        kv_lens: int32 ``[B]``, each sequence's length including its ``T`` new tokens,
            at most ``pages_per_seq * page_size``.
        softmax_scale: multiplies ``q·kᵀ``; default ``H ** -0.5``.
        sliding_window: ``(left, right)`` or ``w`` for ``(w, w)``; causal makes ``right``
            irrelevant.
        logits_soft_cap: ``cap * tanh(logits / cap)``.
        softmax_sinks: ``[N]`` or ``[N, num_sinks]`` logits in the softmax denominator only.
        k_scales, v_scales: with fp8 pages only: float32 ``[P, page_size, K]`` (one scale per
            stored token and kv head) or a scalar (per tensor); a slot holds
            ``page * scale`` (`ejk_sequtils.dequantize_kv`; `PagedKVCache` quantises so).
        implementation: None (``"triton"`` on GPU when ``ejk_kernels_gpu`` has its paged
            kernel, ``"pallas"`` on TPU, then ``"xla"``; ``"xla"`` elsewhere), one of
            ``"xla"``, ``"triton"``, ``"pallas"`` (``"cudnn"`` is a valid name of the
            facade without a paged backend), or a sequence of them tried in order.
        config: the kernel's config (`ejk_kernels_gpu.PagedConfig` for triton,
            `ejk_kernels_tpu.RaggedPagedConfig` for pallas); default the executor's choice
            (a tuned config, else the kernel's heuristic). xla has none.

    Returns:
        ``out [B, T, N, H]`` in q's dtype.

    Raises:
        ValueError, TypeError: a bad argument (the message names it); values (``kv_lens``
            within the table's capacity, pages in the pool) are checked when concrete.
        NotImplementedError: no requested implementation can serve the call (each reason given).
    """
    arrays = (q, k_pages, v_pages, page_table, kv_lens, None, softmax_sinks, k_scales, v_scales)
    options = dict(
        softmax_scale=softmax_scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap
    )
    return _run(arrays, options, implementation, config)


def ragged_paged_attention(
    q: Float[AnyArray, "total_q N H"],
    k_pages: Float[AnyArray, "P page_size K H"],
    v_pages: Float[AnyArray, "P page_size K H"],
    page_table: Int[AnyArray, "B pages_per_seq"],
    kv_lens: Int[AnyArray, " B"],
    cu_q_lens: Int[AnyArray, " B+1"],
    *,
    softmax_scale: float | None = None,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    softmax_sinks: Float[AnyArray, " N *num_sinks"] | None = None,
    k_scales: Float[AnyArray, "P page_size K"] | Float[AnyArray, ""] | float | None = None,
    v_scales: Float[AnyArray, "P page_size K"] | Float[AnyArray, ""] | float | None = None,
    implementation: str | Sequence[str] | None = None,
    config: Any = None,
) -> Float[Array, "total_q N H"]:
    """`paged_attention` of a batch mixing prefill chunks and decode steps, queries packed.

    Sequence ``b`` owns the query rows ``cu_q_lens[b]:cu_q_lens[b + 1]``, its last
    ``T_b = cu_q_lens[b + 1] - cu_q_lens[b]`` tokens; its row ``t`` sits at position
    ``kv_lens[b] - T_b + t`` (the same bottom-right rule; ``T_b = 0`` is a sequence without
    queries this step). Forward only.

    Args:
        q: ``[total_q, N, H]``.
        k_pages, v_pages, page_table, kv_lens: as in `paged_attention`.
        cu_q_lens: int32 ``[B + 1]``, from 0, non-decreasing, ending at ``total_q``.
        softmax_scale, sliding_window, logits_soft_cap, softmax_sinks, k_scales, v_scales,
            implementation, config: as in `paged_attention`.

    Returns:
        ``out [total_q, N, H]`` in q's dtype.

    Raises:
        ValueError, TypeError: a bad argument (the message names it).
        NotImplementedError: no requested implementation can serve the call.
    """
    arrays = (q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, softmax_sinks)
    options = dict(
        softmax_scale=softmax_scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap
    )
    return _run((*arrays, k_scales, v_scales), options, implementation, config)
