"""A finite bias, even -FLT_MAX, is a bias: the row's softmax is taken over it; only -inf
hides a key (values, lse and gradients against the float32 reference, in the interpreter).

A row whose every visible logit carries the same huge negative bias has a uniform
softmax; its lse, ``m + log(l)`` with ``|m| >= 1e8``, rounds to ``m`` in float32, so the
backward cannot rebuild P from it and takes the row max and log row sum apart (see
`ejk_kernels_gpu.kernels.triton._common`). No RuntimeWarning may come out of the interpreter
(the suite turns warnings into errors).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_gpu import FlashBackwardConfig, FlashConfig, flash_attention
from ejk_sequtils import reference_attention

CFG = FlashConfig(block_q=16, block_k=16)
B, T, S, N, K, H = 2, 19, 23, 4, 2, 40
FLT_MAX = float(np.finfo(np.float32).max)
UNIFORM_ROWS = (0, 1, 2, 3, 4)  # every key carries the same huge bias
EMPTY_ROW = 5  # every key hidden


def _bias(rng) -> jnp.ndarray:
    """float32 ``[B, 1, T, S]``: rows 0-2 all -FLT_MAX, 3 all -1e30, 4 all -1e9, 5 all -inf,
    6 half -FLT_MAX and half ordinary, 7 one -inf key, 8 -FLT_MAX with -inf keys, 9 -FLT_MAX
    in every third key, 10 half -1e30 and half -1e9; the rest ordinary. Rows 16-18 share
    the last query block with ordinary rows 11-15."""
    bias = rng.standard_normal((B, 1, T, S)).astype(np.float32)
    bias[:, :, 0:3] = -FLT_MAX
    bias[:, :, 3] = -1e30
    bias[:, :, 4] = -1e9
    bias[:, :, 5] = -np.inf
    bias[:, :, 6, : S // 2] = -FLT_MAX
    bias[:, :, 7, 3] = -np.inf
    bias[:, :, 8] = -FLT_MAX
    bias[:, :, 8, ::4] = -np.inf
    bias[:, :, 9, ::3] = -FLT_MAX
    bias[:, :, 10, : S // 2] = -1e30
    bias[:, :, 10, S // 2 :] = -1e9
    bias[:, :, 16:, 1::2] = -1e30
    return jnp.asarray(bias)


def _sinks(rng, softmax_sinks):
    return jnp.asarray(rng.standard_normal(N), jnp.float32) if softmax_sinks else None


@pytest.mark.parametrize("softmax_sinks", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_extreme_biases_forward_matches_reference(rng, make_inputs, close, dtype, softmax_sinks):
    q, k, v = make_inputs(rng, B, T, S, N, K, H, dtype)
    bias = _bias(rng)
    kw = dict(softmax_sinks=_sinks(rng, softmax_sinks), return_lse=True)
    out, lse = flash_attention(q, k, v, bias, config=CFG, **kw)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want_out, want_lse = reference_attention(*f32, bias, **kw)
    assert out.shape == want_out.shape and out.dtype == q.dtype
    assert lse.shape == want_lse.shape and lse.dtype == jnp.float32
    close(out, want_out, dtype, "out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    close(lse, want_lse, dtype, "lse")
    if not softmax_sinks:
        # Softmax over equal logits is uniform (the mean of the values); the -inf row is zero.
        mean_v = jnp.repeat(f32[2].mean(axis=1), N // K, axis=1)  # [B, N, H]
        for row in UNIFORM_ROWS:
            close(out[:, row], mean_v, dtype, "out", f"uniform row {row}")
        assert bool(jnp.all(out[:, EMPTY_ROW] == 0.0))
        assert bool(jnp.all(lse[:, :, EMPTY_ROW] == -jnp.inf))


@pytest.mark.parametrize("atomic_dq", [False, True], ids=["dq_kernel", "atomic_dq"])
@pytest.mark.parametrize("softmax_sinks", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_extreme_biases_gradients_match_reference(
    rng, make_inputs, close, dtype, softmax_sinks, atomic_dq
):
    """dq, dk, dv, dbias (and dsinks) of a loss on the output and on the lse."""
    q, k, v = make_inputs(rng, B, T, S, N, K, H, dtype)
    bias = _bias(rng)
    sinks = _sinks(rng, softmax_sinks)
    d_out = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    d_lse = jnp.asarray(rng.standard_normal((B, N, T)), jnp.float32)
    bwd = FlashBackwardConfig(block_keys=16, block_queries=16, atomic_dq=atomic_dq)

    def loss(fn, q, k, v, bias, sinks, **kw):
        out, lse = fn(q, k, v, bias, softmax_sinks=sinks, return_lse=True, **kw)
        # The -inf row's lse has no gradient (and -inf · d_lse none to give).
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(lse * d_lse)

    argnums = (1, 2, 3, 4) + ((5,) if softmax_sinks else ())
    grad = jax.grad(loss, argnums=argnums)
    got = grad(flash_attention, q, k, v, bias, sinks, config=CFG, bwd_config=bwd)
    f32 = (x.astype(jnp.float32) for x in (q, k, v))
    want = grad(reference_attention, *f32, bias, sinks)
    names = ("dq", "dk", "dv", "dbias", "dsinks")
    for name, g, w, x in zip(names, got, want, (q, k, v, bias, sinks), strict=False):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))), name
        close(g, w, dtype, "grad", name)
    dq, dbias = got[0], got[3]
    # The -inf row sees nothing: no gradient reaches its query or its bias.
    assert bool(jnp.all(dq[:, EMPTY_ROW] == 0.0)) and bool(jnp.all(dbias[:, :, EMPTY_ROW] == 0.0))
    if not softmax_sinks:  # (a sink outweighs every -FLT_MAX key: their P is 0 then)
        # A uniform row's gradient is not a one-hot row's: every key of it gets a bias
        # gradient (P = 1/l everywhere, not the P = 1 that a rounded lse gave).
        assert bool(jnp.all(dbias[:, :, 0] != 0.0))
