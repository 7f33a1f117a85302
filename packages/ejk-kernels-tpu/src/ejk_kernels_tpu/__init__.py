"""Pallas TPU block-sparse (splash-style) attention kernels and their masks (static masks,
and a user's mask_mod with its block kinds table and a score_mod: the flex path), and the
ragged paged attention kernel for serving."""

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
from ._mask_mod import ModMask as ModMask
from ._mask_mod import ModScore as ModScore
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
from ._mod_ops import mask_mod_attention as mask_mod_attention
from ._mod_ops import unsupported_mask_mod_reason as unsupported_mask_mod_reason
from ._ops import blocksparse_attention as blocksparse_attention
from ._ops import blocksparse_attention_request as blocksparse_attention_request
from ._ops import default_interpret as default_interpret
from ._ops import unsupported_reason as unsupported_reason
from ._paged_api import default_paged_config as default_paged_config
from ._paged_api import paged_attention as paged_attention
from ._paged_api import paged_attention_request as paged_attention_request
from ._paged_api import request_shape as request_shape
from ._paged_api import unsupported_paged_reason as unsupported_paged_reason
from ._paged_config import PagedShape as PagedShape
from ._paged_config import RaggedPagedConfig as RaggedPagedConfig
from ._paged_config import fits_paged_vmem as fits_paged_vmem
from ._paged_config import paged_shape as paged_shape
from ._paged_config import paged_vmem_bytes as paged_vmem_bytes
from ._paged_config import ragged_paged_heuristic as ragged_paged_heuristic
from ._paged_config import ragged_paged_search_space as ragged_paged_search_space
from ._paged_executor import RaggedPagedAttention as RaggedPagedAttention

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
    "ModMask",
    "ModScore",
    "MultiHeadMask",
    "NumpyMask",
    "PagedShape",
    "RaggedPagedAttention",
    "RaggedPagedConfig",
    "attention_mask",
    "block_sparse_heuristic",
    "block_sparse_search_space",
    "blocksparse_attention",
    "blocksparse_attention_request",
    "check_mask",
    "default_interpret",
    "default_paged_config",
    "fits_paged_vmem",
    "fits_vmem",
    "make_causal_mask",
    "make_chunk_attention_mask",
    "make_local_attention_mask",
    "make_random_mask",
    "mask_mod_attention",
    "paged_attention",
    "paged_attention_request",
    "paged_shape",
    "paged_vmem_bytes",
    "process_dynamic_mask",
    "process_dynamic_mask_dkv",
    "process_mask",
    "process_mask_dkv",
    "ragged_paged_heuristic",
    "ragged_paged_search_space",
    "request_shape",
    "unsupported_mask_mod_reason",
    "unsupported_paged_reason",
    "unsupported_reason",
    "vmem_bytes",
]
