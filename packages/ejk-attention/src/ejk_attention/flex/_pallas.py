"""The ``pallas`` flex backend: ``ejk_kernels_tpu``'s block-sparse kernels under the mask_mod.

The `BlockMask`'s mask_mod is evaluated in the kernel as its mask function over
``(b, h, q_idx, kv_idx)`` (`ejk_kernels_tpu.ModMask`: the arrays it captures, such as
document ids and prefix lengths, are read per query, per key or per ``(b, h)`` and passed
to the kernels as inputs), and its block tables become the kernels' ``MaskInfo``: empty
blocks are never visited, full ones skip the mask_mod. On TPU the kernels compile with
Mosaic; elsewhere they run in Pallas' TPU interpreter.

Refused, with the reason (the facade then moves on): a ``score_mod`` (the kernels have no
score_mod path yet), ``Hv != H``, float16 on TPU, and a mask_mod that reads a captured
array at a position depending on both ``q_idx`` and ``kv_idx``.
"""

from __future__ import annotations

from typing import Any

from .._backend import Backend, one_config
from ._request import FlexRequest

__all__ = ["PallasFlexBackend"]


class PallasFlexBackend(Backend):
    """The mask_mod and the `BlockMask` tables in ``ejk_kernels_tpu``'s block-sparse kernels."""

    name = "pallas"

    def supported(self, request: FlexRequest, platform: str) -> str | None:
        del platform  # off TPU the kernels run in Pallas' interpreter
        try:
            import ejk_kernels_tpu
        except ImportError as err:
            return f"ejk_kernels_tpu is not available: {err}"
        if request.score_mod is not None:
            return (
                "the Pallas flex kernels take no score_mod yet (issue 62's TPU part ships the "
                "mask_mod only): use 'xla'"
            )
        return ejk_kernels_tpu.unsupported_mask_mod_reason(request, request.mask_mod)

    def run(self, request: FlexRequest, config: Any, bwd_config: Any) -> Any:
        config = one_config(config, bwd_config)  # it holds the forward and backward blocks
        from ejk_kernels_tpu import mask_mod_attention

        block_mask = request.block_mask
        if block_mask is None:
            return mask_mod_attention(request, None, None, None, config=config)
        return mask_mod_attention(
            request, block_mask.mask_mod, block_mask.kinds, block_mask.block_size, config=config
        )
