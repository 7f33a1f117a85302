"""The ``pallas`` flex backend: ``ejk_kernels_tpu``'s block-sparse kernels under the mods.

The `BlockMask`'s mask_mod is evaluated in the kernel as its mask function over
``(b, h, q_idx, kv_idx)`` (`ejk_kernels_tpu.ModMask`: the arrays it captures, such as
document ids and prefix lengths, are read per query, per key or per ``(b, h)`` and passed
to the kernels as inputs), and its block tables become the kernels' ``MaskInfo``: empty
blocks are never visited, full ones skip the mask_mod. The score_mod is split the same way
(`ejk_kernels_tpu.ModScore`: ALiBi's ``slopes[h]`` is a per-head input) and applied to
every visited score tile in the forward, dq and dk/dv kernels, its slope (``jax.jvp``
through the tile) turning dP into dS; its float captures get their cotangents from the
chunked XLA pass every flex backend shares (`ejk_sequtils.score_mod_capture_cotangents`).
On TPU the kernels compile with Mosaic; elsewhere they run in Pallas' TPU interpreter.

A captured table read at a position depending on both ``q_idx`` and ``kv_idx`` (a learned
relative-position table, ``table[h, kv_idx - q_idx + T - 1]``) is passed whole (in SMEM)
and looked up on each tile by a loop over the positions the tile reads (a compare and a
select each: Mosaic has no gather on a tile), so it costs VPU work per tile on top of the
matmuls.

Refused, with the reason (the facade then moves on): ``Hv != H``, float16 on TPU, and a
mod reading a captured array at a position depending on both ``q_idx`` and ``kv_idx`` in a
way the lookup does not cover: along two such axes (a dense ``[T, S]`` bias), from a table
that differs per batch row or head before the read, of more than 16384 entries, or a
slice of more than one element.
"""

from __future__ import annotations

from typing import Any

from .._backend import Backend, one_config
from ._request import FlexRequest

__all__ = ["PallasFlexBackend"]


class PallasFlexBackend(Backend):
    """The mods and the `BlockMask` tables in ``ejk_kernels_tpu``'s block-sparse kernels."""

    name = "pallas"

    def supported(self, request: FlexRequest, platform: str) -> str | None:
        del platform  # off TPU the kernels run in Pallas' interpreter
        try:
            import ejk_kernels_tpu
        except ImportError as err:
            return f"ejk_kernels_tpu is not available: {err}"
        return ejk_kernels_tpu.unsupported_mask_mod_reason(
            request, request.mask_mod, score_mod=request.score_mod
        )

    def run(self, request: FlexRequest, config: Any, bwd_config: Any) -> Any:
        config = one_config(config, bwd_config)  # it holds the forward and backward blocks
        from ejk_kernels_tpu import mask_mod_attention

        block_mask, score_mod = request.block_mask, request.score_mod
        if block_mask is None:
            return mask_mod_attention(request, None, None, None, score_mod=score_mod, config=config)
        return mask_mod_attention(
            request,
            block_mask.mask_mod,
            block_mask.kinds,
            block_mask.block_size,
            score_mod=score_mod,
            config=config,
        )
