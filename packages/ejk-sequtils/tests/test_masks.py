"""Masks from segment ids and back, and lengths from padding masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejk_sequtils as es


def _np(x):
    return np.asarray(x).tolist()


def test_lens_and_cu_seqlens_from_mask():
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
    assert _np(es.prepare_lens_from_mask(mask)) == [3, 2]
    assert _np(es.prepare_cu_seqlens_from_mask(mask)) == [0, 3, 5]


def test_mask_not_left_aligned():
    mask = np.array([[0, 1, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert _np(es.prepare_lens_from_mask(mask)) == [2, 1, 0]
    cu = es.prepare_cu_seqlens_from_mask(mask, out_dtype=jnp.int16)
    assert cu.dtype == jnp.int16
    assert _np(cu) == [0, 2, 3, 3]
    assert _np(jax.jit(es.prepare_cu_seqlens_from_mask)(mask)) == [0, 2, 3, 3]


def test_cu_seqlens_from_mask_rejects_float_out_dtype():
    with pytest.raises(TypeError, match="out_dtype must be an integer dtype"):
        es.prepare_cu_seqlens_from_mask(jnp.ones((1, 2), bool), out_dtype=jnp.float32)


def test_self_attention_mask_id_0_is_a_segment_and_negatives_are_padding():
    seg = jnp.array([[0, 0, 1, -1], [0, 1, -1, -1]])
    mask = es.segment_ids_to_mask(seg)
    assert mask.shape == (2, 4, 4)
    assert mask.dtype == jnp.bool_
    # The first two tokens (id 0) get a 2x2 block; under the old rule they saw nothing.
    assert _np(mask[0].astype(int)) == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
    # Two padding tokens with equal ids (-1, -1) still see nothing.
    assert not bool(mask[1, 2:].any()) and not bool(mask[1, :, 2:].any())
    assert _np(mask[1, 0]) == [True, False, False, False]


def test_every_negative_id_is_padding():
    mask = es.segment_ids_to_mask(jnp.array([[-1, -2, -2, 0]]))
    assert _np(mask[0].astype(int)) == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1]]
    q_mask, kv_mask, _ = es.segment_ids_to_mask(
        (jnp.array([[-1, -2]]), jnp.array([[-1, -2, 0]])), return_separate_masks=True
    )
    assert _np(q_mask) == [[False, False]]
    assert _np(kv_mask) == [[False, False, True]]


def test_cross_attention_mask_and_separate_masks():
    q = jnp.array([[0, 0, 1, -1]])
    kv = jnp.array([[0, 1, 1, -1, -2, 1]])
    q_mask, kv_mask, mask = es.segment_ids_to_mask(
        (q, kv), dtype=jnp.float32, return_separate_masks=True
    )
    assert (q_mask.shape, kv_mask.shape, mask.shape) == ((1, 4), (1, 6), (1, 4, 6))
    assert mask.dtype == jnp.float32
    assert _np(q_mask[0]) == [1, 1, 1, 0]
    assert _np(kv_mask[0]) == [1, 1, 1, 0, 0, 1]
    assert _np(mask[0, 2]) == [0, 1, 1, 0, 0, 1]
    jitted = jax.jit(lambda a, b: es.segment_ids_to_mask((a, b)))(q, kv)
    np.testing.assert_array_equal(jitted, mask.astype(bool))


@pytest.mark.usefixtures("no_shape_checks")
def test_segment_ids_to_mask_errors():
    with pytest.raises(ValueError, match="a sequence of 3"):
        es.segment_ids_to_mask((jnp.ones((1, 2), int),) * 3)
    with pytest.raises(
        ValueError, match=r"share their leading \(batch\) axes, got shapes \(2, 3\) and \(1, 3\)"
    ):
        es.segment_ids_to_mask((jnp.ones((2, 3), int), jnp.ones((1, 3), int)))
    with pytest.raises(
        TypeError, match=r"segment_ids must have an integer dtype, got segment_ids\.dtype=float32"
    ):
        es.segment_ids_to_mask(jnp.ones((2, 3)))


def test_mask_to_segment_ids_round_trip_on_packed_rows():
    seg = jnp.array([[0, 0, 1, 1, 1, -1], [3, -2, 3, 0, 0, 0]])
    mask = es.segment_ids_to_mask(seg)
    q_ids, kv_ids = es.mask_to_segment_ids(mask)
    assert q_ids.dtype == kv_ids.dtype == jnp.int32
    assert _np(q_ids) == [[0, 0, 1, 1, 1, -1], [0, -1, 0, 1, 1, 1]]
    np.testing.assert_array_equal(q_ids, kv_ids)
    np.testing.assert_array_equal(es.segment_ids_to_mask(q_ids), mask)
    assert _np(es.is_segment_representable(mask)) == [True, True]


def test_mask_to_segment_ids_cross_attention_and_padding_id():
    mask = es.segment_ids_to_mask((jnp.array([[1, -1, 0]]), jnp.array([[0, 0, -1, 1]])))
    q_ids, kv_ids = es.mask_to_segment_ids(mask[0])
    assert _np(q_ids) == [0, -1, 1]
    assert _np(kv_ids) == [1, 1, -1, 0]
    q_ids, kv_ids = es.mask_to_segment_ids(mask[0], padding_id=-5)
    assert _np(q_ids) == [0, -5, 1]
    assert _np(kv_ids) == [1, 1, -5, 0]


def test_mask_to_segment_ids_numbers_from_0():
    # One block covering everything is segment 0 (under the old rule it was 1).
    q_ids, kv_ids = es.mask_to_segment_ids(jnp.ones((3, 2), bool))
    assert _np(q_ids) == [0, 0, 0]
    assert _np(kv_ids) == [0, 0]
    q_ids, kv_ids = es.mask_to_segment_ids(jnp.zeros((2, 3), bool))
    assert _np(q_ids) == [-1, -1]
    assert _np(kv_ids) == [-1, -1, -1]
    # Ids that a 0-padded mask-to-ids would turn into padding still rebuild the mask.
    mask = es.segment_ids_to_mask(jnp.array([0, 1, 0, -1]))
    assert bool(es.is_segment_representable(mask))
    q_ids, _ = es.mask_to_segment_ids(mask)
    assert _np(q_ids) == [0, 1, 0, -1]


def test_mask_to_segment_ids_banded_mask_is_not_representable():
    # The seed's example: overlapping windows have no segment ids.
    band = jnp.array([[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]], bool)
    assert not bool(es.is_segment_representable(band))
    assert not bool(es.is_segment_representable(jnp.tril(jnp.ones((5, 5), bool))))
    assert bool(es.is_segment_representable(jnp.eye(5, dtype=bool)))
    assert bool(es.is_segment_representable(jnp.zeros((3, 4), bool)))


def test_mask_to_segment_ids_per_head():
    seg = jnp.array([[0, 0, 1, 1], [0, 1, 1, 1]])
    mask = jnp.stack(
        [es.segment_ids_to_mask(seg), es.segment_ids_to_mask(seg[::-1])], axis=1
    )  # [2, 2, 4, 4]
    q_ids, kv_ids = es.mask_to_segment_ids(mask, per_head=True)
    assert q_ids.shape == kv_ids.shape == (2, 2, 4)
    np.testing.assert_array_equal(q_ids[:, 0], seg)
    assert _np(es.is_segment_representable(mask, per_head=True)) == [[True, True], [True, True]]
    # Heads differ, so one set of ids per batch element cannot be exact.
    assert _np(es.is_segment_representable(mask)) == [False, False]
    same = jnp.broadcast_to(es.segment_ids_to_mask(seg)[:, None], (2, 3, 4, 4))
    q_ids, _ = es.mask_to_segment_ids(same)
    np.testing.assert_array_equal(q_ids, seg)
    assert _np(es.is_segment_representable(same)) == [True, True]


def test_mask_to_segment_ids_under_jit_and_int_masks():
    mask = es.segment_ids_to_mask(jnp.array([[0, 1, 1, -1]])).astype(jnp.int32)
    eager = es.mask_to_segment_ids(mask)
    jitted = jax.jit(es.mask_to_segment_ids, static_argnames=("per_head", "padding_id"))(mask)
    for a, b in zip(eager, jitted, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.usefixtures("no_shape_checks")
def test_mask_to_segment_ids_errors():
    with pytest.raises(ValueError, match=r"got mask.shape=\(4,\)"):
        es.mask_to_segment_ids(jnp.ones(4, bool))
    with pytest.raises(
        ValueError, match=r"per_head=True needs a \[B, H, Q, K\] mask, got mask.shape=\(2, 2\)"
    ):
        es.mask_to_segment_ids(jnp.ones((2, 2), bool), per_head=True)
    for bad in (0, 1, True, -1.0, "-1"):
        with pytest.raises(
            ValueError, match=rf"padding_id must be a negative int, got padding_id={bad!r}"
        ):
            es.mask_to_segment_ids(jnp.ones((2, 2), bool), padding_id=bad)


def test_mask_to_segment_ids_on_several_row_blocks():
    # 600 rows: blocks of 256 rows, the last one overlapping the one before.
    rng = np.random.default_rng(0)
    q = np.sort(rng.integers(-3, 40, 600)).astype(np.int32)
    kv = rng.permutation(np.repeat(np.arange(-3, 40), 13)[:523]).astype(np.int32)
    mask = es.segment_ids_to_mask((q[None], kv[None]))
    q_ids, kv_ids = es.mask_to_segment_ids(mask)
    np.testing.assert_array_equal(es.segment_ids_to_mask((q_ids, kv_ids)), mask)
    assert bool(es.is_segment_representable(mask)[0])
    # One extra attended key in the last (overlapping) block breaks it.
    row = 590
    col = int(np.flatnonzero(~np.asarray(mask[0, row]))[0])
    assert not bool(es.is_segment_representable(mask.at[0, row, col].set(True))[0])
    # And one in the first block.
    col = int(np.flatnonzero(~np.asarray(mask[0, 3]))[0])
    assert not bool(es.is_segment_representable(mask.at[0, 3, col].set(True))[0])
