"""log_sum_exp, safe_divide, chunking and the gradient dtype cast."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejk_sequtils as es


def test_log_sum_exp_is_stable_and_matches_jax():
    x = jnp.array([1000.0, 1001.0, 1002.0])
    np.testing.assert_allclose(
        es.log_sum_exp(x), 1002.0 + np.log1p(np.exp(-1) + np.exp(-2)), rtol=1e-6
    )
    y = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 7))
    for axis, keepdims in [(None, False), (1, False), ((0, 2), True), (-1, True)]:
        np.testing.assert_allclose(
            es.log_sum_exp(y, axis=axis, keepdims=keepdims),
            jax.nn.logsumexp(y, axis=axis, keepdims=keepdims),
            rtol=1e-6,
        )


def test_log_sum_exp_fully_masked_row_has_no_nan():
    x = jnp.array([[-jnp.inf, -jnp.inf], [0.0, -jnp.inf]])
    out = es.log_sum_exp(x, axis=1)
    assert _list(out) == [-np.inf, 0.0]
    grad = jax.grad(lambda v: es.log_sum_exp(v, axis=1)[1] + 0 * es.log_sum_exp(v, axis=1)[0])(x)
    assert np.isfinite(np.asarray(grad)).all()
    assert _list(jax.grad(lambda v: es.log_sum_exp(v))(jnp.full(3, -jnp.inf))) == [0.0, 0.0, 0.0]
    assert es.log_sum_exp(jnp.array([1.0, jnp.inf])) == jnp.inf


def _list(x):
    return np.asarray(x).tolist()


def test_log_sum_exp_keeps_dtype():
    assert es.log_sum_exp(jnp.ones((4,), jnp.bfloat16)).dtype == jnp.bfloat16


def test_safe_divide():
    num = jnp.array([1.0, 1.0, 1.0, 6.0])
    den = jnp.array([0.0, -1e-12, -2.0, 3.0])
    assert _list(es.safe_divide(num, den, 1e-6)) == pytest.approx([1e6, -1e6, -0.5, 2.0])
    assert np.isfinite(
        np.asarray(jax.grad(lambda d: es.safe_divide(1.0, d).sum())(jnp.zeros(2)))
    ).all()
    with pytest.raises(ValueError, match="min_denominator must be > 0, got min_denominator=0"):
        es.safe_divide(num, den, 0)


def test_chunk_array_seed_example_and_round_trip():
    chunks = es.chunk_array(jnp.arange(10), 4)
    assert _list(chunks) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0]]
    assert _list(es.unchunk_array(chunks, 10)) == list(range(10))
    x = jnp.arange(2 * 7 * 3).reshape(2, 7, 3)
    for axis in [0, 1, 2, -1, -2]:
        y = es.chunk_array(x, 3, axis=axis, pad_value=-5)
        np.testing.assert_array_equal(es.unchunk_array(y, x.shape[axis], axis=axis), x)
    assert es.chunk_array(x, 3, axis=1).shape == (2, 3, 3, 3)
    jitted = jax.jit(lambda v: es.unchunk_array(es.chunk_array(v, 4, axis=-1), 3, axis=-1))(x)
    np.testing.assert_array_equal(jitted, x)


def test_chunk_array_exact_multiple_and_empty():
    assert es.chunk_array(jnp.arange(8), 4).shape == (2, 4)
    assert es.chunk_array(jnp.zeros((0, 3)), 4).shape == (0, 4, 3)


def test_chunk_errors():
    with pytest.raises(ValueError, match="chunk_size must be positive, got chunk_size=0"):
        es.chunk_array(jnp.arange(3), 0)
    with pytest.raises(ValueError, match="axis=2 is out of range for an array with 1 axes"):
        es.chunk_array(jnp.arange(3), 2, axis=2)
    with pytest.raises(ValueError, match=r"original_length=9 must be in \[0, 8\]"):
        es.unchunk_array(jnp.zeros((2, 4)), 9)


def test_identity_dtype_convert():
    to_f32 = es.identity_dtype_convert(jnp.float32)
    x = jnp.ones(3, jnp.bfloat16)
    y = to_f32(x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(y, x)
    grad = jax.jit(jax.grad(lambda v: to_f32(v).astype(jnp.float32).sum()))(x)
    assert grad.dtype == jnp.float32
    assert _list(grad) == [1.0, 1.0, 1.0]


def test_log_sum_exp_and_safe_divide_under_jit():
    x = jnp.array([[0.0, -jnp.inf, 2.0], [-jnp.inf, -jnp.inf, -jnp.inf]])
    np.testing.assert_array_equal(
        jax.jit(lambda v: es.log_sum_exp(v, axis=-1))(x), es.log_sum_exp(x, axis=-1)
    )
    d = jnp.array([0.0, -3.0, 1e-12])
    np.testing.assert_array_equal(
        jax.jit(es.safe_divide)(jnp.ones(3), d), es.safe_divide(jnp.ones(3), d)
    )
