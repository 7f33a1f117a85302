"""The ``triton`` flex backend: ``ejk_kernels_gpu.flex``'s kernels with the mods compiled in.

The score_mod and the `BlockMask`'s mask_mod are translated into Triton functions (their
captured arrays become kernel arguments), and the mask's block lists (`BlockMask.kv_blocks`
for the forward and dq, `BlockMask.q_blocks` for dk/dv) tell the kernels which blocks to
visit: empty ones never, full ones without the mask_mod. On a GPU they compile; elsewhere
they run in Triton's interpreter. ejk's own masks without a score_mod (`_builtin`) run on
the backend's built-in kernels instead (the same call as `flash_attention` with ``causal``,
``sliding_window``, ``segment_ids``). The forward and backward `FlexConfig`s are the given ones,
else the executor's (`invocations`: the same chain as the dense kernels', so ``ejk tune``'s
persistent cache and autotuning serve them).

Refused, with the reason (the facade then moves on): Triton not installed; a mod using a
primitive, or a captured array's dtype, the translation lacks (named in the reason); block
sizes other than powers of two in [16, 256] (the kernels walk the mask's blocks in tiles
that divide them); head dims above 256; dtypes other than float16, bfloat16 and float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejk_executor import Invocation

from .._backend import Backend, platform_of, triton_missing
from ._builtin import builtin_request
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

    def __init__(self, builtin: Backend | None = None):
        """``builtin``: the flash backend that runs ejk's own masks without a score_mod
        (`_builtin`); None: the flex kernels run every call."""
        self.builtin = builtin

    def supported(self, request: FlexRequest, platform: str) -> str | None:
        del platform  # off GPU the kernels run in Triton's interpreter
        if self._routed(request) is not None:
            return None
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

    def invocations(self, request: FlexRequest) -> dict[str, Any]:
        """The executor's flex kernels (`ejk_kernels_gpu.flex.FlexAttentionForward`,
        ``...Backward``) on this call: q, k, v, the mods' captures and the block lists as
        arrays, the translated mods static and out of the cache key (a config tuned on
        these shapes serves any mods); the backward's ``d_out`` is the output's shape."""
        from ejk_kernels_gpu import flex

        plan, consts = flex.plan_mods(request.score_mod, request.mask_mod)
        n_score = plan.score_captures
        kv_blocks, q_blocks = _block_lists(request)
        arrays = (list(consts[:n_score]), list(consts[n_score:]), kv_blocks, q_blocks)
        kw = dict(
            mods=flex.PlannedMods(plan),
            block_size=_block_size(request),
            softmax_scale=float(request.softmax_scale),
        )
        q, k, v = request.q, request.k, request.v
        d_out = jax.ShapeDtypeStruct((*q.shape[:3], v.shape[3]), jnp.dtype(q.dtype))
        return {
            "forward": Invocation.make(flex.FlexAttentionForward(), (q, k, v, *arrays), kw),
            "backward": Invocation.make(
                flex.FlexAttentionBackward(), (q, k, v, d_out, *arrays), kw
            ),
        }

    def run_configured(
        self, request: FlexRequest, config: Any = None, bwd_config: Any = None
    ) -> Any:
        """ejk's own masks without a score_mod (and no config given for the flex kernels):
        the `triton` backend's built-in kernels on the same call (`_builtin`), where it
        serves it; everything else on the flex kernels."""
        flash = self._routed(request) if config is None and bwd_config is None else None
        if flash is not None:
            return self.builtin.run_configured(flash)
        return super().run_configured(request, config, bwd_config)

    def _routed(self, request: FlexRequest) -> Any:
        """``request`` as the built-in backend's request where that backend serves it, else None."""
        flash = None if self.builtin is None else builtin_request(request)
        if flash is None or self.builtin.supported(flash, platform_of(flash)) is not None:
            return None
        return flash

    def run(self, request: FlexRequest, config: Any, bwd_config: Any) -> Any:
        from ejk_kernels_gpu.flex import flex_attention

        kv_blocks, q_blocks = _block_lists(request)
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
            bwd_config=bwd_config,
        )


def _block_lists(request: FlexRequest) -> tuple[Any, Any]:
    """``(kv_blocks, q_blocks)``: the block mask's lists as int32 jax arrays (a NumPy array
    would get random stand-ins when tuning), or None without a mask (every block full)."""
    if request.block_mask is None:
        return None, None
    kv_blocks, q_blocks = request.block_mask.kv_blocks(), request.block_mask.q_blocks()
    as_arrays = lambda lists: tuple(jnp.asarray(x, jnp.int32) for x in lists)
    return as_arrays(kv_blocks), as_arrays(q_blocks)
