"""`paged_attention` and `ragged_paged_attention`: attention over a paged KV cache (serving).

Both validate the call once (`ejk_sequtils.validate_paged_attention`, where the
conventions are defined) and run the first backend that serves it: ``triton`` (the
split-KV decode kernel of `ejk_kernels_gpu`, when that package has it) on GPU, else
``xla`` (`_paged_xla`), which runs everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax import Array
from jaxtyping import Float, Int

from ejk_sequtils import PagedAttentionRequest, validate_paged_attention

from ._backends import Backend, kernel_executor, platform_of, resolve_implementation, run_first
from ._paged_xla import xla_paged_attention

__all__ = ["PAGED_BACKENDS", "paged_attention", "ragged_paged_attention"]

AnyArray = Array | np.ndarray


class PagedXlaBackend(Backend):
    """`xla_paged_attention`: every feature, every platform."""

    name = "xla"

    def supported(self, request: PagedAttentionRequest, platform: str) -> str | None:
        del request, platform
        return None

    def choose_configs(
        self, request: PagedAttentionRequest, config: Any = None, bwd_config: Any = None
    ) -> tuple[Any, Any]:
        del request, config, bwd_config  # no performance knobs
        return None, None

    def run(self, request: PagedAttentionRequest, config: Any, bwd_config: Any) -> Any:
        del config, bwd_config
        return xla_paged_attention(request)


class PagedTritonBackend(Backend):
    """``ejk_kernels_gpu.paged_attention_request`` (on CPU it runs in Triton's interpreter).

    Looked up when called, so the facade works with an ``ejk_kernels_gpu`` without it.
    Its config comes from the executor (explicit ``config=``, else its caches, where a
    tuned config is stored, else the kernel's heuristic) when the package has the
    `ejk_executor` kernel ``PagedAttention``; otherwise the kernel's own heuristic.
    """

    name = "triton"

    def supported(self, request: PagedAttentionRequest, platform: str) -> str | None:
        del platform  # off GPU the kernel runs in Triton's interpreter
        try:
            import ejk_kernels_gpu
        except ImportError as err:
            return f"ejk_kernels_gpu is not available: {err}"
        if not hasattr(ejk_kernels_gpu, "paged_attention_request"):
            return "this ejk_kernels_gpu has no paged attention kernel"
        reason = getattr(ejk_kernels_gpu, "unsupported_paged_reason", None)
        return None if reason is None else reason(request)

    def invocations(self, request: PagedAttentionRequest) -> dict[str, Any]:
        import ejk_kernels_gpu
        from ejk_executor import Invocation

        kernel = getattr(ejk_kernels_gpu, "PagedAttention", None)
        if kernel is None:
            return {}
        args = (request.q, request.k_pages, request.v_pages, request.page_table, request.kv_lens)
        kwargs = {
            "cu_q_lens": request.cu_q_lens,
            "softmax_scale": request.softmax_scale,
            "sliding_window": request.sliding_window,
            "logits_soft_cap": request.logits_soft_cap,
            "softmax_sinks": request.softmax_sinks,
        }
        return {"forward": Invocation.make(kernel(), args, kwargs)}

    def choose_configs(
        self, request: PagedAttentionRequest, config: Any = None, bwd_config: Any = None
    ) -> tuple[Any, Any]:
        del bwd_config  # forward only
        inv = self.invocations(request).get("forward")
        if config is None and inv is not None:
            config = kernel_executor().chooser.choose(inv).cfg
        return config, None

    def run(self, request: PagedAttentionRequest, config: Any, bwd_config: Any) -> Any:
        import ejk_kernels_gpu

        del bwd_config
        return ejk_kernels_gpu.paged_attention_request(request, config=config)


PAGED_BACKENDS: dict[str, Backend] = {"triton": PagedTritonBackend(), "xla": PagedXlaBackend()}


def _run(request: PagedAttentionRequest, implementation: Any, config: Any) -> Array:
    names = resolve_implementation(implementation)
    if names is None:
        gpu = platform_of(request) in ("gpu", "cuda", "rocm")
        names = ("triton", "xla") if gpu else ("xla",)
    return run_first(request, names, config, backends=PAGED_BACKENDS)[1]


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
    implementation: str | Sequence[str] | None = None,
    config: Any = None,
) -> Float[Array, "B T N H"]:
    """Attention of each sequence's last ``T`` tokens over its keys in a paged KV cache.

    Query ``t`` of sequence ``b`` sits at position ``kv_lens[b] - T + t`` and sees the keys
    at positions ``<=`` its own (bottom-right causal), and ``>= position - left`` with a
    window. Sequences with ``kv_lens[b] == 0`` (idle slots) and queries at negative
    positions (``kv_lens[b] < T``) output zeros. Page-table entries past a sequence's last
    page, and page slots past ``kv_lens[b]``, are never read. Forward only: serving takes
    no gradients (the Triton kernel has none; train with `flash_attention`).

    Args:
        q: ``[B, T, N, H]``, the last ``T`` tokens of each sequence (T = 1: decoding).
        k_pages: ``[P, page_size, K, H]``, the pool of key pages, q's dtype, ``N % K == 0``.
        v_pages: ``[P, page_size, K, H]``, the pool of value pages.
        page_table: int32 ``[B, pages_per_seq]``: ``page_table[b, i]`` holds the keys of
            sequence ``b`` at positions ``i * page_size ...``.
        kv_lens: int32 ``[B]``, each sequence's length including its ``T`` new tokens,
            at most ``pages_per_seq * page_size``.
        softmax_scale: multiplies ``q·kᵀ``; default ``H ** -0.5``.
        sliding_window: ``(left, right)`` or ``w`` for ``(w, w)``; causal makes ``right``
            irrelevant.
        logits_soft_cap: ``cap * tanh(logits / cap)``.
        softmax_sinks: ``[N]`` or ``[N, num_sinks]`` logits in the softmax denominator only.
        implementation: None (``"triton"`` on GPU when ``ejk_kernels_gpu`` has its paged
            kernel, then ``"xla"``; ``"xla"`` elsewhere), one of ``"xla"``, ``"triton"``
            (others are valid names of the facade without a paged backend), or a
            sequence of them tried in order.
        config: the Triton kernel's config; default its heuristic. xla has none.

    Returns:
        ``out [B, T, N, H]`` in q's dtype.

    Raises:
        ValueError, TypeError: a bad argument (the message names it); values (``kv_lens``
            within the table's capacity, pages in the pool) are checked when concrete.
        NotImplementedError: no requested implementation can serve the call (each reason given).
    """
    request = validate_paged_attention(
        q,
        k_pages,
        v_pages,
        page_table,
        kv_lens,
        softmax_scale=softmax_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        softmax_sinks=softmax_sinks,
    )
    return _run(request, implementation, config)


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
        softmax_scale, sliding_window, logits_soft_cap, softmax_sinks, implementation,
            config: as in `paged_attention`.

    Returns:
        ``out [total_q, N, H]`` in q's dtype.

    Raises:
        ValueError, TypeError: a bad argument (the message names it).
        NotImplementedError: no requested implementation can serve the call.
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
    )
    return _run(request, implementation, config)
