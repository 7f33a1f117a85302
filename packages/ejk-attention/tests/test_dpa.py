"""`dot_product_attention` against ``jax.nn.dot_product_attention`` (its xla path) on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import dot_product_attention

B, T, S, N, K, H = 2, 11, 13, 6, 3, 8


def _inputs(t=T, s=S, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, t, N, H)), dtype)
    k = jnp.asarray(rng.standard_normal((B, s, K, H)), dtype)
    v = jnp.asarray(rng.standard_normal((B, s, K, H)), dtype)
    return q, k, v


def _case(name):
    rng = np.random.default_rng(1)
    return {
        "plain": {},
        "bias": {"bias": jnp.asarray(rng.standard_normal((B, 1, T, S)), jnp.float32)},
        "bias_broadcast_rows": {
            "bias": jnp.asarray(rng.standard_normal((1, N, 1, S)), jnp.float32)
        },
        "mask": {"mask": jnp.asarray(rng.random((B, N, T, S)) < 0.7)},
        "bias_and_mask": {
            "bias": jnp.asarray(rng.standard_normal((1, N, T, S)), jnp.float32),
            "mask": jnp.asarray(rng.random((1, 1, T, S)) < 0.7),
        },
        "scale": {"scale": 0.2},
        "causal": {"is_causal": True},
        "window": {"local_window_size": (3, 1)},
        "window_int_causal": {"local_window_size": 2, "is_causal": True},
        "seq_lengths": {
            "query_seq_lengths": jnp.array([7, 11], jnp.int32),
            "key_value_seq_lengths": jnp.array([13, 4], jnp.int32),
        },
        "kv_lengths_causal": {
            "key_value_seq_lengths": jnp.array([5, 9], jnp.int32),
            "is_causal": True,
        },
    }[name]


CASES = [
    "plain",
    "bias",
    "bias_broadcast_rows",
    "mask",
    "bias_and_mask",
    "scale",
    "causal",
    "window",
    "window_int_causal",
    "seq_lengths",
    "kv_lengths_causal",
]


@pytest.mark.parametrize("case", CASES)
def test_matches_jax_nn(case):
    q, k, v = _inputs()
    kw = _case(case)
    got, res = dot_product_attention(q, k, v, return_residual=True, **kw)
    want, want_res = jax.nn.dot_product_attention(
        q, k, v, implementation="xla", return_residual=True, **kw
    )
    assert got.shape == want.shape and got.dtype == want.dtype
    assert res.shape == want_res.shape and res.dtype == want_res.dtype
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    rows = np.isfinite(np.asarray(res))  # padded query rows: -inf here, finite in jax.nn
    np.testing.assert_allclose(
        np.asarray(res)[rows], np.asarray(want_res)[rows], rtol=2e-5, atol=2e-5
    )


@pytest.mark.parametrize("case", ["bias", "causal", "seq_lengths"])
def test_gradients_match_jax_nn(case):
    q, k, v = _inputs()
    kw = _case(case)

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, **kw)))

    got = jax.grad(loss(dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(
        loss(lambda *a, **kw: jax.nn.dot_product_attention(*a, implementation="xla", **kw)),
        argnums=(0, 1, 2),
    )(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_unbatched_and_jit():
    q, k, v = (x[0] for x in _inputs())
    got = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, is_causal=True))(q, k, v)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert got.shape == (T, N, H)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_bfloat16_close_to_jax_nn():
    q, k, v = _inputs(dtype=jnp.bfloat16)
    got = dot_product_attention(q, k, v, is_causal=True)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=3e-2)


def test_implementation_names_reach_the_facade():
    q, k, v = _inputs()
    with pytest.raises(NotImplementedError, match=r"cuDNN needs an NVIDIA GPU"):
        dot_product_attention(q, k, v, implementation="cudnn")
    np.testing.assert_array_equal(
        dot_product_attention(q, k, v, implementation=("cudnn", "xla")),
        dot_product_attention(q, k, v, implementation="xla"),
    )


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"mask": jnp.ones((1, 1, T, S), jnp.int32)}, TypeError, r"mask must be a boolean array"),
        ({"bias": jnp.ones((1, 1, T, S + 1))}, ValueError, r"bias and mask must broadcast to"),
        (
            {"query_seq_lengths": jnp.ones((3,), jnp.int32)},
            ValueError,
            r"query_seq_lengths must be an integer array of shape \(2,\)",
        ),
    ],
)
def test_bad_arguments_are_named(kw, exc, match):
    q, k, v = _inputs()
    fn = dot_product_attention
    while hasattr(fn, "__wrapped__"):  # past the runtime shape checks, to the message users see
        fn = fn.__wrapped__
    with pytest.raises(exc, match=match):
        fn(q, k, v, **kw)


@pytest.mark.slow
def test_random_requests_match_jax_nn():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=25, deadline=None)
    @given(
        b=st.integers(1, 3),
        t=st.integers(1, 17),
        s=st.integers(1, 17),
        k=st.integers(1, 3),
        group=st.integers(1, 3),
        h=st.sampled_from([8, 16, 24]),
        causal=st.booleans(),
        window=st.one_of(st.none(), st.tuples(st.integers(0, 6), st.integers(0, 6))),
        use_bias=st.booleans(),
        use_mask=st.booleans(),
        use_lengths=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def check(b, t, s, k, group, h, causal, window, use_bias, use_mask, use_lengths, seed):
        rng = np.random.default_rng(seed)
        n = k * group
        q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
        kk = jnp.asarray(rng.standard_normal((b, s, k, h)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((b, s, k, h)), jnp.float32)
        kw = {"is_causal": causal, "local_window_size": window}
        if use_bias:
            kw["bias"] = jnp.asarray(rng.standard_normal((1, n, t, s)), jnp.float32)
        if use_mask:
            kw["mask"] = jnp.asarray(rng.random((b, 1, t, s)) < 0.8)
        if use_lengths:
            kw["query_seq_lengths"] = jnp.asarray(rng.integers(1, t + 1, b), jnp.int32)
            kw["key_value_seq_lengths"] = jnp.asarray(rng.integers(1, s + 1, b), jnp.int32)
        got = dot_product_attention(q, kk, v, **kw)
        want = jax.nn.dot_product_attention(q, kk, v, implementation="xla", **kw)
        # Rows that see no key: zeros here, jax.nn's average there (documented difference).
        seen = _rows_with_a_key(b, t, s, causal, window, kw)
        np.testing.assert_allclose(
            np.asarray(got)[seen], np.asarray(want)[seen], rtol=2e-5, atol=2e-5
        )

    check()


def _rows_with_a_key(b, t, s, causal, window, kw):
    """bool [B, T]: query rows that causality, window, kv lengths and mask leave a key."""
    i = np.arange(t)[:, None]
    j = np.arange(s)[None, :]
    vis = np.ones((t, s), bool)
    if causal:
        vis &= j <= i
    if window is not None:
        vis &= (j >= i - window[0]) & (j <= i + window[1])
    vis = np.broadcast_to(vis, (b, t, s))
    if "key_value_seq_lengths" in kw:
        kv = np.asarray(kw["key_value_seq_lengths"])
        vis = vis & (j[None] < kv[:, None, None])
    if "mask" in kw:  # [B, 1, T, S]
        vis = vis & np.asarray(kw["mask"])[:, 0]
    return vis.any(-1)
