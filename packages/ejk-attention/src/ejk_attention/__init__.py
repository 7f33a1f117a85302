"""One attention API over every ejk backend: XLA (jnp with a custom VJP), Triton, Pallas, sharding, ring attention and the `ejk` CLI."""

from ejk_sequtils import dropout_keep_mask as dropout_keep_mask
from ejk_sequtils import reference_attention as reference_attention
from ejk_sequtils import visibility_mask as visibility_mask

from ._backends import IMPLEMENTATIONS as IMPLEMENTATIONS
from ._blocksparse import blocksparse_attention as blocksparse_attention
from ._dpa import dot_product_attention as dot_product_attention
from ._flash import flash_attention as flash_attention
from ._flex import flex_attention as flex_attention
from ._kv_cache import PagedKVCache as PagedKVCache
from ._paged import paged_attention as paged_attention
from ._paged import ragged_paged_attention as ragged_paged_attention
from ._ring import ring_attention as ring_attention
from .flex import BlockMask as BlockMask
from .flex import and_masks as and_masks
from .flex import causal_mask as causal_mask
from .flex import create_block_mask as create_block_mask
from .flex import document_mask as document_mask
from .flex import or_masks as or_masks
from .flex import prefix_lm_mask as prefix_lm_mask
from .flex import sliding_window_mask as sliding_window_mask

__all__ = [
    "IMPLEMENTATIONS",
    "BlockMask",
    "PagedKVCache",
    "and_masks",
    "blocksparse_attention",
    "causal_mask",
    "create_block_mask",
    "document_mask",
    "dot_product_attention",
    "dropout_keep_mask",
    "flash_attention",
    "flex_attention",
    "or_masks",
    "paged_attention",
    "prefix_lm_mask",
    "ragged_paged_attention",
    "reference_attention",
    "ring_attention",
    "sliding_window_mask",
    "visibility_mask",
]
