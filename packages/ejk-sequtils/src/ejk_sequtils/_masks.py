"""Attention masks: from segment ids, back to segment ids, and to sequence lengths.

Segment ids ``int [*B, T]``: tokens attend only within equal non-negative ids; any
negative id is padding (it sees nothing and is seen by nothing), and 0 is an ordinary
segment, as in ejKernel and JAX's splash attention. Ids made here number segments from 0
and give padding -1 (or ``padding_id``).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int, Shaped

from ._checks import check_integer_array

# Public functions take jax or NumPy arrays alike.
AnyArray = Array | np.ndarray


def _check_mask(mask, name: str, ndim: int) -> None:
    if mask.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {name}.shape={tuple(mask.shape)}")


def prepare_lens_from_mask(mask: Shaped[AnyArray, "B T"]) -> Int[Array, " B"]:
    """The number of valid tokens in each row of a padding mask.

    The valid tokens need not be left-aligned: every True counts.

    Args:
        mask: ``[B, T]`` bool (or 0/1) padding mask, True for a real token.

    Returns:
        int32 ``[B]`` lengths.
    """
    _check_mask(mask, "mask", 2)
    return (jnp.asarray(mask) != 0).sum(axis=-1, dtype=jnp.int32)


def prepare_cu_seqlens_from_mask(
    mask: Shaped[AnyArray, "B T"], out_dtype: jnp.dtype | type = jnp.int32
) -> Int[Array, " C"]:
    """Cumulative lengths of the rows of a padding mask, as packed one after another.

    They describe ``x[mask]`` (the valid tokens in row-major order), so a mask that is not
    left-aligned is fine. ``[[1, 1, 1, 0], [1, 1, 0, 0]]`` gives ``[0, 3, 5]``.

    Args:
        mask: ``[B, T]`` bool (or 0/1) padding mask.
        out_dtype: integer dtype of the result.

    Returns:
        ``[B + 1]`` cumulative lengths starting at 0.
    """
    if not jnp.issubdtype(out_dtype, jnp.integer):
        raise TypeError(f"out_dtype must be an integer dtype, got {out_dtype=}")
    lens = prepare_lens_from_mask(mask)
    return jnp.pad(jnp.cumsum(lens, dtype=out_dtype), (1, 0))


def segment_ids_to_mask(
    segment_ids: Int[AnyArray, "*B T"] | tuple[Int[AnyArray, "*B T"], Int[AnyArray, "*B S"]],
    dtype: jnp.dtype | type = jnp.bool_,
    return_separate_masks: bool = False,
) -> (
    Shaped[Array, "*B T S"]
    | tuple[Shaped[Array, "*B T"], Shaped[Array, "*B S"], Shaped[Array, "*B T S"]]
):
    """The attention mask of segment ids: query i sees key j when both ids are equal and >= 0.

    Args:
        segment_ids: ``[*B, T]`` ids for self-attention (then S = T), or a pair
            ``(q_segment_ids [*B, T], kv_segment_ids [*B, S])`` for cross-attention.
            Negative ids are padding (0 is an ordinary segment).
        dtype: dtype of the masks (bool, or a number type giving 0/1).
        return_separate_masks: also return the query and key padding masks.

    Returns:
        ``[*B, T, S]`` attention mask; with ``return_separate_masks``, the tuple
        ``(q_mask [*B, T], kv_mask [*B, S], attention_mask [*B, T, S])``, the first two
        True where the id is ``>= 0``.
    """
    if isinstance(segment_ids, tuple | list):
        if len(segment_ids) != 2:
            raise ValueError(
                f"segment_ids must be an array or a (q, kv) pair, got a sequence of {len(segment_ids)}"
            )
        q_ids, kv_ids = segment_ids
        check_integer_array(q_ids, "q_segment_ids")
        check_integer_array(kv_ids, "kv_segment_ids")
        if q_ids.ndim == 0 or q_ids.shape[:-1] != kv_ids.shape[:-1]:
            raise ValueError(
                "q_segment_ids and kv_segment_ids must share their leading (batch) axes, got "
                f"shapes {tuple(q_ids.shape)} and {tuple(kv_ids.shape)}"
            )
    else:
        check_integer_array(segment_ids, "segment_ids")
        if segment_ids.ndim == 0:
            raise ValueError("segment_ids must have at least one axis, got a scalar")
        q_ids = kv_ids = segment_ids
    q_mask, kv_mask, mask = _segment_mask(jnp.asarray(q_ids), jnp.asarray(kv_ids), jnp.dtype(dtype))
    if return_separate_masks:
        return q_mask, kv_mask, mask
    return mask


@partial(jax.jit, static_argnums=2)
def _segment_mask(q_ids: Array, kv_ids: Array, dtype) -> tuple[Array, Array, Array]:
    # One fused pass over [*B, T, S]; eagerly each op would write a full-size array.
    q_valid, kv_valid = q_ids >= 0, kv_ids >= 0
    mask = (q_ids[..., :, None] == kv_ids[..., None, :]) & q_valid[..., :, None]
    return q_valid.astype(dtype), kv_valid.astype(dtype), mask.astype(dtype)


# Rows per block in the passes over a [Q, K] mask. XLA on CPU materialises a full
# int32 [Q, K] select before reducing it, and argmax down a column is slow; reducing
# 256 rows at a time keeps each select in cache (about 10x faster at Q = K = 4096,
# with 4 MiB instead of 64 MiB of temporaries).
_BLOCK_ROWS = 256


def _fold_row_blocks(mask: Array, body, init):
    """``body(rows, start, block, carry)`` over blocks of ``mask`` rows, carrying ``carry``.

    Blocks have a fixed height; the last starts at ``Q - height`` and so overlaps the one
    before, which every caller tolerates (min/max reductions, idempotent writes).
    """
    q_len = mask.shape[0]
    height = min(_BLOCK_ROWS, q_len)
    num_blocks = -(-q_len // height) if q_len else 0

    def step(b, carry):
        start = jnp.minimum(b * height, q_len - height)
        block = jax.lax.dynamic_slice_in_dim(mask, start, height, axis=0)
        return body(block, start, height, carry)

    return jax.lax.fori_loop(0, num_blocks, step, init)


def _segment_ids_one(mask: Array) -> tuple[Array, Array]:
    """Segment ids ``(q [Q], kv [K])`` of one bool mask ``[Q, K]``, from 0, -1 for padding.

    Rows are keyed by their first attended column. In a mask that segment ids can
    represent, rows with one pattern share that column and rows with different
    patterns attend to disjoint columns, so the key separates exactly the row groups.
    Ids are numbered 0, 1, ... in order of first appearance; a row that attends to nothing
    gets -1. A column takes the largest id of the rows that attend to it (in a
    representable mask they all share one), -1 when none does. Two passes over the mask,
    O(Q·K), no sort and no hashing.
    """
    q_len, kv_len = mask.shape
    rows = jnp.arange(q_len, dtype=jnp.int32)
    cols = jnp.arange(kv_len, dtype=jnp.int32)

    def first_column(block, start, height, key):
        block_key = jnp.min(jnp.where(block, cols[None, :], kv_len), axis=1)
        return jax.lax.dynamic_update_slice_in_dim(key, block_key, start, axis=0)

    key = _fold_row_blocks(mask, first_column, jnp.full(q_len, kv_len, jnp.int32))
    row_any = key < kv_len
    first_row_of_key = jnp.full(kv_len + 1, q_len, jnp.int32).at[key].min(rows)
    representative = first_row_of_key[key]
    is_new = row_any & (representative == rows)
    q_ids = jnp.where(row_any, jnp.cumsum(is_new, dtype=jnp.int32)[representative] - 1, -1)

    def column_ids(block, start, height, kv_ids):
        block_ids = jax.lax.dynamic_slice_in_dim(q_ids, start, height)
        return jnp.maximum(kv_ids, jnp.max(jnp.where(block, block_ids[:, None], -1), axis=0))

    kv_ids = _fold_row_blocks(mask, column_ids, jnp.full(kv_len, -1, jnp.int32))
    return q_ids, kv_ids


def _matches_one(mask: Array, q_ids: Array, kv_ids: Array) -> Array:
    """Whether segment ids ``q_ids [Q]``, ``kv_ids [K]`` rebuild exactly ``mask [Q, K]``.

    A query sees a key when their ids are equal and ``>= 0``; negative ids are padding.
    """

    def compare(block, start, height, ok):
        block_ids = jax.lax.dynamic_slice_in_dim(q_ids, start, height)
        rebuilt = (block_ids[:, None] == kv_ids[None, :]) & (block_ids[:, None] >= 0)
        return ok & jnp.all(rebuilt == block)

    return _fold_row_blocks(mask, compare, jnp.bool_(True))


def _mask_segment_ids(mask, per_head: bool, check: bool) -> tuple[Array, Array, Array | None]:
    """``(q_ids, kv_ids, representable or None)`` with padding id -1, for the public functions."""
    if mask.ndim not in (2, 3, 4):
        raise ValueError(
            f"mask must be [Q, K], [B, Q, K] or [B, H, Q, K], got mask.shape={tuple(mask.shape)}"
        )
    if per_head and mask.ndim != 4:
        raise ValueError(
            f"per_head=True needs a [B, H, Q, K] mask, got mask.shape={tuple(mask.shape)}"
        )
    return _mask_segment_ids_jit(jnp.asarray(mask), per_head, check)


@partial(jax.jit, static_argnums=(1, 2))
def _mask_segment_ids_jit(mask: Array, per_head: bool, check: bool):
    if mask.dtype != jnp.bool_:
        mask = mask != 0  # for a bool mask this would be a full copy
    # Without per_head a 4-D mask gets one set of ids per batch element, taken from the
    # union over heads; it is representable only if every head equals the rebuilt mask.
    merge_heads = mask.ndim == 4 and not per_head
    ids_mask = mask.any(axis=1) if merge_heads else mask
    batch_shape, (q_len, kv_len) = ids_mask.shape[:-2], ids_mask.shape[-2:]
    q_ids, kv_ids = jax.vmap(_segment_ids_one)(ids_mask.reshape(-1, q_len, kv_len))
    q_ids = q_ids.reshape(*batch_shape, q_len)
    kv_ids = kv_ids.reshape(*batch_shape, kv_len)
    if not check:
        return q_ids, kv_ids, None
    if merge_heads:
        # Every head must match the one set of ids of its batch element.
        per_head_check = jax.vmap(_matches_one, in_axes=(0, None, None))
        representable = jax.vmap(per_head_check)(mask, q_ids, kv_ids).all(axis=1)
    else:
        flat = jax.vmap(_matches_one)(
            mask.reshape(-1, q_len, kv_len), q_ids.reshape(-1, q_len), kv_ids.reshape(-1, kv_len)
        )
        representable = flat.reshape(batch_shape)
    return q_ids, kv_ids, representable


def mask_to_segment_ids(
    mask: Shaped[AnyArray, "*B T S"], per_head: bool = False, padding_id: int = -1
) -> tuple[Int[Array, "*R T"], Int[Array, "*R S"]]:
    """Segment ids ``(q, kv)`` whose `segment_ids_to_mask` is ``mask``, when such ids exist.

    Vectorized (O(T·S), no Python loop over rows) and usable under ``jax.jit``.

    Segment ids can represent exactly the masks that are block-diagonal up to a
    permutation: the attending queries split into groups, each group attends to
    exactly one set of keys, and the sets of different groups are disjoint. Causal,
    sliding-window, banded or prefix-LM masks, and any mask where two queries see
    overlapping but different key sets, cannot be represented; for those the ids
    returned here rebuild a different mask. Use `is_segment_representable` to check
    (it compares the rebuilt mask with ``mask``).

    Ids follow the convention of `segment_ids_to_mask`: equal non-negative ids attend,
    negative ids are padding. Query ids are numbered 0, 1, ... in order of first
    appearance; a query that sees no key and a key that no query sees get ``padding_id``.

    Args:
        mask: ``[T, S]``, ``[B, T, S]`` or ``[B, H, T, S]`` bool (or 0/1) mask, True
            where a query may attend a key.
        per_head: for a 4-D mask, ids per head ``[B, H, ...]``. Without it a 4-D mask
            gets ids per batch element ``[B, ...]``, built from the union over heads
            (exact only when every head has the same mask).
        padding_id: the id of padding tokens, a negative int (default -1); 0 and positive
            ids are segments.

    Returns:
        ``(q_segment_ids, kv_segment_ids)``, int32 of shapes ``[*B, T]`` and ``[*B, S]``
        (``*B`` without H when a 4-D mask is given without ``per_head``).
    """
    if isinstance(padding_id, bool) or not isinstance(padding_id, int) or padding_id >= 0:
        raise ValueError(f"padding_id must be a negative int, got padding_id={padding_id!r}")
    q_ids, kv_ids, _ = _mask_segment_ids(mask, per_head, check=False)
    if padding_id != -1:
        q_ids = jnp.where(q_ids >= 0, q_ids, padding_id)
        kv_ids = jnp.where(kv_ids >= 0, kv_ids, padding_id)
    return q_ids, kv_ids


def is_segment_representable(
    mask: Shaped[AnyArray, "*B T S"], per_head: bool = False
) -> Bool[Array, "*R"]:
    """Whether segment ids can represent ``mask`` exactly (see `mask_to_segment_ids`).

    Args:
        mask: ``[T, S]``, ``[B, T, S]`` or ``[B, H, T, S]`` bool (or 0/1) mask.
        per_head: as in `mask_to_segment_ids`.

    Returns:
        bool, one per mask: shape ``[]``, ``[B]``, or ``[B, H]`` with ``per_head``
        (``[B]`` for a 4-D mask without it: every head must match).
    """
    return _mask_segment_ids(mask, per_head, check=True)[2]
