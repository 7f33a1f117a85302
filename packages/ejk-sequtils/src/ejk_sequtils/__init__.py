"""Packed sequences, cu_seqlens, segment ids and attention masks for JAX (jax + numpy only)."""

from ._cu_seqlens import cdiv as cdiv
from ._cu_seqlens import cu_seqlens_to_segment_ids as cu_seqlens_to_segment_ids
from ._cu_seqlens import position_ids_to_segment_ids as position_ids_to_segment_ids
from ._cu_seqlens import prepare_chunk_indices as prepare_chunk_indices
from ._cu_seqlens import prepare_chunk_offsets as prepare_chunk_offsets
from ._cu_seqlens import prepare_lens as prepare_lens
from ._cu_seqlens import prepare_position_ids as prepare_position_ids
from ._cu_seqlens import prepare_sequence_ids as prepare_sequence_ids
from ._cu_seqlens import prepare_token_indices as prepare_token_indices
from ._cu_seqlens import segment_ids_to_cu_seqlens as segment_ids_to_cu_seqlens
from ._cu_seqlens import segment_ids_to_position_ids as segment_ids_to_position_ids
from ._masks import is_segment_representable as is_segment_representable
from ._masks import mask_to_segment_ids as mask_to_segment_ids
from ._masks import prepare_cu_seqlens_from_mask as prepare_cu_seqlens_from_mask
from ._masks import prepare_lens_from_mask as prepare_lens_from_mask
from ._masks import segment_ids_to_mask as segment_ids_to_mask
from ._numerics import chunk_array as chunk_array
from ._numerics import identity_dtype_convert as identity_dtype_convert
from ._numerics import log_sum_exp as log_sum_exp
from ._numerics import safe_divide as safe_divide
from ._numerics import unchunk_array as unchunk_array
from ._packing import pack_sequences as pack_sequences
from ._testing import assert_allclose as assert_allclose
from ._testing import generate_attention_inputs as generate_attention_inputs

__all__ = [
    "assert_allclose",
    "cdiv",
    "chunk_array",
    "cu_seqlens_to_segment_ids",
    "generate_attention_inputs",
    "identity_dtype_convert",
    "is_segment_representable",
    "log_sum_exp",
    "mask_to_segment_ids",
    "pack_sequences",
    "position_ids_to_segment_ids",
    "prepare_chunk_indices",
    "prepare_chunk_offsets",
    "prepare_cu_seqlens_from_mask",
    "prepare_lens",
    "prepare_lens_from_mask",
    "prepare_position_ids",
    "prepare_sequence_ids",
    "prepare_token_indices",
    "safe_divide",
    "segment_ids_to_cu_seqlens",
    "segment_ids_to_mask",
    "segment_ids_to_position_ids",
    "unchunk_array",
]
