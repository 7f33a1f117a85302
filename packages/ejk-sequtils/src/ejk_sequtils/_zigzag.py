"""The zigzag layout of context parallelism: load balance for causal attention.

A sequence of length ``T`` split over ``n`` devices is cut into ``2n`` equal chunks;
device ``i`` holds chunks ``i`` and ``2n - 1 - i`` (an early and a late one), so under a
causal mask every device has the same number of visible (query, key) pairs. Contiguous
shards would give device 0 one block of work and device ``n - 1`` n of them.
With packed documents shorter than a shard the contiguous split is balanced too, and
keeps every token where it is: `causal_shard_work` counts each shard's work in either
layout, from the segment ids.

`to_zigzag` reorders any per-token array (tokens, segment ids, positions) along its
sequence axis so that an ordinary contiguous split of the result (``PartitionSpec`` on
that axis, or ``shard_map``) gives each device its two chunks; `from_zigzag` undoes it.
Both move whole chunks (static slices concatenated: the order depends on shapes only, and
XLA copies the chunks instead of gathering token by token): jit-, vmap- and grad-safe.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, Shaped

from ._checks import check_positive_int
from ._cu_seqlens import segment_ids_to_position_ids

__all__ = ["causal_shard_work", "from_zigzag", "to_zigzag", "zigzag_chunks", "zigzag_positions"]

AnyArray = Array | np.ndarray


def zigzag_chunks(num_shards: int) -> tuple[int, ...]:
    """The order of the ``2 * num_shards`` chunks in the zigzag layout.

    Args:
        num_shards: devices the sequence is split over, ``n``.

    Returns:
        ``(0, 2n - 1, 1, 2n - 2, ..., n - 1, n)``: shard i holds chunks ``2i`` and ``2i + 1``
        of this order.
    """
    n = check_positive_int(num_shards, "num_shards")
    return tuple(c for i in range(n) for c in (i, 2 * n - 1 - i))


def _chunk_len(length: int, num_shards: int) -> int:
    n = check_positive_int(num_shards, "num_shards")
    if length % (2 * n):
        raise ValueError(
            f"the zigzag layout cuts the sequence into 2 * {num_shards=} equal chunks; "
            f"sequence length {length} is not a multiple of {2 * n}"
        )
    return length // (2 * n)


def zigzag_positions(length: int, num_shards: int) -> Int[np.ndarray, " T"]:
    """Global position of each token of the zigzag layout (the gather `to_zigzag` does).

    Args:
        length: sequence length ``T``, a multiple of ``2 * num_shards``.
        num_shards: devices the sequence is split over.

    Returns:
        int32 ``[T]``: entry ``j`` is the original index of the token the layout puts at ``j``.
    """
    c = _chunk_len(length, num_shards)
    chunks = np.asarray(zigzag_chunks(num_shards))
    return (chunks[:, None] * c + np.arange(c)[None, :]).reshape(-1).astype(np.int32)


def _axis(x: Shaped[AnyArray, " *dims"], axis: int) -> int:
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{axis=} is out of range for an array of shape {x.shape}")
    return axis % x.ndim


def to_zigzag(
    x: Shaped[AnyArray, " *dims"], num_shards: int, *, axis: int = 1
) -> Shaped[AnyArray, " *dims"]:
    """``x`` reordered along ``axis`` into the zigzag layout (shard i: chunks i and 2n-1-i).

    Args:
        x: any per-token array: ``[B, T, ...]`` tokens or activations, ``[B, T]`` segment
            ids or positions (NumPy or JAX; traced values are fine).
        num_shards: devices the sequence will be split over, ``n``; ``T % (2n) == 0``.
        axis: the sequence axis (default 1, as in ``[B, T, N, H]``).

    Returns:
        An array like ``x`` (same type, shape and dtype) in the zigzag order.
    """
    return _chunks_in_order(x, zigzag_chunks(num_shards), num_shards, axis)


def from_zigzag(
    x: Shaped[AnyArray, " *dims"], num_shards: int, *, axis: int = 1
) -> Shaped[AnyArray, " *dims"]:
    """The inverse of `to_zigzag`: ``from_zigzag(to_zigzag(x, n), n) == x``.

    Args:
        x: an array in the zigzag layout along ``axis``.
        num_shards: the ``n`` it was laid out for.
        axis: the sequence axis (default 1).

    Returns:
        ``x`` in the original token order.
    """
    inverse = tuple(int(i) for i in np.argsort(zigzag_chunks(num_shards)))
    return _chunks_in_order(x, inverse, num_shards, axis)


def _chunks_in_order(
    x: Shaped[AnyArray, " *dims"], chunks: tuple[int, ...], num_shards: int, axis: int
) -> Shaped[AnyArray, " *dims"]:
    """``x``'s ``2 * num_shards`` equal chunks along ``axis``, concatenated in the order
    ``chunks``."""
    axis = _axis(x, axis)
    c = _chunk_len(x.shape[axis], num_shards)
    before = (slice(None),) * axis
    parts = [x[(*before, slice(i * c, (i + 1) * c))] for i in chunks]
    xp = np if isinstance(x, np.ndarray) else jnp
    return xp.concatenate(parts, axis=axis)


def causal_shard_work(segment_ids: Int[AnyArray, "B T"], num_shards: int, *, zigzag: bool) -> Array:
    """The (query, key) pairs causal self-attention lets through, per shard of the rows.

    Each row counts the keys from the start of its run of equal ids up to itself: exact
    for documents that are one run each (packed sequences, ``cu_seqlens``); a document
    whose id recurs after another's counts fewer pairs than its rows see. Padding rows
    (negative ids) count none. Jit-safe (traced ids are fine).

    Args:
        segment_ids: int ``[B, T]``.
        num_shards: devices the rows are split over, ``n``; ``T % n == 0`` (``T % 2n``
            with ``zigzag``).
        zigzag: count the zigzag layout's shards (`to_zigzag`), else the contiguous split.

    Returns:
        float32 ``[n]``: each shard's pairs, summed over the batch.
    """
    ids = jnp.asarray(segment_ids)
    if ids.ndim != 2:
        raise ValueError(f"segment_ids must be [B, T], got shape {ids.shape}")
    n = check_positive_int(num_shards, "num_shards")
    b, t = ids.shape
    if t % n:
        raise ValueError(f"sequence length {t} does not split into {num_shards=} shards")
    # a row sees the keys from its run's start (position 0) up to itself
    work = jnp.where(ids >= 0, segment_ids_to_position_ids(ids) + 1, 0).astype(jnp.float32)
    if zigzag:
        work = to_zigzag(work, n)
    return work.reshape(b, n, t // n).sum(axis=(0, 2))
