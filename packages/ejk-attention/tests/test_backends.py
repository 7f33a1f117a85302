"""One conformance suite for every backend available here, against the reference.

xla runs natively, triton through Triton's interpreter, pallas in Pallas' TPU
interpreter (both slow on CPU, so the default run keeps one combined case each and
the per-feature grid is marked slow). A backend that lacks a feature must refuse
it with NotImplementedError, never compute something else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import flash_attention, reference_attention

B, T, S, N, K, H = 2, 19, 23, 4, 2, 16

# Which features each backend serves; the others must raise NotImplementedError.
LACKS = {"xla": set(), "triton": set(), "pallas": {"bias"}}
# Tolerances keyed by dtype and output (the interpreters compute float32 dots exactly).
TOL = {"float32": {"out": 2e-5, "lse": 2e-5, "grad": 1e-4}}


def _inputs(t=T, s=S, b=B, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((b, t, N, H), (b, s, K, H), (b, s, K, H))
    return tuple(jnp.asarray(rng.standard_normal(x), jnp.float32) for x in shapes)


def _feature_kwargs(features, t=T, s=S, b=B):
    rng = np.random.default_rng(1)
    kw = {}
    for f in features:
        if f == "causal":
            kw["causal"] = True
        elif f == "window":
            kw["sliding_window"] = (5, 3)
        elif f == "softcap":
            kw["logits_soft_cap"] = 4.0
        elif f == "sinks":
            kw["softmax_sinks"] = jnp.linspace(-1.0, 1.0, N)
        elif f == "segments":
            ids = lambda n: jnp.asarray(np.sort(rng.integers(-1, 3, (b, n)), 1), jnp.int32)
            kw["segment_ids"] = (ids(t), ids(s))
        elif f == "bias":
            kw["bias"] = jnp.asarray(rng.standard_normal((1, N, t, s)), jnp.float32)
        elif f == "dropout":
            kw.update(dropout_rate=0.2, dropout_seed=3)
        elif f == "scale":
            kw["softmax_scale"] = 0.37
    return kw


def _check(implementation, features, packed=False, **overrides):
    if packed:
        q, k, v = _inputs(t=16, s=16, b=1)
        kw = {
            "cu_seqlens_q": jnp.array([0, 6, 6, 13], jnp.int32),
            **_feature_kwargs(features, 16, 16, 1),
        }
    else:
        q, k, v = _inputs()
        kw = _feature_kwargs(features)
    kw.update(overrides)
    if set(features) & LACKS[implementation]:
        with pytest.raises(
            NotImplementedError, match=f"implementation='{implementation}' cannot serve"
        ):
            flash_attention(q, k, v, implementation=implementation, **kw)
        return
    tol = TOL["float32"]
    out, lse = flash_attention(q, k, v, return_lse=True, implementation=implementation, **kw)
    want, want_lse = reference_attention(q, k, v, return_lse=True, **kw)
    assert out.shape == want.shape and out.dtype == want.dtype and lse.dtype == jnp.float32
    np.testing.assert_allclose(out, want, rtol=tol["out"], atol=tol["out"])
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(
        np.asarray(lse)[finite], np.asarray(want_lse)[finite], rtol=tol["lse"], atol=tol["lse"]
    )

    w = jnp.asarray(np.random.default_rng(5).standard_normal(want.shape), jnp.float32)

    def loss(fn, **extra):
        return lambda q, k, v: jnp.sum(fn(q, k, v, **kw, **extra) * w)

    got = jax.grad(loss(flash_attention, implementation=implementation), argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(loss(reference_attention), argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", got, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=tol["grad"], atol=tol["grad"], err_msg=f"d{name}")


COMBINED = ("causal", "window", "softcap", "sinks", "segments", "scale")
FEATURES = ["causal", "window", "softcap", "sinks", "segments", "bias", "dropout"]


@pytest.mark.parametrize("implementation", ["xla", "triton", "pallas"])
def test_combined_features(implementation):
    _check(implementation, COMBINED)


@pytest.mark.parametrize("implementation", ["triton", "pallas"])
def test_refusals_or_support(implementation):
    for feature in ("bias", "dropout"):
        if feature in LACKS[implementation]:
            _check(implementation, (feature,))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_packed_causal(implementation):
    # With dropout: the keep mask's rows and columns are positions in the packed layout.
    _check(implementation, ("causal", "dropout"), packed=True)


def test_pallas_dropout_is_the_reference_keep_mask():
    """The TPU kernel draws `dropout_keep_mask`'s bits (global batch, head, row, column),
    so values and gradients equal the reference's, not just in distribution."""
    features = ("dropout", "segments", "sinks")
    _check("pallas", features, dropout_rate=0.3, dropout_seed=jnp.uint32(0xDEADBEEF))


@pytest.mark.slow
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("implementation", ["triton", "pallas"])
def test_each_feature(implementation, feature):
    _check(implementation, (feature,))


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["triton"])
def test_packed_causal_triton(implementation):
    _check(implementation, ("causal", "window"), packed=True)
