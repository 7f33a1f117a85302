"""`validate_attention`: the normal form every backend receives, and errors that name the argument."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ejk_sequtils import AttentionRequest, describe_value, fold_sinks, validate_attention

B, T, S, N, K, H = 2, 7, 9, 6, 2, 8


@pytest.fixture
def qkv():
    rng = np.random.default_rng(0)
    return tuple(
        jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H))
    )


def test_normal_form(qkv):
    q_ids = jnp.zeros((B, T), jnp.int32)
    kv_ids = jnp.zeros((B, S), jnp.int32)
    r = validate_attention(*qkv, sliding_window=3, segment_ids=[q_ids, kv_ids])
    assert isinstance(r, AttentionRequest)
    assert r.sliding_window == (3, 3)
    assert r.segment_ids == (q_ids, kv_ids)
    assert r.softmax_scale == H**-0.5
    assert r.shape == (B, T, S, N, K, H)
    assert r.features() == {"sliding_window", "segment_ids"}
    assert r.dropout_seed is None


def test_several_sinks_per_head_are_folded(qkv):
    sinks = jnp.asarray(np.random.default_rng(1).standard_normal((N, 3)), jnp.float32)
    r = validate_attention(*qkv, softmax_sinks=sinks)
    assert r.softmax_sinks.shape == (N,)
    np.testing.assert_allclose(r.softmax_sinks, fold_sinks(sinks))


def test_empty_axes_are_valid():
    for b, t, s in ((0, 3, 4), (2, 0, 4), (2, 3, 0)):
        q = jnp.zeros((b, t, 2, 4))
        k = jnp.zeros((b, s, 1, 4))
        assert validate_attention(q, k, k).shape == (b, t, s, 2, 1, 4)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"dropout_rate": 0.1, "dropout_seed": 1.5},
            TypeError,
            r"dropout_seed must be an int, an int32/uint32 scalar array or a jax.random.key, got 1\.5",
        ),
        ({"dropout_rate": 0.1, "dropout_seed": True}, TypeError, r"dropout_seed must be an int"),
        ({"dropout_rate": 0.1}, ValueError, r"dropout_seed is required when dropout_rate=0\.1"),
        (
            {"softmax_sinks": jnp.zeros((N + 1,))},
            ValueError,
            r"softmax_sinks must have shape \[N\]=\(6,\) or \[N, num_sinks\]",
        ),
        ({"softmax_sinks": jnp.zeros((N, 2, 1))}, ValueError, r"softmax_sinks\.shape=\(6, 2, 1\)"),
        ({"segment_ids": jnp.zeros((B, T), jnp.int32)}, ValueError, r"is for self attention"),
        (
            {"sliding_window": (1, 2, 3)},
            ValueError,
            r"sliding_window must be an int or \(left, right\)",
        ),
        ({"sliding_window": -1}, ValueError, r"sliding_window sizes must be >= 0, got -1"),
        (
            {"cu_seqlens_q": jnp.asarray([1, 3])},
            ValueError,
            r"packed input \(cu_seqlens_q\) needs batch 1",
        ),
        (
            {"logits_soft_cap": 0.0},
            ValueError,
            r"logits_soft_cap must be a finite number > 0, got 0\.0",
        ),
        ({"causal": 1}, TypeError, r"causal must be a bool, got 1"),
    ],
)
def test_bad_arguments_are_named(qkv, kwargs, error, match):
    with pytest.raises(error, match=match):
        validate_attention(*qkv, **kwargs)


def test_cu_seqlens_must_start_at_zero(qkv):
    q, k, v = (x[:1, :7] for x in qkv)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must start at 0, got cu_seqlens_q\[0\]=1"):
        validate_attention(q, k, v, cu_seqlens_q=jnp.asarray([1, 3, 7]))
    r = validate_attention(q, k, v, cu_seqlens_q=jnp.asarray([0, 3, 7]))
    assert r.cu_seqlens_k is r.cu_seqlens_q


def test_a_prng_key_seeds_dropout(qkv):
    import jax

    key = jax.random.key(7)
    r = validate_attention(*qkv, dropout_rate=0.2, dropout_seed=key)
    assert r.dropout_seed.dtype == jnp.uint32 and r.dropout_seed.shape == ()
    assert r.dropout_seed == jax.random.bits(key, dtype=jnp.uint32)
    traced = jax.jit(
        lambda k: validate_attention(*qkv, dropout_rate=0.2, dropout_seed=k).dropout_seed
    )
    assert traced(key) == r.dropout_seed
    with pytest.raises(ValueError, match=r"a single PRNG key, got dropout_seed.shape=\(2,\)"):
        validate_attention(*qkv, dropout_rate=0.2, dropout_seed=jax.random.split(key))


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (np.zeros((2, 32, 4, 16), np.float32).tolist(), "list of shape (2, 32, 4, 16)"),
        (jnp.zeros((3, 5), jnp.bfloat16), "ArrayImpl of shape (3, 5) and dtype bfloat16"),
        (np.zeros(7, np.int32), "ndarray of shape (7,) and dtype int32"),
        ([[0, 1], [2]], "list of length 2"),
        ((-2, 0), "(-2, 0) of type tuple"),
        (2.5, "2.5 of type float"),
    ],
)
def test_describe_value_shows_arrays_by_shape_and_dtype(value, shown):
    assert describe_value(value) == shown


def test_describe_value_bounds_a_long_repr():
    assert len(describe_value("x" * 500)) < 80
