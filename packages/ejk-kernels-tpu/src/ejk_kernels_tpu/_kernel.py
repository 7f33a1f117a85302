"""`BlockSparseAttention`: the block-sparse kernels as an `ejk_executor.Kernel`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ejk_executor import Invocation, Kernel

from ._config import BlockSparseConfig, block_sparse_heuristic, block_sparse_search_space
from ._ops import blocksparse_attention

__all__ = ["BlockSparseAttention"]


class BlockSparseAttention(Kernel[BlockSparseConfig, Any]):
    """`blocksparse_attention` run through an `ejk_executor.Executor` (config selection, tuning).

    Call as ``executor(BlockSparseAttention(), q, k, v, mask=mask, segment_ids=...,
    softmax_scale=..., logits_soft_cap=..., softmax_sinks=..., return_lse=...)``; the
    mask (hashable) and the other non-array arguments are static parts of the cache key.
    Gradients come from the kernels' own custom_vjp. A config holds the block sizes of the
    forward and both backward kernels, so one selection serves the whole training step: the
    facade takes ``executor.choose(BlockSparseAttention(), q, k, v, mask=...).cfg`` and runs
    its validated request with ``blocksparse_attention_request(request, mask, config=cfg)``.
    """

    name = "ejk_kernels_tpu.blocksparse_attention"
    version = "1"
    config_type = BlockSparseConfig
    cached_cfg_in_space = True  # from disk only what the autotuner can have stored

    def run(self, q, k, v, *, cfg: BlockSparseConfig, mask=None, **kwargs: Any) -> Any:
        return blocksparse_attention(q, k, v, mask, config=cfg, **kwargs)

    @staticmethod
    def _sizes(inv: Invocation[BlockSparseConfig, Any]) -> tuple[int, int, int, int]:
        q, k = inv.abstract_args[0], inv.abstract_args[1]
        return q.shape[1], k.shape[1], q.shape[3], q.dtype.itemsize

    def heuristic_cfg(self, inv: Invocation[BlockSparseConfig, Any]) -> BlockSparseConfig:
        return block_sparse_heuristic(*self._sizes(inv))

    def config_space(self, inv: Invocation[BlockSparseConfig, Any]) -> Iterable[BlockSparseConfig]:
        if inv.platform != "pallas":
            # Off TPU the kernels run in the interpreter: timing candidates there measures
            # nothing about a TPU, so only the heuristic config is offered.
            return [self.heuristic_cfg(inv)]
        return block_sparse_search_space(*self._sizes(inv))
