"""FlexAttention for JAX: attention with a user's ``score_mod`` and a block-sparse ``mask_mod``.

``ejk_attention.flex_attention(q, k, v, score_mod, block_mask)`` (in `_flex`, beside the
other entry points: it dispatches through `_backends`, which holds this package's backends
as the ``flex`` parts) has PyTorch FlexAttention's meaning in ejk's ``[B, T, N, H]`` layout;
`create_block_mask` summarises a mask_mod per block (empty, partial, full) for the kernels;
the common mask_mods and `and_masks`/`or_masks` build masks.
"""

from ._block_mask import BlockIndices as BlockIndices
from ._block_mask import BlockMask as BlockMask
from ._block_mask import create_block_mask as create_block_mask
from ._mods import and_masks as and_masks
from ._mods import causal_mask as causal_mask
from ._mods import document_mask as document_mask
from ._mods import or_masks as or_masks
from ._mods import prefix_lm_mask as prefix_lm_mask
from ._mods import sliding_window_mask as sliding_window_mask

__all__ = [
    "BlockIndices",
    "BlockMask",
    "and_masks",
    "causal_mask",
    "create_block_mask",
    "document_mask",
    "or_masks",
    "prefix_lm_mask",
    "sliding_window_mask",
]
