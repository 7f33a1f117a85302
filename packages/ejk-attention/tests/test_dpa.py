"""`dot_product_attention` equals ``jax.nn.dot_product_attention`` (its xla path) in values,
residual and gradients on every ejk backend, emptied rows included.

``"xla"`` *is* jax.nn, so the comparisons run the kernels: triton (Triton's interpreter)
and pallas (Pallas' TPU interpreter, which has no bias and so refuses masks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import dot_product_attention
from ejk_sequtils import attention_tolerance

B, T, S, N, K, H = 2, 11, 13, 6, 3, 8


def _inputs(t=T, s=S, b=B, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, t, N, H)), dtype)
    k = jnp.asarray(rng.standard_normal((b, s, K, H)), dtype)
    v = jnp.asarray(rng.standard_normal((b, s, K, H)), dtype)
    return q, k, v


def _emptying_mask():
    """A [B, N, T, S] mask with some rows all False (jax.nn averages every value there)."""
    mask = np.random.default_rng(2).random((B, N, T, S)) < 0.7
    mask[0, :, 3] = False
    mask[1, 2, 7:] = False
    return jnp.asarray(mask)


def _case(name):
    rng = np.random.default_rng(1)
    return {
        "plain": {},
        "bias": {"bias": jnp.asarray(rng.standard_normal((B, 1, T, S)), jnp.float32)},
        "bias_broadcast_rows": {
            "bias": jnp.asarray(rng.standard_normal((1, N, 1, S)), jnp.float32)
        },
        "mask_empties_rows": {"mask": _emptying_mask()},
        "bias_and_mask": {
            "bias": jnp.asarray(rng.standard_normal((1, N, T, S)), jnp.float32),
            "mask": jnp.asarray(rng.random((1, 1, T, S)) < 0.7),
        },
        "scale": {"scale": 0.2},
        "causal": {"is_causal": True},
        # T = 11 queries, S = 13 keys: rows past the window's reach see no key.
        "window_empties_rows": {"local_window_size": (0, 0), "is_causal": True},
        "window_int_causal": {"local_window_size": 2, "is_causal": True},
        "seq_lengths": {
            "query_seq_lengths": jnp.array([7, 11], jnp.int32),
            "key_value_seq_lengths": jnp.array([13, 4], jnp.int32),
        },
        "kv_length_zero": {
            "key_value_seq_lengths": jnp.array([0, 9], jnp.int32),
            "is_causal": True,
        },
    }[name]


CASES = [
    "plain",
    "bias",
    "bias_broadcast_rows",
    "mask_empties_rows",
    "bias_and_mask",
    "scale",
    "causal",
    "window_empties_rows",
    "window_int_causal",
    "seq_lengths",
    "kv_length_zero",
]
PALLAS_REFUSES = {"bias", "bias_broadcast_rows", "mask_empties_rows", "bias_and_mask"}


def _jax_nn(q, k, v, **kw):
    return jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)


def _compare(implementation, q, k, v, kw):
    tol = lambda what: attention_tolerance(q.dtype, what)
    got, res = dot_product_attention(
        q, k, v, return_residual=True, implementation=implementation, **kw
    )
    want, want_res = _jax_nn(q, k, v, return_residual=True, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert res.shape == want_res.shape and res.dtype == want_res.dtype
    np.testing.assert_allclose(got, want, rtol=tol("out"), atol=tol("out"))
    np.testing.assert_allclose(res, want_res, rtol=tol("lse"), atol=tol("lse"))

    w = jnp.asarray(np.random.default_rng(5).standard_normal(want.shape), jnp.float32)

    def loss(fn, **extra):
        return lambda q, k, v: jnp.sum(fn(q, k, v, **kw, **extra) * w)

    got_g = jax.grad(loss(dot_product_attention, implementation=implementation), argnums=(0, 1, 2))(
        q, k, v
    )
    want_g = jax.grad(loss(_jax_nn), argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", got_g, want_g, strict=True):
        np.testing.assert_allclose(g, r, rtol=tol("grad"), atol=tol("grad"), err_msg=f"d{name}")


@pytest.mark.parametrize("case", CASES)
def test_triton_matches_jax_nn(case):
    _compare("triton", *_inputs(), _case(case))


@pytest.mark.parametrize("case", ["causal", "window_empties_rows", "kv_length_zero"])
def test_pallas_matches_jax_nn(case):
    _compare("pallas", *_inputs(), _case(case))


def test_pallas_refuses_a_mask_with_the_reason():
    with pytest.raises(NotImplementedError, match=r"pallas: .*no additive bias"):
        dot_product_attention(*_inputs(), mask=_emptying_mask(), implementation="pallas")


@pytest.mark.parametrize("implementation", ["triton", "pallas"])
@pytest.mark.parametrize("empty", ["B", "T", "S"])
def test_empty_axes_match_jax_nn(implementation, empty):
    sizes = {"b": 2, "t": 5, "s": 7, empty.lower(): 0}
    _compare(implementation, *_inputs(**sizes), {"is_causal": True})


def test_xla_is_jax_nn_and_the_default_on_cpu(monkeypatch):
    calls = []
    real = jax.nn.dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs["implementation"])
        return real(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    q, k, v = _inputs()
    dot_product_attention(q, k, v)
    dot_product_attention(q, k, v, implementation=("cudnn", "xla"))
    assert calls == ["xla", "cudnn", "xla"]  # cuDNN refused on the CPU, then xla


def test_unbatched_and_jit():
    q, k, v = (x[0] for x in _inputs())
    fn = lambda q, k, v: dot_product_attention(q, k, v, is_causal=True, implementation="triton")
    got = jax.jit(fn)(q, k, v)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert got.shape == (T, N, H)
    tol = attention_tolerance(jnp.float32)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_bfloat16_matches_jax_nn():
    q, k, v = _inputs(dtype=jnp.bfloat16)
    got = dot_product_attention(q, k, v, is_causal=True, implementation="triton")
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert got.dtype == jnp.bfloat16
    tol = attention_tolerance(jnp.bfloat16)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=tol, rtol=tol)


def test_no_backend_serves_gives_every_reason():
    with pytest.raises(NotImplementedError, match=r"cudnn: .*; pallas: .*no additive bias"):
        dot_product_attention(*_inputs(), mask=_emptying_mask(), implementation=("cudnn", "pallas"))


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
        ({"local_window_size": (1, 2, 3)}, ValueError, r"local_window_size must be an int or"),
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
            kw["query_seq_lengths"] = jnp.asarray(rng.integers(0, t + 1, b), jnp.int32)
            kw["key_value_seq_lengths"] = jnp.asarray(rng.integers(0, s + 1, b), jnp.int32)
        got, res = dot_product_attention(
            q, kk, v, implementation="triton", return_residual=True, **kw
        )
        want, want_res = _jax_nn(q, kk, v, return_residual=True, **kw)
        tol = attention_tolerance(jnp.float32)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
        np.testing.assert_allclose(res, want_res, rtol=tol, atol=tol)

    check()
