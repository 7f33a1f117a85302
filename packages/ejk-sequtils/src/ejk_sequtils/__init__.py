"""Packed sequences, cu_seqlens, segment ids, masks, and the definition of attention (jax + numpy only).

The definition every ejk backend follows lives here, below the kernels: the
visibility rules (`visibility_mask`), the dropout keep-mask (`dropout_keep_mask`),
the float32 reference (`reference_attention`) and the validation of a call
(`validate_attention`, returning the `AttentionRequest` every backend receives), and
the same for paged attention in serving (`validate_paged_attention`,
`paged_reference_attention`), with what an FP8 KV page means (`dequantize_kv`,
`quantize_kv`), and the cotangents of a flex score_mod's captured arrays that every flex
kernel shares (`score_mod_capture_cotangents`).
"""

from ._checks import describe_value as describe_value
from ._cu_seqlens import cdiv as cdiv
from ._cu_seqlens import cu_seqlens_to_segment_ids as cu_seqlens_to_segment_ids
from ._cu_seqlens import cu_seqlens_valid as cu_seqlens_valid
from ._cu_seqlens import poison_unless as poison_unless
from ._cu_seqlens import position_ids_to_segment_ids as position_ids_to_segment_ids
from ._cu_seqlens import prepare_chunk_indices as prepare_chunk_indices
from ._cu_seqlens import prepare_chunk_offsets as prepare_chunk_offsets
from ._cu_seqlens import prepare_lens as prepare_lens
from ._cu_seqlens import prepare_position_ids as prepare_position_ids
from ._cu_seqlens import prepare_sequence_ids as prepare_sequence_ids
from ._cu_seqlens import prepare_token_indices as prepare_token_indices
from ._cu_seqlens import segment_ids_to_cu_seqlens as segment_ids_to_cu_seqlens
from ._cu_seqlens import segment_ids_to_position_ids as segment_ids_to_position_ids
from ._dropout import DROPOUT_HASH as DROPOUT_HASH
from ._dropout import dropout_keep_mask as dropout_keep_mask
from ._dropout import dropout_key as dropout_key
from ._dropout import dropout_seed_u32 as dropout_seed_u32
from ._dropout import dropout_threshold as dropout_threshold
from ._kv_quant import FP8_KV_DTYPE as FP8_KV_DTYPE
from ._kv_quant import FP8_KV_MAX as FP8_KV_MAX
from ._kv_quant import dequantize_kv as dequantize_kv
from ._kv_quant import quantize_kv as quantize_kv
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
from ._paged import PagedAttentionRequest as PagedAttentionRequest
from ._paged import gather_pages as gather_pages
from ._paged import paged_reference_attention as paged_reference_attention
from ._paged import paged_visibility as paged_visibility
from ._paged import ragged_rows as ragged_rows
from ._paged import validate_paged_attention as validate_paged_attention
from ._reference import fold_sinks as fold_sinks
from ._reference import reference_attention as reference_attention
from ._request import AttentionRequest as AttentionRequest
from ._request import validate_attention as validate_attention
from ._score_mod_grads import score_mod_capture_cotangents as score_mod_capture_cotangents
from ._testing import assert_allclose as assert_allclose
from ._testing import generate_attention_inputs as generate_attention_inputs
from ._testing import random_document_ids as random_document_ids
from ._tolerances import ATTENTION_TOLERANCES as ATTENTION_TOLERANCES
from ._tolerances import attention_tolerance as attention_tolerance
from ._varying import varying_axes as varying_axes
from ._varying import varying_like as varying_like
from ._visibility import normalize_window as normalize_window
from ._visibility import visibility_mask as visibility_mask
from ._zigzag import causal_shard_work as causal_shard_work
from ._zigzag import from_zigzag as from_zigzag
from ._zigzag import to_zigzag as to_zigzag
from ._zigzag import zigzag_chunks as zigzag_chunks
from ._zigzag import zigzag_positions as zigzag_positions

__all__ = [
    "ATTENTION_TOLERANCES",
    "DROPOUT_HASH",
    "FP8_KV_DTYPE",
    "FP8_KV_MAX",
    "AttentionRequest",
    "PagedAttentionRequest",
    "assert_allclose",
    "attention_tolerance",
    "causal_shard_work",
    "cdiv",
    "chunk_array",
    "cu_seqlens_to_segment_ids",
    "cu_seqlens_valid",
    "dequantize_kv",
    "describe_value",
    "dropout_keep_mask",
    "dropout_key",
    "dropout_seed_u32",
    "dropout_threshold",
    "fold_sinks",
    "from_zigzag",
    "gather_pages",
    "generate_attention_inputs",
    "identity_dtype_convert",
    "is_segment_representable",
    "log_sum_exp",
    "mask_to_segment_ids",
    "normalize_window",
    "pack_sequences",
    "paged_reference_attention",
    "paged_visibility",
    "poison_unless",
    "position_ids_to_segment_ids",
    "prepare_chunk_indices",
    "prepare_chunk_offsets",
    "prepare_cu_seqlens_from_mask",
    "prepare_lens",
    "prepare_lens_from_mask",
    "prepare_position_ids",
    "prepare_sequence_ids",
    "prepare_token_indices",
    "quantize_kv",
    "ragged_rows",
    "random_document_ids",
    "reference_attention",
    "safe_divide",
    "score_mod_capture_cotangents",
    "segment_ids_to_cu_seqlens",
    "segment_ids_to_mask",
    "segment_ids_to_position_ids",
    "to_zigzag",
    "unchunk_array",
    "validate_attention",
    "validate_paged_attention",
    "varying_axes",
    "varying_like",
    "visibility_mask",
    "zigzag_chunks",
    "zigzag_positions",
]
