"""Pallas TPU block-sparse (splash-style) attention kernels and their masks."""

from ._config import BlockSparseConfig as BlockSparseConfig
from ._config import block_sparse_heuristic as block_sparse_heuristic
from ._config import block_sparse_search_space as block_sparse_search_space
from ._config import fits_vmem as fits_vmem
from ._config import vmem_bytes as vmem_bytes
from ._kernel import BlockSparseAttention as BlockSparseAttention
from ._mask_info import MaskInfo as MaskInfo
from ._mask_info import check_mask as check_mask
from ._mask_info import process_dynamic_mask as process_dynamic_mask
from ._mask_info import process_dynamic_mask_dkv as process_dynamic_mask_dkv
from ._mask_info import process_mask as process_mask
from ._mask_info import process_mask_dkv as process_mask_dkv
from ._masks import CausalMask as CausalMask
from ._masks import ChunkedCausalMask as ChunkedCausalMask
from ._masks import FullMask as FullMask
from ._masks import LocalMask as LocalMask
from ._masks import LogicalAnd as LogicalAnd
from ._masks import LogicalOr as LogicalOr
from ._masks import Mask as Mask
from ._masks import MaskTruthValueError as MaskTruthValueError
from ._masks import MultiHeadMask as MultiHeadMask
from ._masks import NumpyMask as NumpyMask
from ._masks import attention_mask as attention_mask
from ._masks import make_causal_mask as make_causal_mask
from ._masks import make_chunk_attention_mask as make_chunk_attention_mask
from ._masks import make_local_attention_mask as make_local_attention_mask
from ._masks import make_random_mask as make_random_mask
from ._ops import blocksparse_attention as blocksparse_attention
from ._ops import blocksparse_attention_request as blocksparse_attention_request
from ._ops import default_interpret as default_interpret
from ._ops import unsupported_reason as unsupported_reason

__all__ = [
    "BlockSparseAttention",
    "BlockSparseConfig",
    "CausalMask",
    "ChunkedCausalMask",
    "FullMask",
    "LocalMask",
    "LogicalAnd",
    "LogicalOr",
    "Mask",
    "MaskInfo",
    "MaskTruthValueError",
    "MultiHeadMask",
    "NumpyMask",
    "attention_mask",
    "block_sparse_heuristic",
    "block_sparse_search_space",
    "blocksparse_attention",
    "blocksparse_attention_request",
    "check_mask",
    "default_interpret",
    "fits_vmem",
    "make_causal_mask",
    "make_chunk_attention_mask",
    "make_local_attention_mask",
    "make_random_mask",
    "process_dynamic_mask",
    "process_dynamic_mask_dkv",
    "process_mask",
    "process_mask_dkv",
    "unsupported_reason",
    "vmem_bytes",
]
