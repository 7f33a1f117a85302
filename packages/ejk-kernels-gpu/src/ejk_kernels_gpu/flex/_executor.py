"""`ejk_executor.Kernel` wrappers of the flex kernels, so the executor picks, caches and
autotunes their `FlexConfig`s (explicit, memory, the persistent cache ``ejk tune`` writes,
then the heuristic or autotuning).

Two kernels, as for flash attention, because the forward and backward configs are tuned
apart: `FlexAttentionForward` times the forward under each forward config,
`FlexAttentionBackward` forward + backward under each backward config. Both take
`planned_flex_attention`'s arguments: q, k, v, the captured arrays and the block lists as
arrays (so tuning inside ``jit`` runs on stand-ins of their shapes), and the translated mods
as `PlannedMods`, a static argument kept out of the cache key: configs are performance
knobs only, so calls with different mods on the same shapes may share a tuned config; a
compiled body they never share (`PlannedMods` compares by its plan, and `compiled_apart`
keeps the executor's bodies apart by it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp

from ejk_executor import Invocation, Kernel

from ._api import planned_flex_attention
from ._config import FlexConfig, bwd_heuristic, bwd_search_space, fwd_heuristic, fwd_search_space
from ._plan import ModPlan

__all__ = ["FlexAttentionBackward", "FlexAttentionForward", "PlannedMods"]


class PlannedMods:
    """A call's translated mods (`ModPlan`) as a static executor argument.

    Its cache key (``__ejk_stable_key__``) says only which mods there are (a score_mod, a
    mask_mod), never what they compute: a config tuned for one score_mod serves another on
    the same shapes. Equality and hashing follow the plan (one `ModPlan` per generated
    source), so anything keyed by the object itself (the executor's eager fast path,
    `Kernel.compiled_apart`) keeps different mods apart.
    """

    __slots__ = ("plan",)

    def __init__(self, plan: ModPlan):
        self.plan = plan

    def __ejk_stable_key__(self) -> list[Any]:
        return ["flex mods", self.plan.score is not None, self.plan.mask is not None]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PlannedMods) and other.plan is self.plan

    def __hash__(self) -> int:
        return hash(self.plan)

    def __repr__(self) -> str:
        return f"PlannedMods({self.plan.key})"


def _shape_info(inv: Invocation[Any, Any]) -> tuple[tuple[int, int], int, int]:
    """``(block_size, head_dim, itemsize)`` of a call, as the heuristics take them."""
    q, v = inv.args[0], inv.args[2]
    head_dim = max(int(q.shape[-1]), int(v.shape[-1]))
    return tuple(inv.kwargs["block_size"]), head_dim, int(jnp.dtype(q.dtype).itemsize)


class _FlexKernel(Kernel[FlexConfig, Any]):
    """What both flex kernels share: the config type, the cached-config check, the mods."""

    config_type = FlexConfig
    cached_cfg_in_space = True  # from disk only what the autotuner can have stored

    def compiled_apart(self, inv: Invocation[FlexConfig, Any]) -> Any:
        return inv.kwargs["mods"]


class FlexAttentionForward(_FlexKernel):
    """The flex forward with its config chosen by the executor:
    ``run(q, k, v, score_caps, mask_caps, kv_blocks, q_blocks, *, mods, block_size,
    softmax_scale)`` returns ``(out, lse)``."""

    name = "ejk_kernels_gpu.flex_attention_fwd"
    version = "1"

    def run(self, q, k, v, score_caps, mask_caps, kv_blocks, q_blocks, *, mods: PlannedMods,
            cfg: FlexConfig, **kwargs: Any) -> Any:  # fmt: skip
        return planned_flex_attention(
            q, k, v, score_caps, mask_caps, kv_blocks, q_blocks, plan=mods.plan,
            return_lse=True, config=cfg, bwd_config=None, **kwargs,
        )  # fmt: skip

    def heuristic_cfg(self, inv: Invocation[FlexConfig, Any]) -> FlexConfig:
        return fwd_heuristic(*_shape_info(inv))

    def config_space(self, inv: Invocation[FlexConfig, Any]) -> Iterable[FlexConfig]:
        return fwd_search_space(*_shape_info(inv))


class FlexAttentionBackward(_FlexKernel):
    """Gradients of ``sum(out * d_out)`` w.r.t. q, k, v, timed per backward config (the
    forward's config its heuristic): ``run(q, k, v, d_out, score_caps, mask_caps, kv_blocks,
    q_blocks, *, mods, block_size, softmax_scale)`` returns ``(dq, dk, dv)``."""

    name = "ejk_kernels_gpu.flex_attention_bwd"
    version = "1"

    def run(self, q, k, v, d_out, score_caps, mask_caps, kv_blocks, q_blocks, *,
            mods: PlannedMods, cfg: FlexConfig, **kwargs: Any) -> Any:  # fmt: skip
        def fwd(q, k, v):
            return planned_flex_attention(
                q, k, v, score_caps, mask_caps, kv_blocks, q_blocks, plan=mods.plan,
                return_lse=False, config=None, bwd_config=cfg, **kwargs,
            )  # fmt: skip

        _, vjp = jax.vjp(fwd, q, k, v)
        return vjp(d_out.astype(q.dtype))

    def heuristic_cfg(self, inv: Invocation[FlexConfig, Any]) -> FlexConfig:
        return bwd_heuristic(*_shape_info(inv))

    def config_space(self, inv: Invocation[FlexConfig, Any]) -> Iterable[FlexConfig]:
        return bwd_search_space(*_shape_info(inv))
