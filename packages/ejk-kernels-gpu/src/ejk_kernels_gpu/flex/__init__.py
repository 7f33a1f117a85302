"""Flex attention in Triton: a user's score_mod and mask_mod translated into the kernels
(`flex._translate`, `flex._plan`), block lists instead of dense masks (`flex._api`), the
launches (`flex._launch`), the custom VJP (`flex._vjp`) and the captures' cotangents in
XLA (`flex._capture_grads`)."""

from ._api import default_block_size as default_block_size
from ._api import flex_attention as flex_attention
from ._api import unsupported_flex_reason as unsupported_flex_reason
from ._config import FlexConfig as FlexConfig
from ._config import flex_heuristic as flex_heuristic

__all__ = [
    "FlexConfig",
    "default_block_size",
    "flex_attention",
    "flex_heuristic",
    "unsupported_flex_reason",
]
