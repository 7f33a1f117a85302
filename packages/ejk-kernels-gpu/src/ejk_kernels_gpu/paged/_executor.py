"""`ejk_executor.Kernel` wrapper of the paged kernel, so the executor can pick, cache and
autotune its `PagedConfig` (``ejk tune``). Forward only: serving takes no gradients."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp

from ejk_executor import Invocation, Kernel

from ._api import paged_attention
from ._config import PagedConfig, paged_heuristic, paged_search_space

__all__ = ["PagedAttention"]


def _shape_info(inv: Invocation[Any, Any]) -> dict[str, Any]:
    """The heuristic's keyword arguments from a call ``(q, k_pages, v_pages, page_table,
    kv_lens, cu_q_lens=..., ...)``."""
    names = ("q", "k_pages", "v_pages", "page_table")
    q, k_pages, _, page_table = (
        inv.args[i] if len(inv.args) > i else inv.kwargs[name] for i, name in enumerate(names)
    )
    ragged = inv.kwargs.get("cu_q_lens") is not None
    return dict(
        batch=int(page_table.shape[0]),
        q_len=int(q.shape[0] if ragged else q.shape[1]),
        ragged=ragged,
        heads=int(q.shape[-2]),
        kv_heads=int(k_pages.shape[2]),
        head_dim=int(q.shape[-1]),
        capacity=int(page_table.shape[1] * k_pages.shape[1]),
        itemsize=int(jnp.dtype(q.dtype).itemsize),
        kv_itemsize=int(jnp.dtype(k_pages.dtype).itemsize),
    )


class PagedAttention(Kernel[PagedConfig, Any]):
    """`paged_attention` with its config chosen by the executor (same arguments)."""

    name = "ejk_kernels_gpu.paged_attention"
    version = "1"
    config_type = PagedConfig
    cached_cfg_in_space = True  # from disk only what the autotuner can have stored

    def run(self, *args: Any, cfg: PagedConfig, **kwargs: Any) -> Any:
        return paged_attention(*args, config=cfg, **kwargs)

    def heuristic_cfg(self, inv: Invocation[PagedConfig, Any]) -> PagedConfig:
        return paged_heuristic(**_shape_info(inv))

    def config_space(self, inv: Invocation[PagedConfig, Any]) -> Iterable[PagedConfig]:
        info = _shape_info(inv)
        group = info["heads"] // max(info["kv_heads"], 1)
        max_q_len = info["q_len"]
        return paged_search_space(
            group=group,
            max_q_len=max_q_len,
            max_keys=info["capacity"],
            head_dim=info["head_dim"],
            itemsize=info["itemsize"],
            kv_itemsize=info["kv_itemsize"],
        )
