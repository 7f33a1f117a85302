"""The ``xla`` backend (`_xla`, a custom VJP in jnp) against the definition, `reference_attention`.

The shared conformance suite runs on it (values, lse, every gradient, emptied rows,
dropout, packing, sinks, B/T/S = 0), and the query-block path that causal and window
calls take is checked with small blocks, so several blocks (and skipped keys) appear
at test sizes.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import _xla
from ejk_sequtils import attention_tolerance, reference_attention, validate_attention


def _conformance() -> type:
    """The suite of test_backends.py (tests are not a package: load it by path)."""
    path = Path(__file__).with_name("test_backends.py")
    spec = importlib.util.spec_from_file_location("_ejk_conformance_suite", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module.Conformance


class TestXla(_conformance()):
    implementation = "xla"


B, T, S, N, K, H, HV = 2, 37, 41, 6, 2, 8, 5


def _ids(rng, b, n):
    return jnp.asarray(np.sort(rng.integers(-1, 3, (b, n)), 1), jnp.int32)


def _kwargs(name: str) -> dict:
    rng = np.random.default_rng(3)
    bias = rng.standard_normal((B, 1, T, S)).astype(np.float32)
    bias[:, :, 5] = -np.inf  # an emptied row
    return {
        "causal": {"causal": True},
        "window": {"sliding_window": (6, 3)},
        "causal_window": {"causal": True, "sliding_window": (9, 4)},
        "left_only": {"sliding_window": (0, 30)},
        "causal_everything": {
            "causal": True,
            "bias": jnp.asarray(bias),
            "logits_soft_cap": 2.5,
            "softmax_sinks": jnp.asarray(rng.standard_normal((N, 2)), jnp.float32),
            "segment_ids": (_ids(rng, B, T), _ids(rng, B, S)),
            "softmax_scale": 0.3,
        },
        "window_dropout": {
            "sliding_window": (7, 2),
            "dropout_rate": 0.3,
            "dropout_seed": jnp.uint32(99),
            "bias": jnp.asarray(rng.standard_normal((1, N, T, S)), jnp.float32),
        },
    }[name]


def _inputs(b=B, t=T, s=S):
    rng = np.random.default_rng(0)
    shapes = ((b, t, N, H), (b, s, K, H), (b, s, K, HV))
    return tuple(jnp.asarray(rng.standard_normal(x), jnp.float32) for x in shapes)


def _check_against_reference(q, k, v, kw):
    """Values, lse and the gradients of q, k, v, bias, sinks through out *and* lse."""
    tol = lambda what: attention_tolerance(q.dtype, what)
    arrays = {name: kw[name] for name in ("bias", "softmax_sinks") if name in kw}
    fixed = {name: value for name, value in kw.items() if name not in arrays}
    rng = np.random.default_rng(7)
    w_out = jnp.asarray(rng.standard_normal((q.shape[0], q.shape[1], N, v.shape[-1])), jnp.float32)
    w_lse = jnp.asarray(rng.standard_normal((q.shape[0], N, q.shape[1])), jnp.float32)

    def ours(q, k, v, arrays):
        request = validate_attention(q, k, v, return_lse=True, **fixed, **arrays)
        return _xla.xla_attention(request)

    def ref(q, k, v, arrays):
        return reference_attention(q, k, v, return_lse=True, **fixed, **arrays)

    def loss(fn):
        def f(*args):
            out, lse = fn(*args)
            return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)

        return f

    # Under jit: one compile per function, not one per operation (4x faster on CPU).
    out, lse = jax.jit(ours)(q, k, v, arrays)
    want, want_lse = jax.jit(ref)(q, k, v, arrays)
    np.testing.assert_allclose(out, want, rtol=tol("out"), atol=tol("out"))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_allclose(
        np.asarray(lse)[finite], np.asarray(want_lse)[finite], rtol=tol("lse"), atol=tol("lse")
    )
    got = jax.jit(jax.grad(loss(ours), (0, 1, 2, 3)))(q, k, v, arrays)
    expected = jax.jit(jax.grad(loss(ref), (0, 1, 2, 3)))(q, k, v, arrays)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert not np.any(np.isnan(np.asarray(g)))
        np.testing.assert_allclose(g, e, rtol=tol("grad"), atol=tol("grad"))


@pytest.mark.parametrize(
    "name",
    [
        # causal_everything and window_dropout take several blocks with every other input
        # (test_blocks_cover_every_visible_key checks the blocks of each mask shape).
        *(
            pytest.param(name, marks=pytest.mark.slow)
            for name in ("causal", "window", "causal_window", "left_only")
        ),
        "causal_everything",
        "window_dropout",
    ],
)
def test_query_blocks_equal_the_definition(monkeypatch, name):
    monkeypatch.setattr(_xla, "_BLOCK_Q", 8)  # 37 rows: blocks of 8, 8, 8, 8, 5
    q, k, v = _inputs()
    kw = _kwargs(name)
    tiles = _xla._tiles(
        _xla._Options(1.0, kw.get("causal", False), kw.get("sliding_window"), None, 0.0, False),
        T,
        S,
    )
    assert len(tiles) == 5
    _check_against_reference(q, k, v, kw)


def test_packed_causal_blocks_equal_the_definition(monkeypatch):
    monkeypatch.setattr(_xla, "_BLOCK_Q", 8)
    q, k, v = _inputs(b=1, t=30, s=30)
    cu = jnp.array([0, 7, 7, 19, 26], jnp.int32)
    _check_against_reference(
        q, k, v, {"cu_seqlens_q": cu, "causal": True, "sliding_window": (5, 0)}
    )


@pytest.mark.parametrize("window", [None, (0, 0), (3, 1), (1, 7), (40, 0), (0, 40)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("q_len", "kv_len"), [(37, 41), (41, 37), (17, 3)])
def test_blocks_cover_every_visible_key(monkeypatch, window, causal, q_len, kv_len):
    """Each query's visible keys lie inside its block's key range (nothing skipped is seen)."""
    from ejk_sequtils import visibility_mask

    monkeypatch.setattr(_xla, "_BLOCK_Q", 8)
    opts = _xla._Options(1.0, causal, window, None, 0.0, False)
    visible = np.asarray(visibility_mask(q_len, kv_len, causal=causal, sliding_window=window))[0, 0]
    covered = np.zeros_like(visible)
    rows = np.zeros(q_len, int)
    for tile in _xla._tiles(opts, q_len, kv_len):
        covered[tile.q0 : tile.q1, tile.k0 : tile.k1] = True
        rows[tile.q0 : tile.q1] += 1
    assert not np.any(visible & ~covered)
    np.testing.assert_array_equal(rows, 1)  # the blocks partition the queries


def test_bfloat16_inputs_keep_their_dtype():
    q, k, v = (x.astype(jnp.bfloat16) for x in _inputs())
    request = validate_attention(q, k, v, causal=True)
    out = _xla.xla_attention(request)
    assert out.dtype == jnp.bfloat16
    grads = jax.grad(
        lambda q, k, v: jnp.sum(
            _xla.xla_attention(validate_attention(q, k, v)).astype(jnp.float32)
        ),
        (0, 1, 2),
    )(q, k, v)
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 3
    want = reference_attention(q, k, v, causal=True)
    tol = attention_tolerance(jnp.bfloat16)
    np.testing.assert_allclose(
        out.astype(jnp.float32), want.astype(jnp.float32), rtol=tol, atol=tol
    )
