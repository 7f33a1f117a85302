"""`RaggedPagedAttention`: the ragged paged kernel as an `ejk_executor.Kernel`, so the
executor can pick, cache and autotune its `RaggedPagedConfig`. Forward only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ejk_executor import Invocation, Kernel

from ._paged_api import paged_attention
from ._paged_config import (
    PagedShape,
    RaggedPagedConfig,
    paged_shape,
    ragged_paged_heuristic,
    ragged_paged_search_space,
)

__all__ = ["RaggedPagedAttention"]


def _shape(inv: Invocation[RaggedPagedConfig, Any]) -> PagedShape:
    """The call's sizes, from ``(q, k_pages, v_pages, page_table, kv_lens, *,
    cu_q_lens=None, ...)`` (arrays positional)."""
    q, k_pages, _, page_table = inv.args[:4]
    return paged_shape(q, k_pages, page_table, ragged=inv.kwargs.get("cu_q_lens") is not None)


class RaggedPagedAttention(Kernel[RaggedPagedConfig, Any]):
    """`paged_attention` (this package's) with its config chosen by the executor: call as
    ``executor(RaggedPagedAttention(), q, k_pages, v_pages, page_table, kv_lens,
    cu_q_lens=..., softmax_scale=..., ...)``."""

    name = "ejk_kernels_tpu.paged_attention"
    version = "1"
    config_type = RaggedPagedConfig
    cached_cfg_in_space = True  # from disk only what the autotuner can have stored

    def run(self, *args: Any, cfg: RaggedPagedConfig, **kwargs: Any) -> Any:
        return paged_attention(*args, config=cfg, **kwargs)

    def heuristic_cfg(self, inv: Invocation[RaggedPagedConfig, Any]) -> RaggedPagedConfig:
        return ragged_paged_heuristic(_shape(inv))

    def config_space(self, inv: Invocation[RaggedPagedConfig, Any]) -> Iterable[RaggedPagedConfig]:
        if inv.platform != "pallas":
            # Off TPU the kernel runs in the interpreter: timing there says nothing about a
            # TPU, so only the heuristic config is offered.
            return [self.heuristic_cfg(inv)]
        return ragged_paged_search_space(_shape(inv))
