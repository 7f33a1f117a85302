"""Shared inputs for the conformance tests: small pairwise-distinct shapes."""

from __future__ import annotations

import numpy as np
import pytest

# Tolerances against the float32 reference, keyed by dtype (interpreter: exact f32 dots).
TOL = {
    "float32": dict(out=2e-5, lse=2e-5, grad=5e-5),
    "float16": dict(out=4e-3, lse=2e-3, grad=2e-2),
    # bfloat16 runs in float32 in the interpreter (see _triton._interpretable): only the
    # inputs' and outputs' rounding (8 bits of mantissa) remains.
    "bfloat16": dict(out=8e-3, lse=2e-3, grad=2e-2),
}


def make_inputs(rng, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype):
    import jax.numpy as jnp

    q = rng.standard_normal((batch, q_len, heads, head_dim))
    k = rng.standard_normal((batch, kv_len, kv_heads, head_dim))
    v = rng.standard_normal((batch, kv_len, kv_heads, head_dim))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


@pytest.fixture(name="make_inputs")
def make_inputs_fixture():
    return make_inputs


@pytest.fixture(name="tol")
def tol_fixture():
    return TOL


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
