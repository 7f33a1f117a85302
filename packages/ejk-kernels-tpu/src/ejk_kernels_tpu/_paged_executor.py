"""`RaggedPagedAttention`: the ragged paged kernel as an `ejk_executor.Kernel`, so the
executor can pick, cache and autotune its `RaggedPagedConfig`. Forward only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp

from ejk_executor import Invocation, Kernel

from ._paged_api import paged_attention
from ._paged_config import RaggedPagedConfig, ragged_paged_heuristic, ragged_paged_search_space

__all__ = ["RaggedPagedAttention"]


def _sizes(inv: Invocation[RaggedPagedConfig, Any]) -> dict[str, Any]:
    """The heuristic's keyword arguments, from a call ``(q, k_pages, v_pages, page_table,
    kv_lens, *, cu_q_lens=None, ...)`` (arrays positional)."""
    q, k_pages, _, page_table = inv.args[:4]
    ragged = inv.kwargs.get("cu_q_lens") is not None
    _, page_size, kv_heads, head_dim = k_pages.shape
    return dict(
        batch=int(page_table.shape[0]),
        q_rows=int(q.shape[0] if ragged else q.shape[1]),
        ragged=ragged,
        heads=int(q.shape[-2]),
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        page_size=int(page_size),
        pages_per_seq=int(page_table.shape[1]),
        itemsize=int(jnp.dtype(q.dtype).itemsize),
    )


class RaggedPagedAttention(Kernel[RaggedPagedConfig, Any]):
    """`paged_attention` (this package's) with its config chosen by the executor: call as
    ``executor(RaggedPagedAttention(), q, k_pages, v_pages, page_table, kv_lens,
    cu_q_lens=..., softmax_scale=..., ...)``."""

    name = "ejk_kernels_tpu.paged_attention"
    version = "1"
    config_type = RaggedPagedConfig

    def run(self, *args: Any, cfg: RaggedPagedConfig, **kwargs: Any) -> Any:
        return paged_attention(*args, config=cfg, **kwargs)

    def heuristic_cfg(self, inv: Invocation[RaggedPagedConfig, Any]) -> RaggedPagedConfig:
        return ragged_paged_heuristic(**_sizes(inv))

    def config_space(self, inv: Invocation[RaggedPagedConfig, Any]) -> Iterable[RaggedPagedConfig]:
        if inv.platform != "pallas":
            # Off TPU the kernel runs in the interpreter: timing there says nothing about a
            # TPU, so only the heuristic config is offered.
            return [self.heuristic_cfg(inv)]
        sizes = _sizes(inv)
        rows = sizes["q_rows"] * (1 if sizes["ragged"] else sizes["batch"])
        for name in ("batch", "q_rows", "ragged"):
            del sizes[name]
        return ragged_paged_search_space(q_rows=rows, **sizes)
