"""The ``triton`` flex backend: ``ejk_kernels_gpu.flex``'s kernels with the mods compiled in.

The score_mod and the `BlockMask`'s mask_mod are translated into Triton functions (their
captured arrays become kernel arguments), and the mask's block lists (`BlockMask.kv_blocks`
for the forward and dq, `BlockMask.q_blocks` for dk/dv) tell the kernels which blocks to
visit: empty ones never, full ones without the mask_mod. On a GPU they compile; elsewhere
they run in Triton's interpreter.

Refused, with the reason (the facade then moves on): Triton not installed; a mod using a
primitive, or a captured array's dtype, the translation lacks (named in the reason); block
sizes other than powers of two in [16, 256] (the kernels walk the mask's blocks in tiles
that divide them); head dims above 256; dtypes other than float16, bfloat16 and float32.
"""

from __future__ import annotations

from typing import Any

from .._backend import Backend, triton_missing
from ._request import FlexRequest

__all__ = ["TritonFlexBackend"]


def _block_size(request: FlexRequest) -> tuple[int, int]:
    """The blocks the kernels walk: the block mask's, or the kernels' default without one."""
    if request.block_mask is not None:
        return request.block_mask.block_size
    from ejk_kernels_gpu.flex import default_block_size

    _, q_len, kv_len, *_ = request.shape
    return default_block_size(q_len, kv_len)


class TritonFlexBackend(Backend):
    """The mods and the `BlockMask` lists in ``ejk_kernels_gpu``'s flex kernels."""

    name = "triton"

    def supported(self, request: FlexRequest, platform: str) -> str | None:
        del platform  # off GPU the kernels run in Triton's interpreter
        missing = triton_missing()
        if missing:
            return missing
        try:
            from ejk_kernels_gpu.flex import unsupported_flex_reason
        except ImportError as err:
            return f"ejk_kernels_gpu is not available: {err}"
        q, k, v = request.q, request.k, request.v
        block = _block_size(request)
        return unsupported_flex_reason(q, k, v, request.score_mod, request.mask_mod, block)

    def run(self, request: FlexRequest, config: Any, bwd_config: Any) -> Any:
        del bwd_config  # one config serves the forward and backward launches
        from ejk_kernels_gpu.flex import flex_attention

        block_mask = request.block_mask
        kv_blocks = q_blocks = None
        if block_mask is not None:
            kv_blocks, q_blocks = tuple(block_mask.kv_blocks()), tuple(block_mask.q_blocks())
        return flex_attention(
            request.q,
            request.k,
            request.v,
            score_mod=request.score_mod,
            mask_mod=request.mask_mod,
            kv_blocks=kv_blocks,
            q_blocks=q_blocks,
            block_size=_block_size(request),
            softmax_scale=request.softmax_scale,
            return_lse=request.return_lse,
            config=config,
        )
