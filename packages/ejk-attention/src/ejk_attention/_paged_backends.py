"""The paged backends (serving): ``xla`` (`_paged_xla`, every platform), ``triton`` (the
split-KV kernel of `ejk_kernels_gpu`) and ``pallas`` (the ragged paged kernel of
`ejk_kernels_tpu`): the paged parts of the backend objects in `_backends`. Each takes a
`ejk_sequtils.PagedAttentionRequest`.
"""

from __future__ import annotations

from typing import Any

import ejk_kernels_gpu
import ejk_kernels_tpu
from ejk_executor import Invocation
from ejk_sequtils import PagedAttentionRequest

from ._backend import Backend, kernel_executor, triton_missing
from ._paged_xla import xla_paged_attention

__all__ = ["PagedKernelBackend", "PagedPallasBackend", "PagedTritonBackend", "PagedXlaBackend"]


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


class PagedKernelBackend(Backend):
    """A kernel package's paged attention: its ``paged_attention_request(request, config=)``,
    ``unsupported_paged_reason(request)`` and `ejk_executor` kernel (``kernel``).

    The config comes from the executor (explicit ``config=``, else its caches, where a tuned
    config is stored, else the kernel's heuristic). Forward only.
    """

    # The kernel package's entry points (a module, or any object with the two functions).
    package: Any = None
    kernel: Any = None  # its `ejk_executor.Kernel` class for paged attention
    # Why the kernels cannot run here though the package imports (a missing dependency).
    missing: Any = staticmethod(lambda: None)

    def supported(self, request: PagedAttentionRequest, platform: str) -> str | None:
        del platform  # off their device the kernels run in an interpreter
        if self.missing():
            return self.missing()
        return self.package.unsupported_paged_reason(request)

    def invocations(self, request: PagedAttentionRequest) -> dict[str, Any]:
        args = (request.q, request.k_pages, request.v_pages, request.page_table, request.kv_lens)
        kwargs = {
            "cu_q_lens": request.cu_q_lens,
            "softmax_scale": request.softmax_scale,
            "sliding_window": request.sliding_window,
            "logits_soft_cap": request.logits_soft_cap,
            "softmax_sinks": request.softmax_sinks,
        }
        if request.is_quantized:  # only then: the keys of unquantised calls stay as they were
            kwargs.update(k_scales=request.k_scales, v_scales=request.v_scales)
        return {"forward": Invocation.make(self.kernel(), args, kwargs)}

    def choose_configs(
        self, request: PagedAttentionRequest, config: Any = None, bwd_config: Any = None
    ) -> tuple[Any, Any]:
        del bwd_config  # forward only
        inv = self.invocations(request).get("forward")
        if config is None and inv is not None:
            config = kernel_executor().chooser.choose(inv).cfg
        return config, None

    def run(self, request: PagedAttentionRequest, config: Any, bwd_config: Any) -> Any:
        del bwd_config
        return self.package.paged_attention_request(request, config=config)


class PagedTritonBackend(PagedKernelBackend):
    """``ejk_kernels_gpu.paged_attention_request``, the split-KV kernel (on CPU it runs in
    Triton's interpreter); executor kernel ``PagedAttention``."""

    name = "triton"
    package = ejk_kernels_gpu
    kernel = ejk_kernels_gpu.PagedAttention
    missing = staticmethod(triton_missing)


class PagedPallasBackend(PagedKernelBackend):
    """``ejk_kernels_tpu.paged_attention_request``, the ragged paged Pallas kernel (on TPU;
    elsewhere it runs in Pallas' TPU interpreter); executor kernel ``RaggedPagedAttention``."""

    name = "pallas"
    package = ejk_kernels_tpu
    kernel = ejk_kernels_tpu.RaggedPagedAttention
