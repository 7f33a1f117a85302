"""`flash_attention(attention_mask=...)`, ejKernel's dense mask spelling: the reference's
``mask`` in values and every gradient, rows it empties give zeros, bad masks are named."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import flash_attention, reference_attention
from ejk_sequtils import attention_tolerance

B, T, S, N, K, H = 2, 11, 13, 4, 2, 8


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, H))
    q, k, v = (jnp.asarray(rng.standard_normal(x), jnp.float32) for x in shapes)
    bias = jnp.asarray(rng.standard_normal((1, N, T, S)), jnp.float32)
    mask = rng.random((B, 1, T, S)) < 0.6
    mask[0, 0, 3] = False  # an emptied row
    return q, k, v, bias, jnp.asarray(mask)


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_mask_matches_the_reference_in_values_and_gradients(implementation):
    q, k, v, bias, mask = _inputs()

    def loss(fn, q, k, v, bias, **kw):
        out = fn(q, k, v, bias, causal=True, **kw)
        return jnp.sum(out * jnp.cos(out)), out

    got_grad, got = jax.grad(
        lambda *a: loss(flash_attention, *a, attention_mask=mask, implementation=implementation),
        argnums=(0, 1, 2, 3),
        has_aux=True,
    )(q, k, v, bias)
    want_grad, want = jax.grad(
        lambda *a: loss(reference_attention, *a, mask=mask), argnums=(0, 1, 2, 3), has_aux=True
    )(q, k, v, bias)
    tol = attention_tolerance(jnp.float32)
    gtol = attention_tolerance(jnp.float32, "grad")
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert np.all(np.asarray(got)[0, 3] == 0.0)  # the emptied row
    for g, w in zip(got_grad, want_grad, strict=True):
        np.testing.assert_allclose(g, w, rtol=gtol, atol=gtol)


def test_mask_without_bias_and_under_jit():
    q, k, v, _, mask = _inputs(1)
    got = jax.jit(lambda q, k, v, m: flash_attention(q, k, v, attention_mask=m))(q, k, v, mask)
    want = reference_attention(q, k, v, mask=mask)
    tol = attention_tolerance(jnp.float32)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        (np.ones((B, N, T, S + 1), bool), ValueError, r"attention_mask must have shape"),
        (np.ones((T, S), bool), ValueError, r"attention_mask must have shape"),
        (np.ones((B, 3, T, S), bool), ValueError, r"attention_mask\.shape=\(2, 3, 11, 13\)"),
        (np.ones((B, N, T, S), np.float32), TypeError, r"attention_mask.dtype=float32"),
    ],
)
def test_bad_masks_are_named(mask, error, match):
    q, k, v, _, _ = _inputs()
    with pytest.raises(error, match=match):  # the function itself: jaxtyping would answer first
        inspect.unwrap(flash_attention)(q, k, v, attention_mask=mask)


def test_mask_with_soft_cap_is_refused_with_the_reason():
    q, k, v, _, mask = _inputs()
    with pytest.raises(NotImplementedError, match="logits_soft_cap"):
        flash_attention(q, k, v, attention_mask=mask, logits_soft_cap=5.0)
