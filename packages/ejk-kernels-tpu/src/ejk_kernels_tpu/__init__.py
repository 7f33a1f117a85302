"""Pallas TPU block-sparse (splash-style) attention kernels and their masks."""

from ._mask_info import MaskInfo as MaskInfo
from ._mask_info import process_dynamic_mask as process_dynamic_mask
from ._mask_info import process_dynamic_mask_dkv as process_dynamic_mask_dkv
from ._mask_info import process_mask as process_mask
from ._mask_info import process_mask_dkv as process_mask_dkv
from ._masks import CausalMask as CausalMask
from ._masks import ChunkedCausalMask as ChunkedCausalMask
from ._masks import FullMask as FullMask
from ._masks import LocalMask as LocalMask
from ._masks import Mask as Mask
from ._masks import MultiHeadMask as MultiHeadMask
from ._masks import NumpyMask as NumpyMask

__all__ = [
    "CausalMask",
    "ChunkedCausalMask",
    "FullMask",
    "LocalMask",
    "Mask",
    "MaskInfo",
    "MultiHeadMask",
    "NumpyMask",
    "process_dynamic_mask",
    "process_dynamic_mask_dkv",
    "process_mask",
    "process_mask_dkv",
]
