"""Packed sequences described by cumulative lengths, and the per-token views of them.

A packed batch is one token stream holding several sequences back to back.
``cu_seqlens = [0, len_0, len_0 + len_1, ...]`` (shape ``[num_seqs + 1]``, starting at
exactly 0) marks where each sequence starts; sequence ``s`` holds tokens ``cu_seqlens[s]``
up to ``cu_seqlens[s + 1]`` (exclusive), so an empty sequence is two equal entries.

Segment ids ``int [*B, T]``: tokens attend only within equal non-negative ids; any
negative id is padding. Ids made here number segments from 0 and give padding -1.

Per-token outputs (position ids, sequence ids, ...) have one entry per token, and
the number of tokens, ``cu_seqlens[-1]``, is a value. Every such function takes
``total_length=`` (and per-chunk functions ``total_chunks=``): a static length that
makes it work under ``jax.jit``. Without it the length is read from a concrete
``cu_seqlens``; a traced one raises a ``ValueError`` asking for the argument.
Tokens at or beyond ``cu_seqlens[-1]`` are padding: sequence id -1, segment id -1,
position id 0.

``cu_seqlens`` is checked as `validate_attention` checks ``cu_seqlens_q``: an integer
jax or NumPy array, rank 1 with at least 2 entries, and when concrete starting at 0,
non-decreasing and ending at or before ``total_length`` (``total_chunks``). A traced
one cannot be checked: tokens before a non-zero ``cu_seqlens[0]`` then come out as
padding, and tokens past ``total_length`` are cut off. `cu_seqlens_valid` is the same
check as a traced bool; the attention functions (`reference_attention`,
``ejk_attention.flash_attention``) use it to return NaN for invalid traced offsets.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int, Shaped

from ._checks import (
    check_cu_seqlens,
    check_integer_array,
    check_optional_length,
    check_positive_int,
    concrete_or_none,
    static_int,
)

# Public functions take jax or NumPy arrays alike.
AnyArray = Array | np.ndarray


def cdiv(a: int | Int[AnyArray, "..."], b: int | Int[AnyArray, "..."]) -> int | Int[Array, "..."]:
    """Ceiling division ``⌈a / b⌉`` of integers, exact for negative ``a`` too.

    Python ints give a Python int (usable for static shapes); arrays give an array.

    Args:
        a: the dividend, an int or an integer array.
        b: the divisor, a positive int or an integer array (positive values).

    Returns:
        ``⌈a / b⌉``, an int when both arguments are ints, else an array of their broadcast shape.
    """
    if isinstance(b, int | np.integer) and not isinstance(b, bool) and b <= 0:
        raise ValueError(f"cdiv divisor must be positive, got b={b}")
    if isinstance(a, int | np.integer) and isinstance(b, int | np.integer):
        return -(-int(a) // int(b))
    # -(-a // b) rounds up for either sign of a; (a + b - 1) // b only for a >= 0.
    return -(-jnp.asarray(a) // jnp.asarray(b))


def cu_seqlens_valid(cu_seqlens: Int[AnyArray, " C"], total_length: int) -> Bool[Array, ""]:
    """Whether ``cu_seqlens`` are offsets a packed call accepts, as a traceable bool scalar.

    The check `validate_attention` makes on concrete offsets (start at exactly 0, never
    decrease, end at or before ``total_length``), computed with jnp so it also holds under
    ``jax.jit``, where the offsets cannot be read while tracing. `poison_unless` turns it
    into NaN outputs.

    Args:
        cu_seqlens: ``[num_seqs + 1]`` offsets (an integer array of rank 1, >= 2 entries).
        total_length: the number of packed tokens the offsets index (a static int).

    Returns:
        A bool scalar: True when the offsets are valid.
    """
    cu = jnp.asarray(cu_seqlens)
    return (cu[0] == 0) & jnp.all(cu[1:] >= cu[:-1]) & (cu[-1] <= total_length)


def poison_unless(valid: Bool[ArrayLike, ""], *arrays: Shaped[Array, "..."]) -> tuple:
    """``arrays`` unchanged where ``valid``, all NaN where not (their gradients too).

    One scalar multiply per element (by 1 or NaN), so an invalid call cannot give plausible
    numbers and a valid one costs almost nothing; used where the offsets are traced.

    Args:
        valid: a bool scalar, e.g. `cu_seqlens_valid`'s.
        arrays: floating arrays (the output, the lse).

    Returns:
        The arrays, in order, each in its own dtype.
    """
    factor = jnp.where(valid, 1.0, jnp.nan)
    return tuple(x * factor.astype(x.dtype) for x in arrays)


def prepare_lens(cu_seqlens: Int[AnyArray, " C"]) -> Int[Array, " C-1"]:
    """The length of each sequence, from cumulative lengths.

    Args:
        cu_seqlens: ``[num_seqs + 1]`` cumulative lengths ``[0, len_0, len_0 + len_1, ...]``.

    Returns:
        ``[num_seqs]`` lengths (empty sequences give 0), in the dtype of ``cu_seqlens``.
    """
    check_cu_seqlens(cu_seqlens)
    cu_seqlens = jnp.asarray(cu_seqlens)
    return cu_seqlens[1:] - cu_seqlens[:-1]


def prepare_chunk_offsets(cu_seqlens: Int[AnyArray, " C"], chunk_size: int) -> Int[Array, " C"]:
    """Cumulative chunk counts: where each sequence's chunks start among all chunks.

    Sequence ``s`` has ``⌈len_s / chunk_size⌉`` chunks (an empty one has none).

    Args:
        cu_seqlens: ``[num_seqs + 1]`` cumulative lengths.
        chunk_size: the chunk length in tokens, a positive int.

    Returns:
        int32 ``[num_seqs + 1]``: ``[0, chunks_0, chunks_0 + chunks_1, ...]``.
    """
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    lens = prepare_lens(cu_seqlens).astype(jnp.int32)
    return jnp.pad(jnp.cumsum(cdiv(lens, chunk_size), dtype=jnp.int32), (1, 0))


def _owner_and_offset(starts: Array, index: Array) -> tuple[Array, Array]:
    """For each ``index``, the interval of ``starts`` it falls in and its offset there.

    Interval ``s`` is ``[starts[s], starts[s + 1])``; an index outside every interval
    (before ``starts[0]`` or at/after ``starts[-1]``) gets owner -1 and offset 0. With
    ``side="right"`` an empty interval owns nothing, so empty sequences are skipped.
    """
    owner = jnp.searchsorted(starts, index, side="right").astype(jnp.int32) - 1
    inside = (owner >= 0) & (owner < starts.shape[0] - 1)
    owner = jnp.where(inside, owner, -1)
    offset = jnp.where(inside, index - starts[jnp.clip(owner, 0)], 0).astype(jnp.int32)
    return owner, offset


def _token_owner_and_position(cu_seqlens, total_length, fn: str) -> tuple[Array, Array]:
    total_length = check_optional_length(total_length, "total_length")
    check_cu_seqlens(cu_seqlens, total_length)
    cu_seqlens = jnp.asarray(cu_seqlens)
    if total_length is None:
        total_length = static_int(
            cu_seqlens[-1], fn=fn, name="cu_seqlens", static_arg="total_length"
        )
    tokens = jnp.arange(total_length, dtype=cu_seqlens.dtype)
    return _owner_and_offset(cu_seqlens, tokens)


def prepare_sequence_ids(
    cu_seqlens: Int[AnyArray, " C"], total_length: int | None = None
) -> Int[Array, " T"]:
    """The sequence (0-based) each token belongs to.

    ``[0, 3, 3, 5]`` (the middle sequence empty) gives ``[0, 0, 0, 2, 2]``.

    Args:
        cu_seqlens: ``[num_seqs + 1]`` cumulative lengths.
        total_length: static number of tokens T; required under ``jax.jit``. Tokens
            past ``cu_seqlens[-1]`` are padding; a T below a concrete ``cu_seqlens[-1]``
            is a ``ValueError``.

    Returns:
        int32 ``[T]`` sequence ids, -1 for padding.
    """
    owner, _ = _token_owner_and_position(cu_seqlens, total_length, "prepare_sequence_ids")
    return owner


def prepare_position_ids(
    cu_seqlens: Int[AnyArray, " C"], total_length: int | None = None
) -> Int[Array, " T"]:
    """Each token's position within its sequence.

    ``[0, 3, 5, 9]`` gives ``[0, 1, 2, 0, 1, 0, 1, 2, 3]``.

    Args:
        cu_seqlens: ``[num_seqs + 1]`` cumulative lengths.
        total_length: static number of tokens T; required under ``jax.jit``.

    Returns:
        int32 ``[T]`` position ids, 0 for padding.
    """
    _, position = _token_owner_and_position(cu_seqlens, total_length, "prepare_position_ids")
    return position


def prepare_token_indices(
    cu_seqlens: Int[AnyArray, " C"], total_length: int | None = None
) -> Int[Array, "T 2"]:
    """``(sequence id, position id)`` of each token.

    Args:
        cu_seqlens: ``[num_seqs + 1]`` cumulative lengths.
        total_length: static number of tokens T; required under ``jax.jit``.

    Returns:
        int32 ``[T, 2]``: column 0 as `prepare_sequence_ids` (-1 for padding), column 1
        as `prepare_position_ids` (0 for padding).
    """
    owner, position = _token_owner_and_position(cu_seqlens, total_length, "prepare_token_indices")
    return jnp.stack([owner, position], axis=1)


def prepare_chunk_indices(
    cu_seqlens: Int[AnyArray, " C"], chunk_size: int, total_chunks: int | None = None
) -> Int[Array, "K 2"]:
    """``(sequence id, chunk index within the sequence)`` of each chunk of the packed batch.

    Chunks are numbered sequence after sequence (see `prepare_chunk_offsets`); the last
    chunk of a sequence may be partial, an empty sequence has none.

    Args:
        cu_seqlens: ``[num_seqs + 1]`` cumulative lengths.
        chunk_size: the chunk length in tokens, a positive int.
        total_chunks: static number of chunks K; required under ``jax.jit``. Chunks past
            the last real one are padding; a K below the (concrete) number of chunks is
            a ``ValueError``.

    Returns:
        int32 ``[K, 2]``; padding chunks are ``[-1, 0]``.
    """
    total_chunks = check_optional_length(total_chunks, "total_chunks")
    offsets = prepare_chunk_offsets(cu_seqlens, chunk_size)
    if total_chunks is None:
        total_chunks = static_int(
            offsets[-1], fn="prepare_chunk_indices", name="cu_seqlens", static_arg="total_chunks"
        )
    else:
        needed = concrete_or_none(offsets[-1])
        if needed is not None and int(needed) > total_chunks:
            raise ValueError(
                f"cu_seqlens with {chunk_size=} makes {int(needed)} chunks, more than "
                f"{total_chunks=}: pass a total_chunks of at least {int(needed)}"
            )
    owner, index = _owner_and_offset(offsets, jnp.arange(total_chunks, dtype=jnp.int32))
    return jnp.stack([owner, index], axis=1)


def cu_seqlens_to_segment_ids(
    cu_seqlens: Int[AnyArray, " C"], total_length: int | None = None
) -> Int[Array, " T"]:
    """Segment ids (0-based sequence index, -1 for padding) of a packed token stream.

    ``[0, 3, 3, 5]`` gives ``[0, 0, 0, 2, 2]``: the id is the sequence index (the same
    values as `prepare_sequence_ids`), so an empty sequence leaves a gap in the ids.
    Tokens attend only within equal non-negative ids; a negative id is padding.

    Args:
        cu_seqlens: ``[num_seqs + 1]`` cumulative lengths.
        total_length: static number of tokens T; required under ``jax.jit``. Tokens
            past ``cu_seqlens[-1]`` are padding; a T below a concrete ``cu_seqlens[-1]``
            is a ``ValueError``.

    Returns:
        int32 ``[T]`` segment ids; padding tokens get -1.
    """
    owner, _ = _token_owner_and_position(cu_seqlens, total_length, "cu_seqlens_to_segment_ids")
    return owner


def _run_starts(segment_ids: Array) -> tuple[Array, Array]:
    """``(valid, start)`` along the last axis: a run is a maximal stretch of one id >= 0.

    The first token of a row always differs from its (absent) predecessor, so a row that
    begins with a valid id, 0 included, begins a run; no fill value stands in for it.
    """
    valid = segment_ids >= 0
    changed = jnp.concatenate(
        [
            jnp.ones_like(segment_ids[..., :1], dtype=bool),
            segment_ids[..., 1:] != segment_ids[..., :-1],
        ],
        axis=-1,
    )
    return valid, valid & changed


def _check_segment_runs(values: np.ndarray) -> None:
    """Concrete 1-D segment ids that cu_seqlens can hold: no padding between runs, one run per id."""
    valid = values >= 0
    if not valid.any():
        return
    first, last = np.flatnonzero(valid)[[0, -1]]
    holes = np.flatnonzero(~valid[first:last])
    if holes.size:
        i = int(first + holes[0])
        raise ValueError(
            f"segment_ids has padding between sequences (segment_ids[{i}]={values[i]}); "
            "cu_seqlens can only describe padding before the first or after the last sequence"
        )
    changed = np.concatenate([[True], values[1:] != values[:-1]])
    starts = np.flatnonzero(valid & changed)
    ids, counts = np.unique(values[starts], return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            "segment_ids must hold each non-negative id in one contiguous run, got id "
            f"{ids[counts > 1][0]} in several runs"
        )


def segment_ids_to_cu_seqlens(
    segment_ids: Int[AnyArray, " T"], num_seqs: int | None = None
) -> Int[Array, " C"]:
    """Cumulative lengths of the sequences in one row of segment ids.

    A sequence is a maximal run of one non-negative id (0 included); padding (any negative
    id) may come before the first or after the last sequence only (checked when
    ``segment_ids`` is concrete).
    Segment ids cannot hold empty sequences, so ``cu_seqlens → segment ids → cu_seqlens``
    drops them and is otherwise exact.

    Args:
        segment_ids: ``[T]`` segment ids of a packed token stream, negative for padding.
        num_seqs: static number of sequences; required under ``jax.jit``. With more than
            the number of runs, the extra sequences are empty (at the end); with fewer, the
            last sequence runs to the last valid token.

    Returns:
        int32 ``[num_seqs + 1]``: start of each run, then the end of the last valid token.
    """
    check_integer_array(segment_ids, "segment_ids", ndim=1)
    num_seqs = check_optional_length(num_seqs, "num_seqs")
    values = concrete_or_none(segment_ids)
    if values is not None:
        _check_segment_runs(values)
    segment_ids = jnp.asarray(segment_ids)
    valid, start = _run_starts(segment_ids)
    if num_seqs is None:
        num_seqs = static_int(
            start.sum(), fn="segment_ids_to_cu_seqlens", name="segment_ids", static_arg="num_seqs"
        )
    index = jnp.arange(segment_ids.shape[0], dtype=jnp.int32)
    end = jnp.max(jnp.where(valid, index + 1, 0), initial=0)
    (starts,) = jnp.nonzero(start, size=num_seqs, fill_value=end)
    return jnp.concatenate([starts.astype(jnp.int32), end[None]])


def segment_ids_to_position_ids(segment_ids: Int[AnyArray, "*B T"]) -> Int[Array, "*B T"]:
    """Each token's position within its run of equal non-negative segment ids.

    A run is a maximal stretch of one id ``>= 0`` along the last axis, so
    ``[0, 0, 1, 1, 1, -1]`` gives ``[0, 1, 0, 1, 2, 0]``; an id that reappears after
    another id or after padding starts again at 0.

    Args:
        segment_ids: ``[*B, T]`` segment ids, negative for padding.

    Returns:
        int32 ``[*B, T]`` position ids; padding gets 0.
    """
    check_integer_array(segment_ids, "segment_ids")
    if segment_ids.ndim == 0:
        raise ValueError("segment_ids must have at least one axis, got a scalar")
    segment_ids = jnp.asarray(segment_ids)
    valid, start = _run_starts(segment_ids)
    index = jax.lax.broadcasted_iota(jnp.int32, segment_ids.shape, segment_ids.ndim - 1)
    run_start = jax.lax.cummax(jnp.where(start, index, 0), axis=segment_ids.ndim - 1)
    return jnp.where(valid, index - run_start, 0)


def position_ids_to_segment_ids(
    position_ids: Int[AnyArray, "*B T"], valid: Shaped[AnyArray, "*B T"] | None = None
) -> Int[Array, "*B T"]:
    """Segment ids (0, 1, ... along each row, -1 for padding) from position ids.

    A new sequence starts at each valid token whose position id is 0, and at the first
    valid token of a row or after padding (a row may begin mid-sequence). This is the
    ``position_ids == 0`` convention of packed data pipelines.

    Args:
        position_ids: ``[*B, T]`` position ids.
        valid: ``[*B, T]`` bool (or 0/1) marking real tokens; None means the tokens with
            ``position_ids >= 0``.

    Returns:
        int32 ``[*B, T]`` segment ids numbered from 0 in each row; padding gets -1.
    """
    check_integer_array(position_ids, "position_ids")
    if position_ids.ndim == 0:
        raise ValueError("position_ids must have at least one axis, got a scalar")
    position_ids = jnp.asarray(position_ids)
    if valid is None:
        valid = position_ids >= 0
    else:
        if tuple(valid.shape) != tuple(position_ids.shape):
            raise ValueError(
                f"valid must have the shape of position_ids {tuple(position_ids.shape)}, "
                f"got valid.shape={tuple(valid.shape)}"
            )
        valid = jnp.asarray(valid).astype(bool)
    axis = position_ids.ndim - 1
    previous_valid = jnp.concatenate([jnp.zeros_like(valid[..., :1]), valid[..., :-1]], axis=-1)
    start = valid & ((position_ids == 0) | ~previous_valid)
    return jnp.where(valid, jnp.cumsum(start, axis=axis, dtype=jnp.int32) - 1, -1)
