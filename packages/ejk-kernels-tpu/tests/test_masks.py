"""Mask classes against dense NumPy definitions; hashing, composition, errors."""

import jax
import numpy as np
import pytest

from ejk_kernels_tpu import (
    CausalMask,
    ChunkedCausalMask,
    FullMask,
    LocalMask,
    MultiHeadMask,
    NumpyMask,
)

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
