"""pack_sequences: explicit cases, errors, and a brute-force first-fit-decreasing reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ejk_sequtils as es


def _ref_pack(sequences, row_length, split):
    """First fit decreasing, written as plainly as possible."""
    pieces = []
    for seq in sequences:
        seq = list(seq)
        if len(seq) > row_length and not split:
            raise ValueError("too long")
        pieces += [seq[i : i + row_length] for i in range(0, len(seq), row_length)]
    pieces = sorted(pieces, key=len, reverse=True)  # sorted() is stable
    rows: list[list[list[int]]] = []
    for piece in pieces:
        for row in rows:
            if sum(map(len, row)) + len(piece) <= row_length:
                row.append(piece)
                break
        else:
            rows.append([piece])
    tokens, segments, positions = [], [], []
    for row in rows:
        t = [tok for piece in row for tok in piece]
        s = [k for k, piece in enumerate(row) for _ in piece]
        p = [i for piece in row for i in range(len(piece))]
        pad = row_length - len(t)
        tokens.append(t + [0] * pad)
        segments.append(s + [-1] * pad)
        positions.append(p + [0] * pad)
    return tokens, segments, positions


def test_pack_example():
    seqs = [
        np.arange(1, 4),
        np.arange(10, 16),
        np.array([], np.int64),
        np.arange(20, 22),
        np.arange(30, 37),
    ]
    tokens, segment_ids, position_ids = es.pack_sequences(seqs, 8)
    assert tokens.tolist() == [
        [30, 31, 32, 33, 34, 35, 36, 0],
        [10, 11, 12, 13, 14, 15, 20, 21],
        [1, 2, 3, 0, 0, 0, 0, 0],
    ]
    assert segment_ids.tolist() == [[0] * 7 + [-1], [0] * 6 + [1, 1], [0, 0, 0] + [-1] * 5]
    assert position_ids.tolist() == [[*range(7), 0], [*range(6), 0, 1], [0, 1, 2] + [0] * 5]
    assert tokens.dtype == seqs[0].dtype
    assert segment_ids.dtype == position_ids.dtype == np.int32


def test_pack_outputs_feed_the_other_functions():
    _tokens, segment_ids, position_ids = es.pack_sequences([[5, 6, 7], [8], [9, 9]], 4)
    np.testing.assert_array_equal(es.segment_ids_to_position_ids(segment_ids), position_ids)
    np.testing.assert_array_equal(
        es.position_ids_to_segment_ids(position_ids, segment_ids >= 0), segment_ids
    )
    mask = np.asarray(es.segment_ids_to_mask(segment_ids))
    assert mask.shape == (2, 4, 4)
    # Every row's first sequence has id 0 and attends within itself.
    assert segment_ids[:, 0].tolist() == [0, 0]
    assert mask[0, :3, :3].all() and mask[1, :2, :2].all()
    np.testing.assert_array_equal(mask.any(-1), segment_ids >= 0)


def test_pack_split_and_errors():
    tokens, _segment_ids, position_ids = es.pack_sequences([np.arange(1, 20)], 8, split=True)
    assert tokens[:, :3].tolist() == [[1, 2, 3], [9, 10, 11], [17, 18, 19]]
    assert position_ids[2].tolist() == [0, 1, 2, 0, 0, 0, 0, 0]
    with pytest.raises(
        ValueError, match=r"sequences\[1\] has length 9 > row_length=8; pass split=True"
    ):
        es.pack_sequences([np.arange(3), np.arange(9)], 8)
    with pytest.raises(ValueError, match="row_length must be positive, got row_length=0"):
        es.pack_sequences([np.arange(3)], 0)


@pytest.mark.usefixtures("no_shape_checks")
def test_pack_rejects_non_1d():
    with pytest.raises(ValueError, match=r"sequences\[0\] must be 1-D, got shape \(2, 2\)"):
        es.pack_sequences([np.zeros((2, 2))], 8)
    with pytest.raises(TypeError, match=r"a list of 1-D arrays, got one array of shape \(5,\)"):
        es.pack_sequences(np.arange(5), 8)


def test_pack_empty_inputs_jax_arrays_and_pad_token():
    tokens, segment_ids, _ = es.pack_sequences([], 4)
    assert tokens.shape == segment_ids.shape == (0, 4)
    tokens, _, _ = es.pack_sequences([np.array([], np.int16)], 4)
    assert tokens.shape == (0, 4)
    tokens, segment_ids, _ = es.pack_sequences([jnp.array([3, 4], jnp.int32)], 4, pad_token=-7)
    assert tokens.tolist() == [[3, 4, -7, -7]]
    assert segment_ids.tolist() == [[0, 0, -1, -1]]
    assert tokens.dtype == np.int32


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 99), max_size=12), max_size=12),
    st.integers(1, 10),
    st.booleans(),
)
def test_pack_matches_brute_force_ffd(sequences, row_length, split):
    arrays = [np.array(s, np.int64) for s in sequences]
    try:
        expected = _ref_pack(sequences, row_length, split)
    except ValueError:
        with pytest.raises(ValueError, match="pass split=True"):
            es.pack_sequences(arrays, row_length, split=split)
        return
    tokens, segment_ids, position_ids = es.pack_sequences(arrays, row_length, split=split)
    assert tokens.tolist() == expected[0]
    assert segment_ids.tolist() == expected[1]
    assert position_ids.tolist() == expected[2]
    assert tokens.shape == (len(expected[0]), row_length)
