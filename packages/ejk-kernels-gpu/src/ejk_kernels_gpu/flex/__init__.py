"""Flex attention in Triton: a user's score_mod and mask_mod translated into the kernels
(`flex._translate`, `flex._plan`), block lists instead of dense masks (`flex._api`), the
launches (`flex._launch`), the custom VJP (`flex._vjp`; the captures' cotangents in XLA
come from `ejk_sequtils.score_mod_capture_cotangents`) and the executor's kernels choosing
the configs (`flex._executor`)."""

from ._api import default_block_size as default_block_size
from ._api import flex_attention as flex_attention
from ._api import planned_flex_attention as planned_flex_attention
from ._api import unsupported_flex_reason as unsupported_flex_reason
from ._config import FlexConfig as FlexConfig
from ._config import bwd_heuristic as bwd_heuristic
from ._config import fwd_heuristic as fwd_heuristic
from ._executor import FlexAttentionBackward as FlexAttentionBackward
from ._executor import FlexAttentionForward as FlexAttentionForward
from ._executor import PlannedMods as PlannedMods
from ._plan import plan_mods as plan_mods

__all__ = [
    "FlexAttentionBackward",
    "FlexAttentionForward",
    "FlexConfig",
    "PlannedMods",
    "bwd_heuristic",
    "default_block_size",
    "flex_attention",
    "fwd_heuristic",
    "plan_mods",
    "planned_flex_attention",
    "unsupported_flex_reason",
]
