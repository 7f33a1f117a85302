"""Which keys each query sees: the visibility rules of ejk attention, defined once.

A query ``i`` sees a key ``j`` when every rule the call names holds:

- **packing** (``cu_seqlens_q``/``cu_seqlens_k``, batch 1): both tokens lie in the
  same packed sequence; positions below are local to that sequence; tokens past the
  last offset are padding.
- **causal**: ``pos(j) <= pos(i)`` (top-left aligned).
- **sliding window** ``(left, right)``: ``pos(i) - left <= pos(j) <= pos(i) + right``;
  an int ``w`` means ``(w, w)`` (``local_window_size`` in ``jax.nn.dot_product_attention``).
- **segment ids** ``[B, T]`` (or a ``(q_ids [B, T], kv_ids [B, S])`` pair): equal ids,
  and the id is not negative. A negative id is padding; 0 is an ordinary segment (as in
  ejKernel and splash attention), so a model that pads with 0 still gets exact outputs
  on its real tokens, whose ids differ from 0.

Every backend applies exactly these rules; a query with no visible key is "emptied"
(what it outputs is the attention function's rule, see `reference_attention`).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from ._checks import describe_value

__all__ = ["normalize_window", "visibility_mask"]

AnyArray = Array | np.ndarray
SegmentIds = Int[AnyArray, "B T"] | tuple[Int[AnyArray, "B T"], Int[AnyArray, "B S"]]


def normalize_window(sliding_window: Any, name: str = "sliding_window") -> tuple[int, int] | None:
    """``sliding_window`` as ``(left, right)`` ints >= 0, or None.

    ``name`` is the argument's name in the caller's signature, for the messages
    (``dot_product_attention`` passes ``"local_window_size"``).

    Raises:
        TypeError: not None, an int or a pair of ints.
        ValueError: a pair of another length, or a negative size.
    """
    if sliding_window is None:
        return None
    expected = f"{name} must be an int or (left, right), got {describe_value(sliding_window)}"
    if isinstance(sliding_window, bool):
        raise TypeError(expected)
    if isinstance(sliding_window, numbers.Integral):
        pair = (int(sliding_window), int(sliding_window))
    elif isinstance(sliding_window, Sequence) and not isinstance(sliding_window, str):
        if len(sliding_window) != 2:
            raise ValueError(expected)
        if not all(
            isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in sliding_window
        ):
            raise TypeError(f"{name} sizes must be ints, got {describe_value(sliding_window)}")
        pair = (int(sliding_window[0]), int(sliding_window[1]))
    else:
        raise TypeError(expected)
    if pair[0] < 0 or pair[1] < 0:
        raise ValueError(f"{name} sizes must be >= 0, got {sliding_window!r}")
    return pair


def split_segment_ids(segment_ids: Any) -> tuple[Any, Any]:
    """``(q_ids, kv_ids)`` of ``segment_ids`` given as one array or as a pair."""
    if isinstance(segment_ids, tuple | list):
        if len(segment_ids) != 2:
            raise ValueError(
                f"segment_ids must be [B, T] or a (q_ids, kv_ids) pair, got {len(segment_ids)} items"
            )
        return segment_ids[0], segment_ids[1]
    return segment_ids, segment_ids


def _sequence_of(cu_seqlens: Int[AnyArray, " L"], idx: Array) -> tuple[Array, Array]:
    """(sequence index, position inside it) of the packed tokens at indices ``idx``.

    Tokens past the last offset get sequence index ``num_seqs`` (padding).
    Empty sequences own no token, so ``searchsorted`` skips them.
    """
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    seq = jnp.searchsorted(cu, idx, side="right").astype(jnp.int32) - 1
    num_seqs = cu.shape[0] - 1
    seq = jnp.where(idx >= cu[-1], num_seqs, seq)
    local = idx - cu[jnp.clip(seq, 0, num_seqs)]
    return seq, local


def visibility_mask(
    q_len: int,
    kv_len: int,
    *,
    causal: bool = False,
    sliding_window: int | Sequence[int] | None = None,
    segment_ids: SegmentIds | None = None,
    cu_seqlens_q: Int[AnyArray, " L"] | None = None,
    cu_seqlens_k: Int[AnyArray, " L"] | None = None,
    q_offset: int | Int[Array, ""] = 0,
    kv_offset: int | Int[Array, ""] = 0,
) -> Bool[Array, "#B 1 T S"]:
    """Which keys each query sees, as every ejk backend defines it (see the module docstring).

    Args:
        q_len, kv_len: ``T`` and ``S``.
        causal: keys up to the query's position.
        sliding_window: ``(left, right)`` or ``w`` for ``(w, w)``.
        segment_ids: ``[B, T]`` (needs ``T == S``) or ``(q_ids [B, T], kv_ids [B, S])``;
            equal non-negative ids see each other, negative ids are padding.
        cu_seqlens_q: ``[num_seqs + 1]`` offsets of packed query sequences.
        cu_seqlens_k: offsets of packed key sequences; default ``cu_seqlens_q``.
        q_offset, kv_offset: global index of the first query and key (a shard of a longer
            sequence, as in ring attention); the rules apply to global positions.

    Returns:
        bool ``[B or 1, 1, T, S]``.
    """
    window = normalize_window(sliding_window)
    q_pos = q_offset + jnp.arange(q_len, dtype=jnp.int32)
    k_pos = kv_offset + jnp.arange(kv_len, dtype=jnp.int32)
    visible = jnp.ones((q_len, kv_len), bool)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if cu_seqlens_q is None:
            raise ValueError("cu_seqlens_k was given without cu_seqlens_q")
        cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
        if jnp.shape(cu_k) != jnp.shape(cu_seqlens_q):
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must have the same shape, got "
                f"{jnp.shape(cu_seqlens_q)} and {jnp.shape(cu_k)}"
            )
        q_seq, q_pos = _sequence_of(cu_seqlens_q, q_pos)
        k_seq, k_pos = _sequence_of(cu_k, k_pos)
        num_seqs = jnp.shape(cu_seqlens_q)[0] - 1
        visible = (q_seq[:, None] == k_seq[None, :]) & (q_seq[:, None] < num_seqs)
    di = q_pos[:, None]
    dj = k_pos[None, :]
    if causal:
        visible &= dj <= di
    if window is not None:
        left, right = window
        visible &= (dj >= di - left) & (dj <= di + right)
    visible = visible[None, None]
    if segment_ids is not None:
        q_ids, kv_ids = (jnp.asarray(x) for x in split_segment_ids(segment_ids))
        if q_ids.ndim != 2 or q_ids.shape[1] != q_len:
            raise ValueError(f"q segment_ids must be [B, {q_len}], got shape {q_ids.shape}")
        if kv_ids.ndim != 2 or kv_ids.shape[1] != kv_len:
            raise ValueError(f"kv segment_ids must be [B, {kv_len}], got shape {kv_ids.shape}")
        same = (q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids[:, :, None] >= 0)
        visible = visible & same[:, None]
    return visible
