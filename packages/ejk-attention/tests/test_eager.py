"""Eager calls of the public entry points run one compiled function per signature (`_eager`).

The compiled function is traced once and reused: a spy backend counts how often the
dispatch runs (it runs only while tracing). Results equal those of the same call under
``jit``; grads, ``return_lse``, packed input and the fall-through behave as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import (
    _backends,
    _paged_backends,
    dot_product_attention,
    flash_attention,
    paged_attention,
    ragged_paged_attention,
    reference_attention,
)
from ejk_sequtils import attention_tolerance

B, T, S, N, K, H = 2, 19, 23, 6, 2, 8


def _qkv(t=T, s=S, b=B, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((b, t, N, H), (b, s, K, H), (b, s, K, H))
    return tuple(jnp.asarray(rng.standard_normal(x), jnp.float32) for x in shapes)


@pytest.fixture
def xla_runs(monkeypatch):
    """The xla backend, recording each time the dispatch reaches it (its request)."""
    runs = []

    class Counting(_backends.XlaBackend):
        def run(self, request, config, bwd_config):
            runs.append(request)
            return super().run(request, config, bwd_config)

    monkeypatch.setitem(_backends.BACKENDS, "xla", Counting())
    return runs


def _ids(seed, b, n):
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rng.integers(-1, 3, (b, n)), 1), jnp.int32)


CALLS = {
    "plain": {},
    "causal_lse": {"causal": True, "return_lse": True},
    "bias_sinks": {
        "bias": jnp.asarray(np.random.default_rng(2).standard_normal((1, N, T, S)), jnp.float32),
        "softmax_sinks": jnp.linspace(-1.0, 1.0, N),
    },
    "segments": {"segment_ids": (_ids(3, B, T), _ids(4, B, S)), "sliding_window": (4, 2)},
    "dropout_int_seed": {"dropout_rate": 0.25, "dropout_seed": 7},
}


@pytest.mark.parametrize("name", list(CALLS))
def test_a_second_eager_call_reuses_the_compiled_function(xla_runs, name):
    q, k, v = _qkv()
    kw = CALLS[name]
    first = flash_attention(q, k, v, **kw)
    assert len(xla_runs) == 1
    assert isinstance(xla_runs[0].q, jax.core.Tracer)  # it ran while tracing
    second = flash_attention(q, k, v, **kw)
    assert len(xla_runs) == 1  # no new trace: same signature
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        np.testing.assert_array_equal(a, b)
    under_jit = jax.jit(lambda q, k, v: flash_attention(q, k, v, **kw))(q, k, v)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(under_jit), strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(xla_runs) == 2  # the jit traced it again (its own cache)


def test_a_new_shape_or_option_traces_again(xla_runs):
    q, k, v = _qkv()
    flash_attention(q, k, v)
    flash_attention(*_qkv(t=T + 1))
    flash_attention(q, k, v, causal=True)
    flash_attention(q, k, v)
    assert len(xla_runs) == 3


def test_new_dropout_seeds_reuse_the_compiled_function(xla_runs):
    q, k, v = _qkv()
    outs = [flash_attention(q, k, v, dropout_rate=0.3, dropout_seed=seed) for seed in (1, 2)]
    assert len(xla_runs) == 1
    assert not np.allclose(outs[0], outs[1])
    want = reference_attention(q, k, v, dropout_rate=0.3, dropout_seed=2)
    tol = attention_tolerance(q.dtype)
    np.testing.assert_allclose(outs[1], want, rtol=tol, atol=tol)


def test_packed_input_keeps_one_cu_seqlens(xla_runs):
    """cu_seqlens_k defaults to the same array as cu_seqlens_q, and stays so when traced
    (the Pallas backend serves causal packed input only then)."""
    q, k, v = _qkv(b=1, t=16, s=16)
    cu = jnp.array([0, 5, 5, 12], jnp.int32)
    out = flash_attention(q, k, v, cu_seqlens_q=cu, causal=True)
    (request,) = xla_runs
    assert request.cu_seqlens_k is request.cu_seqlens_q
    want = reference_attention(q, k, v, cu_seqlens_q=cu, causal=True)
    tol = attention_tolerance(q.dtype)
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)


def test_grad_of_an_eager_style_call_traces_and_is_right():
    q, k, v = _qkv()
    loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v, causal=True) ** 2)
    got = jax.grad(loss(flash_attention), (0, 1, 2))(q, k, v)
    want = jax.grad(loss(reference_attention), (0, 1, 2))(q, k, v)
    tol = attention_tolerance(q.dtype, "grad")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


def test_eager_errors_name_the_argument():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="softmax_scale must be a finite number > 0"):
        flash_attention(q, k, v, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="logits_soft_cap must be a finite number > 0"):
        flash_attention(q, k, v, logits_soft_cap=0.0)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        flash_attention(*_qkv(b=1), cu_seqlens_q=jnp.array([1, 19], jnp.int32))


def test_unhashable_options_run_as_before(xla_runs):
    q, k, v = _qkv()
    want = reference_attention(q, k, v, sliding_window=(3, 3))
    tol = attention_tolerance(q.dtype)
    for _ in range(2):  # a dict is no cache key: each call runs op by op, as before
        out = flash_attention(q, k, v, sliding_window=(3, 3), config={"block_q": 16})
        np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
    assert len(xla_runs) == 2
    assert not isinstance(xla_runs[0].q, jax.core.Tracer)


def test_numpy_inputs():
    q, k, v = (np.asarray(x) for x in _qkv())
    ids = (np.zeros((B, T), np.int32), np.zeros((B, S), np.int32))
    out = flash_attention(q, k, v, causal=True, segment_ids=ids)
    want = reference_attention(q, k, v, causal=True)
    tol = attention_tolerance(q.dtype)
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)


# dot_product_attention, paged_attention and ragged_paged_attention take the same path
# (`_eager.eager_jit`): a spy backend counts how often each dispatch runs.


@pytest.fixture
def dpa_xla_runs(monkeypatch):
    """dot_product_attention's xla backend (jax.nn), recording the query it ran on."""
    from ejk_attention import _dpa

    runs = []
    original = _dpa._ROUTES["jax.nn"]

    def counting(name, query, *args):
        runs.append(query)
        return original(name, query, *args)

    monkeypatch.setitem(_dpa._ROUTES, "jax.nn", counting)
    return runs


def test_eager_dot_product_attention_is_traced_once(dpa_xla_runs, no_shape_checks):
    q, k, v = _qkv()
    first = dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    assert len(dpa_xla_runs) == 1 and isinstance(dpa_xla_runs[0], jax.core.Tracer)
    second = dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    assert len(dpa_xla_runs) == 1  # the compiled function, reused
    np.testing.assert_array_equal(first, second)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(first, want, rtol=1e-6, atol=1e-6)
    dot_product_attention(q, k, v, implementation="xla")  # another option: a new trace
    assert len(dpa_xla_runs) == 2
    dot_product_attention(np.asarray(q).tolist(), k, v, implementation="xla")  # a list: op by op
    assert len(dpa_xla_runs) == 3 and not isinstance(dpa_xla_runs[2], jax.core.Tracer)


@pytest.fixture
def paged_xla_runs(monkeypatch):
    """The paged xla backend, recording the request of each run."""
    runs = []

    class Counting(_paged_backends.PagedXlaBackend):
        def run(self, request, config, bwd_config):
            runs.append(request)
            return super().run(request, config, bwd_config)

    monkeypatch.setattr(_backends.BACKENDS["xla"], "paged", Counting())
    return runs


def _paged_inputs():
    q, k, v = _qkv(b=2, t=3, s=16)
    k_pages, v_pages = (x.reshape(8, 4, K, H) for x in (k, v))
    table = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
    return q, k_pages, v_pages, table, jnp.array([16, 9], jnp.int32)


@pytest.mark.parametrize("ragged", [False, True], ids=["paged", "ragged"])
def test_eager_paged_calls_are_traced_once(paged_xla_runs, ragged):
    q, k_pages, v_pages, table, lens = _paged_inputs()
    if ragged:
        call = lambda lens: ragged_paged_attention(
            q.reshape(6, N, H), k_pages, v_pages, table, lens, jnp.array([0, 3, 6], jnp.int32)
        )
    else:
        call = lambda lens: paged_attention(q, k_pages, v_pages, table, lens)
    first = call(lens)
    assert len(paged_xla_runs) == 1 and isinstance(paged_xla_runs[0].q, jax.core.Tracer)
    np.testing.assert_array_equal(call(lens), first)
    other = call(jnp.array([12, 16], jnp.int32))  # new values, same signature
    assert len(paged_xla_runs) == 1
    assert not np.allclose(other, first)
    # Values are still checked on every eager call, before the compiled function runs.
    with pytest.raises(ValueError, match=r"kv_lens must be in \[0, pages_per_seq"):
        call(jnp.array([16, 17], jnp.int32))
