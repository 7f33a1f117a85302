"""The blocks context parallelism runs (public: `ejk_attention`'s ring and all-gather calls use
them): one shard's forward and backward on global positions, with its masks."""

from ._blocks import BlockMasks as BlockMasks
from ._blocks import block_backward as block_backward
from ._blocks import block_forward as block_forward
from ._blocks import block_options as block_options

__all__ = ["BlockMasks", "block_backward", "block_forward", "block_options"]
