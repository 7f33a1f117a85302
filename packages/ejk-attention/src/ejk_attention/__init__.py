"""One attention API over every ejk backend: XLA reference, Triton, Pallas, sharding, ring attention and the `ejk` CLI."""

from ._reference import dropout_keep_mask as dropout_keep_mask
from ._reference import reference_attention as reference_attention
from ._reference import visibility_mask as visibility_mask

__all__ = ["dropout_keep_mask", "reference_attention", "visibility_mask"]
