"""One attention API over every ejk backend: XLA reference, Triton, Pallas, sharding, ring attention and the `ejk` CLI."""

from ejk_sequtils import dropout_keep_mask as dropout_keep_mask
from ejk_sequtils import reference_attention as reference_attention
from ejk_sequtils import visibility_mask as visibility_mask

from ._backends import IMPLEMENTATIONS as IMPLEMENTATIONS
from ._blocksparse import blocksparse_attention as blocksparse_attention
from ._dpa import dot_product_attention as dot_product_attention
from ._flash import flash_attention as flash_attention
from ._kv_cache import PagedKVCache as PagedKVCache
from ._paged import paged_attention as paged_attention
from ._paged import ragged_paged_attention as ragged_paged_attention
from ._ring import ring_attention as ring_attention

__all__ = [
    "IMPLEMENTATIONS",
    "PagedKVCache",
    "blocksparse_attention",
    "dot_product_attention",
    "dropout_keep_mask",
    "flash_attention",
    "paged_attention",
    "ragged_paged_attention",
    "reference_attention",
    "ring_attention",
    "visibility_mask",
]
