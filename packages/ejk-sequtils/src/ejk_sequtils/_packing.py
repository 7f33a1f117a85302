"""Packing variable-length sequences into fixed-length rows (host NumPy, for data pipelines)."""

from collections.abc import Sequence

import numpy as np
from jaxtyping import Array, Int, Shaped

from ._checks import check_positive_int


def _first_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The row each item goes to under first fit, items taken in the given order.

    A max-segment-tree over row capacities finds the first row with room in O(log n):
    every one of the n possible rows starts with full capacity, so opening a new row
    is just reaching the first untouched leaf.
    """
    n = len(lengths)
    size = 1 << max(n - 1, 0).bit_length()
    tree = [capacity] * (2 * size)
    rows = np.empty(n, np.int64)
    for i, length in enumerate(lengths.tolist()):
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= length else 2 * node + 1
        rows[i] = node - size
        tree[node] -= length
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return rows


def pack_sequences(
    sequences: Sequence[Shaped[np.ndarray | Array, "..."]] | Sequence[Sequence[int | float]],
    row_length: int,
    *,
    split: bool = False,
    pad_token: int | float = 0,
) -> tuple[Shaped[np.ndarray, "R T"], Int[np.ndarray, "R T"], Int[np.ndarray, "R T"]]:
    """Pack variable-length 1-D token sequences into rows of ``row_length`` tokens.

    Sequences are placed first-fit decreasing: longest first (ties keep input order),
    each into the first row with room, a new row when none has room. Within a row,
    sequences get segment ids 0, 1, ... in placement order and position ids from 0;
    the rest of the row is padding (``pad_token``, segment id -1, position id 0), as
    `segment_ids_to_mask` reads them: equal non-negative ids attend, negative is padding.
    Empty sequences take no room and are left out. Runs on the host with NumPy; the
    result is deterministic.

    Args:
        sequences: 1-D token arrays (NumPy, JAX or lists) of any lengths.
        row_length: tokens per row T, a positive int.
        split: a sequence longer than ``row_length`` is an error unless this is set;
            then it is cut into pieces of ``row_length`` (the last one shorter), each
            packed as its own sequence with positions from 0.
        pad_token: the token value of padding.

    Returns:
        ``(tokens, segment_ids, position_ids)``, each ``[rows, T]``; tokens in the
        common dtype of the sequences, ids int32 (segment id -1 for padding).
    """
    row_length = check_positive_int(row_length, "row_length")
    if isinstance(sequences, np.ndarray) and sequences.ndim < 2:
        raise TypeError(
            f"sequences must be a list of 1-D arrays, got one array of shape {sequences.shape}"
        )
    arrays = [np.asarray(s) for s in sequences]
    for i, a in enumerate(arrays):
        if a.ndim != 1:
            raise ValueError(f"sequences[{i}] must be 1-D, got shape {a.shape}")
    # Unique dtypes only: np.result_type takes a bounded number of arguments.
    dtype = np.result_type(*{a.dtype for a in arrays}) if arrays else np.dtype(np.int32)
    lengths = np.array([a.shape[0] for a in arrays], np.int64)
    too_long = np.flatnonzero(lengths > row_length)
    if too_long.size and not split:
        i = int(too_long[0])
        raise ValueError(
            f"sequences[{i}] has length {lengths[i]} > row_length={row_length}; "
            "pass split=True to cut long sequences into pieces"
        )

    # Pieces: (source sequence, start in it, length); one per sequence unless split.
    pieces_per_seq = -(-lengths // row_length)
    piece_seq = np.repeat(np.arange(len(arrays)), pieces_per_seq)
    first_piece = np.cumsum(pieces_per_seq) - pieces_per_seq
    piece_start = (np.arange(piece_seq.size) - np.repeat(first_piece, pieces_per_seq)) * row_length
    piece_len = np.minimum(lengths[piece_seq] - piece_start, row_length)

    order = np.argsort(-piece_len, kind="stable")  # first fit *decreasing*
    piece_row = np.empty_like(order)
    piece_row[order] = _first_fit(piece_len[order], row_length)
    num_rows = int(piece_row.max()) + 1 if piece_row.size else 0

    # Offset and segment id of each piece in its row, in placement order.
    placed_row = piece_row[order]
    by_row = np.argsort(placed_row, kind="stable")
    row_sorted_len = piece_len[order][by_row]
    row_sorted_row = placed_row[by_row]
    row_begin = np.searchsorted(row_sorted_row, row_sorted_row, side="left")
    rank = np.arange(row_sorted_row.size) - row_begin
    cumulative = np.cumsum(row_sorted_len) - row_sorted_len
    column = cumulative - cumulative[row_begin] if row_sorted_row.size else cumulative
    pieces = order[by_row]  # piece ids in (row, placement) order

    tokens = np.full((num_rows, row_length), pad_token, dtype=dtype)
    segment_ids = np.full((num_rows, row_length), -1, np.int32)
    position_ids = np.zeros((num_rows, row_length), np.int32)
    if pieces.size:
        piece_lens = piece_len[pieces]
        within = np.arange(piece_lens.sum()) - np.repeat(
            np.cumsum(piece_lens) - piece_lens, piece_lens
        )
        flat_target = np.repeat(row_sorted_row * row_length + column, piece_lens) + within
        seq_offset = np.cumsum(lengths) - lengths
        source = np.repeat(seq_offset[piece_seq[pieces]] + piece_start[pieces], piece_lens) + within
        tokens.reshape(-1)[flat_target] = np.concatenate(arrays)[source]
        segment_ids.reshape(-1)[flat_target] = np.repeat(rank, piece_lens)
        position_ids.reshape(-1)[flat_target] = within
    return tokens, segment_ids, position_ids
