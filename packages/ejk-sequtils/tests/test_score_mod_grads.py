"""`score_mod_capture_cotangents` against autodiff of a dense flex attention written here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_sequtils import score_mod_capture_cotangents

B, T, S, N, K, H, HV = 2, 7, 9, 4, 2, 8, 5
HIGHEST = jax.lax.Precision.HIGHEST


def _score(caps, s, b, h, q_idx, kv_idx):
    slopes, table, offset = caps
    rel = jnp.clip(kv_idx - q_idx + offset, 0, table.shape[1] - 1)
    return s - slopes[h] * jnp.abs(q_idx - kv_idx).astype(jnp.float32) + table[h, rel]


def _mask(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx + b) & (q_idx != 2)  # row 2 sees nothing


def _dense(q, k, v, caps, scale):
    """``(out, lse)`` from the definition, differentiable in every float capture."""
    k, v = (jnp.repeat(x, N // K, axis=2) for x in (k, v))
    s = jnp.einsum("btnh,bsnh->bnts", q, k, precision=HIGHEST) * scale
    grid = jnp.meshgrid(*(jnp.arange(x, dtype=jnp.int32) for x in (B, N, T, S)), indexing="ij")
    s = jnp.vectorize(lambda *xs: _score(caps, *xs))(s, *grid)
    visible = jnp.vectorize(_mask)(*grid)
    s = jnp.where(visible, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    safe = jnp.where(total > 0, total, 1.0)
    out = jnp.einsum("bnts,bsnd->btnd", e / safe, v, precision=HIGHEST)
    lse = jnp.where(total > 0, m + jnp.log(safe), -jnp.inf)[..., 0]
    return out, lse


@pytest.mark.parametrize("max_scores", [1 << 24, B * N * S * 3])  # one chunk; chunks of 3 rows
def test_matches_autodiff_of_the_definition(max_scores):
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, HV))
    )
    slopes = jnp.linspace(0.1, 0.7, N)
    table = jnp.asarray(rng.standard_normal((N, T + S)), jnp.float32)
    offset = jnp.int32(T)  # an integer capture: no cotangent
    scale = 0.3
    d_out = jnp.asarray(rng.standard_normal((B, T, N, HV)), jnp.float32)
    d_lse = jnp.asarray(rng.standard_normal((B, N, T)), jnp.float32)

    def loss(slopes, table):
        out, lse = _dense(q, k, v, (slopes, table, offset), scale)
        return jnp.sum(out * d_out) + jnp.sum(jnp.where(jnp.isinf(lse), 0.0, lse) * d_lse)

    want = jax.grad(loss, argnums=(0, 1))(slopes, table)
    out, lse = _dense(q, k, v, (slopes, table, offset), scale)
    # delta = rowsum(dO * O) - d_lse, zero on a row that sees nothing (its lse is -inf).
    delta = jnp.einsum("btnd,btnd->bnt", d_out, out) - jnp.where(jnp.isinf(lse), 0.0, d_lse)
    got = score_mod_capture_cotangents(
        _score, (slopes, table, offset), _mask, q, k, v, lse, d_out, delta,
        scale=scale, max_scores=max_scores,
    )  # fmt: skip
    assert got[2] is None
    for name, g, w in zip(("slopes", "table"), got[:2], want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)


def test_integer_captures_only_give_none():
    q = jnp.zeros((1, 2, 1, 4))
    k = v = jnp.zeros((1, 3, 1, 4))
    lse, delta = jnp.zeros((1, 1, 2)), jnp.zeros((1, 1, 2))
    got = score_mod_capture_cotangents(
        lambda caps, s, *idx: s + caps[0], [jnp.int32(1)], None, q, k, v, lse, q, delta, scale=1.0
    )
    assert got == [None]
