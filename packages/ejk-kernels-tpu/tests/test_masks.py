"""Mask classes against dense NumPy definitions; hashing, composition, errors."""

import jax
import numpy as np
import pytest

from ejk_kernels_tpu import (
    CausalMask,
    ChunkedCausalMask,
    FullMask,
    LocalMask,
    LogicalAnd,
    LogicalOr,
    MultiHeadMask,
    NumpyMask,
    make_causal_mask,
    make_chunk_attention_mask,
    make_local_attention_mask,
    make_random_mask,
)
from ejk_kernels_tpu._masks import pad_mask, stored_tiles

T, S = 19, 23
ROW = np.arange(T)[:, None]
COL = np.arange(S)[None, :]


@pytest.mark.parametrize(
    ("mask", "expected"),
    [
        (FullMask((T, S)), np.ones((T, S), bool)),
        (CausalMask((T, S)), COL <= ROW),
        (CausalMask((T, S), offset=4), COL <= ROW + 4),
        (LocalMask((T, S), window_size=(3, 2)), (COL >= ROW - 3) & (COL <= ROW + 2)),
        (LocalMask((T, S), window_size=(None, 0), offset=-1), COL <= ROW - 1),
        (LocalMask((T, S), window_size=(2, None)), COL >= ROW - 2),
        (ChunkedCausalMask((T, S), chunk_size=5), (COL <= ROW) & (ROW // 5 == COL // 5)),
    ],
    ids=repr,
)
def test_mask_matches_dense_definition(mask, expected):
    np.testing.assert_array_equal(mask.dense(), expected)
    np.testing.assert_array_equal(mask[3:11, 5:9], expected[3:11, 5:9])
    np.testing.assert_array_equal(mask[4, 2:7], expected[4, 2:7])
    assert mask[-1, -1] == expected[-1, -1]


def test_composition():
    causal = CausalMask((T, S))
    local = LocalMask((T, S), window_size=(4, 4))
    chunk = ChunkedCausalMask((T, S), chunk_size=6)
    np.testing.assert_array_equal((causal & local).dense(), causal.dense() & local.dense())
    np.testing.assert_array_equal((chunk | local).dense(), chunk.dense() | local.dense())
    np.testing.assert_array_equal(
        ((causal & local) | chunk).dense(), (causal.dense() & local.dense()) | chunk.dense()
    )


def test_hash_and_equality_by_value():
    assert CausalMask((T, S)) == CausalMask((T, S))
    assert hash(CausalMask((T, S))) == hash(CausalMask((T, S)))
    assert CausalMask((T, S)) != CausalMask((T, S), offset=1)
    assert CausalMask((T, S)) != FullMask((T, S))
    a = np.random.default_rng(0).random((T, S)) < 0.5
    assert NumpyMask(a) == NumpyMask(a.copy())
    assert hash(NumpyMask(a)) == hash(NumpyMask(a.copy()))
    assert NumpyMask(a) != NumpyMask(~a)
    both = CausalMask((T, S)) & FullMask((T, S))
    assert both == CausalMask((T, S)) & FullMask((T, S))
    assert len({both, CausalMask((T, S)) & FullMask((T, S))}) == 1


def test_mask_is_a_static_jit_argument():
    calls = []

    def f(x, mask):
        calls.append(1)
        return x * mask.shape[0]

    g = jax.jit(f, static_argnums=1)
    g(1.0, CausalMask((T, S)))
    g(1.0, CausalMask((T, S)))
    assert len(calls) == 1


def test_multi_head_mask():
    masks = [CausalMask((T, S)), LocalMask((T, S), window_size=(1, 1))]
    mh = MultiHeadMask(masks)
    assert mh.shape == (2, T, S)
    np.testing.assert_array_equal(mh.dense(), np.stack([m.dense() for m in masks]))
    np.testing.assert_array_equal(mh[1, 2:5, :], masks[1][2:5, :])
    assert mh == MultiHeadMask(list(masks))


def test_bool_context_explains_operators():
    a, b = CausalMask((T, S)), FullMask((T, S))
    with pytest.raises(TypeError, match=r"`&`.*`\|`"):
        bool(a)
    with pytest.raises(TypeError, match="no truth value"):
        _ = a and b
    # splash attention's masks raise NotImplementedError here: code catching that works too.
    with pytest.raises(NotImplementedError, match="no truth value"):
        _ = a or b


def test_make_helpers_are_the_dense_masks():
    np.testing.assert_array_equal(make_causal_mask((T, S), offset=-2), COL <= ROW - 2)
    np.testing.assert_array_equal(
        make_local_attention_mask((T, S), (3, None), offset=1), COL >= ROW + 1 - 3
    )
    np.testing.assert_array_equal(
        make_chunk_attention_mask((T, S), chunk_size=4), (COL <= ROW) & (ROW // 4 == COL // 4)
    )
    with pytest.raises(ValueError, match="chunk_size"):
        make_chunk_attention_mask((T, S), chunk_size=0)
    r = make_random_mask((T, S), 0.7, seed=3)
    assert r.dtype == np.bool_ and r.shape == (T, S)
    np.testing.assert_array_equal(r, make_random_mask((T, S), 0.7, seed=3))
    assert 0.5 < 1 - r.mean() < 0.9
    assert make_random_mask((T, S), 0.0, seed=1).all()
    with pytest.raises(ValueError, match="sparsity"):
        make_random_mask((T, S), 1.5, seed=1)


def test_logical_classes_are_the_operators():
    causal, local = CausalMask((T, S)), LocalMask((T, S), window_size=(2, 2))
    assert causal & local == LogicalAnd(causal, local)
    assert causal | local == LogicalOr(causal, local)
    assert LogicalAnd(causal, local) != LogicalOr(causal, local)
    assert isinstance(causal & local, LogicalAnd) and (causal | local).left == causal
    with pytest.raises(ValueError, match="shapes differ"):
        LogicalOr(causal, CausalMask((T, S + 1)))
    with pytest.raises(TypeError, match="right must be a 2-d Mask"):
        LogicalAnd(causal, MultiHeadMask([causal]))


def test_shard_count_divides_q_len():
    assert CausalMask((32, 8), shard_count=4).shard_count == 4
    assert LocalMask((32, 8), (1, 1), 0, 2).shard_count == 2
    assert ChunkedCausalMask((32, 8), chunk_size=4, shard_count=2).shard_count == 2
    # The shard count does not change the mask.
    assert CausalMask((32, 8), shard_count=4) == CausalMask((32, 8))
    for build in (
        lambda: CausalMask((24, 8), shard_count=4),
        lambda: LocalMask((24, 8), (1, 1), shard_count=4),
        lambda: ChunkedCausalMask((24, 8), chunk_size=4, shard_count=4),
    ):
        with pytest.raises(ValueError, match=r"Shard count squared \(16\)|shard_count squared"):
            build()
    with pytest.raises(ValueError, match="shard_count must be a positive int"):
        CausalMask((32, 8), shard_count=0)


def _random_computable(rng, shape):
    """A random composition of causal, local and chunked masks (with offsets and padding)."""

    def leaf():
        kind = rng.integers(3)
        if kind == 0:
            return CausalMask(shape, offset=int(rng.integers(-4, 5)))
        if kind == 1:
            sides = [None if rng.random() < 0.3 else int(rng.integers(0, 6)) for _ in range(2)]
            return LocalMask(shape, window_size=tuple(sides), offset=int(rng.integers(-3, 4)))
        return ChunkedCausalMask(shape, chunk_size=int(rng.integers(1, 9)))

    mask = leaf()
    for _ in range(int(rng.integers(0, 3))):
        mask = (mask & leaf()) if rng.random() < 0.5 else (mask | leaf())
    return mask


@pytest.mark.parametrize("seed", range(12))
def test_mask_function_is_the_mask(seed):
    """The function the kernels evaluate equals the mask on NumPy and on traced indices."""
    rng = np.random.default_rng(seed)
    mask = pad_mask(_random_computable(rng, (T, S)), T + 5, S + 9)
    fn = mask.mask_function
    assert fn is not None
    dense = mask.dense()
    rows, cols = np.arange(T + 5)[:, None], np.arange(S + 9)[None, :]
    np.testing.assert_array_equal(np.broadcast_to(fn(rows, cols), dense.shape), dense)
    traced = jax.jit(lambda r, c: fn(r, c))(rows.astype(np.int32), cols.astype(np.int32))
    np.testing.assert_array_equal(np.broadcast_to(traced, dense.shape), dense)
    # The dkv kernel evaluates it transposed: keys as rows, queries as columns.
    np.testing.assert_array_equal(np.broadcast_to(fn(rows.T, cols.T), dense.T.shape), dense.T)
    np.testing.assert_array_equal(mask.q_sequence, np.arange(T + 5, dtype=np.int32))


def test_masks_without_a_mask_function():
    a = np.random.default_rng(0).random((T, S)) < 0.5
    for mask in (
        NumpyMask(a),
        FullMask((T, S)),
        CausalMask((T, S)) & NumpyMask(a),
        MultiHeadMask([CausalMask((T, S))]),
        stored_tiles(CausalMask((T, S))),
    ):
        assert mask.mask_function is None and mask.q_sequence is None
    assert stored_tiles(CausalMask((T, S))).dense().tolist() == CausalMask((T, S)).dense().tolist()
    # A FullMask has nothing to compute alone, but composes with computable masks.
    assert (CausalMask((T, S)) & FullMask((T, S))).mask_function is not None


@pytest.mark.parametrize(
    ("build", "exc", "match"),
    [
        (lambda: CausalMask((0, 4)), ValueError, r"shape must be \(q_len, kv_len\)"),
        (lambda: LocalMask((4, 4), window_size=(-1, 2)), ValueError, "window_size"),
        (lambda: ChunkedCausalMask((4, 4), chunk_size=0), ValueError, "chunk_size"),
        (lambda: NumpyMask(np.ones((2, 2), np.int32)), TypeError, "dtype bool"),
        (lambda: NumpyMask(np.ones(3, bool)), ValueError, r"shape \(3,\)"),
        (lambda: MultiHeadMask([]), ValueError, "at least one"),
        (
            lambda: MultiHeadMask([CausalMask((4, 4)), CausalMask((4, 5))]),
            ValueError,
            "one shape",
        ),
        (lambda: CausalMask((4, 4)) & CausalMask((4, 5)), ValueError, "shapes differ"),
    ],
)
def test_errors(build, exc, match):
    with pytest.raises(exc, match=match):
        build()


@pytest.mark.parametrize(
    ("causal", "window"),
    [(False, None), (True, None), (False, 3), (True, 4), (False, (2, 5)), (True, (6, 1))],
)
def test_attention_mask_matches_the_reference_visibility(causal, window):
    from ejk_kernels_tpu import attention_mask
    from ejk_sequtils import visibility_mask

    got = attention_mask(T, S, causal=causal, sliding_window=window).dense()
    want = np.asarray(visibility_mask(T, S, causal=causal, sliding_window=window))[0, 0]
    np.testing.assert_array_equal(got, want)


def test_attention_mask_rejects_bad_windows():
    from ejk_kernels_tpu import attention_mask

    with pytest.raises(ValueError, match="sliding_window"):
        attention_mask(T, S, sliding_window=(1, -2))
