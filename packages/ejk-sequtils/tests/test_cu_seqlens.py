"""cu_seqlens and the per-token / per-chunk views: explicit cases, jit, edge cases, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejk_sequtils as es

EMPTY_MIDDLE = [0, 3, 3, 5]
# The functions with one output row per token (and a total_length=).
PER_TOKEN = [
    es.prepare_sequence_ids,
    es.prepare_position_ids,
    es.prepare_token_indices,
    es.cu_seqlens_to_segment_ids,
]


def _np(x):
    return np.asarray(x).tolist()


@pytest.mark.parametrize(
    ("a", "b", "expected"), [(7, 2, 4), (8, 2, 4), (0, 3, 0), (1, 5, 1), (-3, 2, -1), (-4, 2, -2)]
)
def test_cdiv_ints_stay_python_ints(a, b, expected):
    out = es.cdiv(a, b)
    assert type(out) is int
    assert out == expected


def test_cdiv_arrays():
    out = es.cdiv(jnp.array([-3, 0, 1, 4, 5], jnp.int32), 2)
    assert out.dtype == jnp.int32
    assert _np(out) == [-1, 0, 1, 2, 3]
    assert _np(jax.jit(es.cdiv)(jnp.array([5, 6]), jnp.array([2, 3]))) == [3, 2]


def test_cdiv_rejects_non_positive_divisor():
    with pytest.raises(ValueError, match="divisor must be positive, got b=0"):
        es.cdiv(3, 0)


def test_prepare_lens():
    assert _np(es.prepare_lens(jnp.array([0, 5, 12, 18]))) == [5, 7, 6]
    assert _np(es.prepare_lens(np.array(EMPTY_MIDDLE))) == [3, 0, 2]
    assert es.prepare_lens(jnp.array([0, 0])).tolist() == [0]


def test_seed_example_position_ids():
    cu = jnp.array([0, 3, 5, 9])
    assert _np(es.prepare_position_ids(cu)) == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert _np(es.prepare_sequence_ids(cu)) == [0, 0, 0, 1, 1, 2, 2, 2, 2]


def test_empty_sequence_inside_cu_seqlens():
    cu = jnp.array(EMPTY_MIDDLE)
    assert _np(es.prepare_sequence_ids(cu)) == [0, 0, 0, 2, 2]
    assert _np(es.prepare_position_ids(cu)) == [0, 1, 2, 0, 1]
    assert _np(es.cu_seqlens_to_segment_ids(cu)) == [0, 0, 0, 2, 2]
    assert _np(es.prepare_token_indices(cu)) == [[0, 0], [0, 1], [0, 2], [2, 0], [2, 1]]


def test_empty_sequences_at_both_ends_and_all_empty():
    cu = jnp.array([0, 0, 2, 2])
    assert _np(es.prepare_sequence_ids(cu)) == [1, 1]
    assert es.prepare_sequence_ids(jnp.array([0, 0, 0])).shape == (0,)
    assert _np(es.prepare_sequence_ids(jnp.array([0, 0, 0]), total_length=2)) == [-1, -1]


def test_single_token_sequences():
    cu = jnp.arange(5)
    assert _np(es.prepare_sequence_ids(cu)) == [0, 1, 2, 3]
    assert _np(es.prepare_position_ids(cu)) == [0, 0, 0, 0]


def test_total_length_pads_and_truncates():
    cu = jnp.array([0, 2, 3])
    assert _np(es.prepare_sequence_ids(cu, total_length=5)) == [0, 0, 1, -1, -1]
    assert _np(es.prepare_position_ids(cu, total_length=5)) == [0, 1, 0, 0, 0]
    assert _np(es.cu_seqlens_to_segment_ids(cu, total_length=5)) == [0, 0, 1, -1, -1]


def test_cu_seqlens_to_segment_ids_numbers_from_0_and_pads_with_minus_1():
    # Under the old rule (id = sequence index + 1, padding 0) this was [1, 1, 1, 3, 3, 0].
    segment_ids = es.cu_seqlens_to_segment_ids(jnp.array(EMPTY_MIDDLE), 6)
    assert segment_ids.dtype == jnp.int32
    assert _np(segment_ids) == [0, 0, 0, 2, 2, -1]
    # The first sequence (id 0) attends within itself; the padding token sees nothing.
    mask = np.asarray(es.segment_ids_to_mask(segment_ids))
    assert mask[:3, :3].all() and not mask[:3, 3:].any()
    assert not mask[5].any() and not mask[:, 5].any()


@pytest.mark.usefixtures("no_shape_checks")
def test_cu_seqlens_must_start_at_0():
    for fn in (es.prepare_sequence_ids, es.cu_seqlens_to_segment_ids, es.prepare_lens):
        with pytest.raises(ValueError, match=r"cu_seqlens must start at 0, got cu_seqlens\[0\]=2"):
            fn(jnp.array([2, 4]))
    with pytest.raises(ValueError, match=r"must start at 0, got cu_seqlens\[0\]=1"):
        es.prepare_chunk_indices(np.array([1, 3, 5]), 2)
    # A traced start cannot be checked: the tokens before it come out as padding.
    traced = jax.jit(lambda cu: es.prepare_sequence_ids(cu, total_length=4))(jnp.array([2, 4]))
    assert _np(traced) == [-1, -1, 0, 0]


@pytest.mark.parametrize("fn", PER_TOKEN)
def test_per_token_functions_under_jit(fn):
    cu = jnp.array(EMPTY_MIDDLE, jnp.int32)
    eager = fn(cu)
    jitted = jax.jit(fn, static_argnames="total_length")(cu, total_length=5)
    np.testing.assert_array_equal(jitted, eager)
    with pytest.raises(ValueError, match=r"traced .* pass the static length as total_length="):
        jax.jit(fn)(cu)


def test_chunk_offsets_and_indices():
    cu = jnp.array([0, 5, 5, 7, 8])
    assert _np(es.prepare_chunk_offsets(cu, 2)) == [0, 3, 3, 4, 5]
    assert _np(es.prepare_chunk_indices(cu, 2)) == [[0, 0], [0, 1], [0, 2], [2, 0], [3, 0]]
    jitted = jax.jit(lambda c: es.prepare_chunk_indices(c, 2, total_chunks=7))(cu)
    assert _np(jitted)[5:] == [[-1, 0], [-1, 0]]
    with pytest.raises(ValueError, match="total_chunks="):
        jax.jit(lambda c: es.prepare_chunk_indices(c, 2))(cu)


def test_segment_ids_to_cu_seqlens():
    assert _np(es.segment_ids_to_cu_seqlens(jnp.array([0, 0, 0, 2, 2]))) == [0, 3, 5]
    assert _np(es.segment_ids_to_cu_seqlens(jnp.array([7, 2, 2, -1, -3]))) == [0, 1, 3]
    assert _np(es.segment_ids_to_cu_seqlens(jnp.array([-1, -2, 4, 4]))) == [2, 4]
    assert _np(es.segment_ids_to_cu_seqlens(jnp.array([-1, -1]))) == [0]
    jitted = jax.jit(lambda s: es.segment_ids_to_cu_seqlens(s, num_seqs=4))
    assert _np(jitted(jnp.array([0, 0, 1, -1]))) == [0, 2, 3, 3, 3]
    with pytest.raises(ValueError, match="num_seqs="):
        jax.jit(es.segment_ids_to_cu_seqlens)(jnp.array([0, 0, 1, -1]))


def test_segment_ids_to_cu_seqlens_id_0_is_a_sequence():
    # Under the old rule id 0 was padding: [0, 0, 1, 1] gave [2, 4] (one sequence).
    assert _np(es.segment_ids_to_cu_seqlens(jnp.array([0, 0, 1, 1]))) == [0, 2, 4]
    assert _np(es.segment_ids_to_cu_seqlens(jnp.array([0]))) == [0, 1]
    assert _np(es.segment_ids_to_cu_seqlens(jnp.array([-1, 0, 0, -1]))) == [1, 3]
    jitted = jax.jit(lambda s: es.segment_ids_to_cu_seqlens(s, num_seqs=2))
    assert _np(jitted(jnp.array([0, 0, 1, 1]))) == [0, 2, 4]


def test_segment_ids_to_cu_seqlens_rejects_what_cu_seqlens_cannot_hold():
    with pytest.raises(ValueError, match=r"padding between sequences \(segment_ids\[2\]=-1\)"):
        es.segment_ids_to_cu_seqlens(jnp.array([0, 0, -1, 1]))
    with pytest.raises(ValueError, match="each non-negative id in one contiguous run, got id 0"):
        es.segment_ids_to_cu_seqlens(jnp.array([0, 1, 0]))
    with pytest.raises(ValueError, match="id 1 in several runs"):
        es.segment_ids_to_cu_seqlens(jnp.array([1, 2, 1]))
    # 0 was padding under the old rule, so [1, 0, 2] had a hole; now it is three sequences.
    assert _np(es.segment_ids_to_cu_seqlens(jnp.array([1, 0, 2]))) == [0, 1, 2, 3]


def test_segment_ids_to_position_ids():
    seg = jnp.array([[0, 0, 1, 1, 1, -1], [-1, 5, 5, -2, 5, 5]])
    assert _np(es.segment_ids_to_position_ids(seg)) == [[0, 1, 0, 1, 2, 0], [0, 0, 1, 0, 0, 1]]
    np.testing.assert_array_equal(
        jax.jit(es.segment_ids_to_position_ids)(seg), es.segment_ids_to_position_ids(seg)
    )


def test_segment_ids_to_position_ids_row_starting_with_0_is_a_run():
    # Compared with a zero-filled "previous", a leading 0 would not start a run.
    seg = jnp.array([[0, 0, 0, -1], [0, 0, 3, 3], [-1, 0, 0, 0]])
    expected = [[0, 1, 2, 0], [0, 1, 0, 1], [0, 0, 1, 2]]
    assert _np(es.segment_ids_to_position_ids(seg)) == expected
    assert _np(jax.jit(es.segment_ids_to_position_ids)(seg)) == expected


def test_position_ids_to_segment_ids():
    pos = jnp.array([[0, 1, 2, 0, 1, 0, -1], [3, 4, 0, 1, 0, 0, 0]])
    assert _np(es.position_ids_to_segment_ids(pos)) == [
        [0, 0, 0, 1, 1, 2, -1],
        [0, 0, 1, 1, 2, 3, 4],
    ]
    valid = jnp.array([[1] * 7, [1, 1, 1, 1, 0, 0, 0]], bool)
    assert _np(es.position_ids_to_segment_ids(pos, valid)[1]) == [0, 0, 1, 1, -1, -1, -1]
    assert _np(es.position_ids_to_segment_ids(jnp.array([-1, 0, 1]))) == [-1, 0, 0]


def test_round_trips_on_an_example():
    cu = jnp.array([0, 4, 5, 9])
    seg = es.cu_seqlens_to_segment_ids(cu)
    np.testing.assert_array_equal(es.segment_ids_to_cu_seqlens(seg), cu)
    np.testing.assert_array_equal(es.segment_ids_to_position_ids(seg), es.prepare_position_ids(cu))
    np.testing.assert_array_equal(es.position_ids_to_segment_ids(es.prepare_position_ids(cu)), seg)


@pytest.mark.parametrize(
    ("cu", "error", "match"),
    [
        (
            np.array([0, 3, 2]),
            ValueError,
            r"non-decreasing, got cu_seqlens\[1\]=3 > cu_seqlens\[2\]=2",
        ),
        (np.array([-1, 3]), ValueError, r"must start at 0, got cu_seqlens\[0\]=-1"),
        (np.array([2, 3]), ValueError, r"must start at 0, got cu_seqlens\[0\]=2"),
        (np.array([[0, 3]]), ValueError, r">= 2 entries, got cu_seqlens.shape=\(1, 2\)"),
        (np.array([0.0, 3.0]), TypeError, "integer dtype, got cu_seqlens.dtype=float64"),
        (np.zeros(0, np.int32), ValueError, r">= 2 entries, got cu_seqlens.shape=\(0,\)"),
        (np.array([0]), ValueError, r">= 2 entries, got cu_seqlens.shape=\(1,\)"),
        ([0, 3], TypeError, "integer jax or NumPy array, got \\[0, 3\\] of type list"),
    ],
)
@pytest.mark.usefixtures("no_shape_checks")
def test_bad_cu_seqlens(cu, error, match):
    with pytest.raises(error, match=match):
        es.prepare_position_ids(cu)


@pytest.mark.usefixtures("no_shape_checks")
def test_bad_static_lengths():
    cu = jnp.array([0, 3])
    with pytest.raises(ValueError, match="total_length must be >= 0, got total_length=-1"):
        es.prepare_position_ids(cu, total_length=-1)
    with pytest.raises(TypeError, match=r"total_length must be a Python int or None, got 2\.0"):
        es.prepare_position_ids(cu, total_length=2.0)
    with pytest.raises(ValueError, match="chunk_size must be positive, got chunk_size=0"):
        es.prepare_chunk_offsets(cu, 0)


@pytest.mark.parametrize("fn", PER_TOKEN)
def test_total_length_below_the_last_offset_is_an_error(fn):
    # It used to cut the last sequence off silently ([0, 1, 2] for prepare_position_ids).
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]=5, past total_length=3"):
        fn(jnp.array([0, 3, 5]), total_length=3)
    assert fn(jnp.array([0, 3, 5]), total_length=5).shape[0] == 5  # exactly enough is fine


def test_total_chunks_below_the_number_of_chunks_is_an_error():
    with pytest.raises(ValueError, match="makes 5 chunks, more than total_chunks=4"):
        es.prepare_chunk_indices(jnp.array([0, 5, 5, 7, 8]), 2, total_chunks=4)


def _outcome(call):
    try:
        call()
    except (TypeError, ValueError) as err:
        # The rule each broke, without the value it shows (the two show it differently).
        return type(err).__name__, str(err).replace("cu_seqlens_q", "cu_seqlens").split(", got")[0]
    return "ok", ""


@pytest.mark.parametrize(
    "cu",
    [
        np.array([0, 3, 5]),
        np.array([0, 0]),
        np.array([0, 5, 5], np.uint32),
        np.array([0]),
        np.zeros(0, np.int32),
        np.array([[0, 5]]),
        np.array([0.0, 5.0]),
        np.array([True, False]),
        np.array([1, 5]),
        np.array([0, 4, 2]),
        [0, 5],
        (0, 5),
    ],
    ids=repr,
)
@pytest.mark.usefixtures("no_shape_checks")
def test_cu_seqlens_accepted_exactly_as_validate_attention_accepts_them(cu):
    q = jnp.zeros((1, 5, 2, 8), jnp.float32)
    attention = _outcome(lambda: es.validate_attention(q, q, q, cu_seqlens_q=cu))
    helpers = _outcome(lambda: es.prepare_position_ids(cu, total_length=5))
    assert helpers == attention
    assert _outcome(lambda: es.prepare_lens(cu))[0] == attention[0]


@pytest.mark.parametrize(
    ("cu", "total", "valid"),
    [
        ([0, 3, 3, 5], 5, True),
        ([0, 3, 3, 5], 8, True),  # padding after the last sequence
        ([0, 0], 0, True),
        ([0, 4, 3, 5], 5, False),  # decreasing
        ([1, 3, 5], 5, False),  # not from 0
        ([0, 3, 6], 5, False),  # past the tokens
    ],
)
def test_cu_seqlens_valid_is_the_concrete_check_under_jit(cu, total, valid):
    cu = jnp.array(cu, jnp.int32)
    got = jax.jit(es.cu_seqlens_valid, static_argnums=1)(cu, total)
    assert got.dtype == jnp.bool_ and got.shape == () and bool(got) == valid
    if valid:
        es.cu_seqlens_to_segment_ids(np.asarray(cu), total_length=total)
    else:
        with pytest.raises(ValueError, match="cu_seqlens"):
            es.cu_seqlens_to_segment_ids(np.asarray(cu), total_length=total)


def test_reference_with_invalid_cu_seqlens_under_jit_is_nan():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 6, 2, 4)), jnp.float32) for _ in range(3))

    @jax.jit
    def ref(cu):
        return es.reference_attention(q, k, v, cu_seqlens_q=cu, return_lse=True)

    out, lse = ref(jnp.array([0, 4, 2, 6], jnp.int32))
    assert np.isnan(np.asarray(out)).all() and np.isnan(np.asarray(lse)).all()
    out, _ = ref(jnp.array([0, 2, 6], jnp.int32))
    assert np.isfinite(np.asarray(out)).all()
