"""A finite bias, even -FLT_MAX, is a bias: the row's softmax is taken over it; only -inf
hides a key (values and gradients against the float32 reference, in the interpreter)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_gpu import FlashConfig, flash_attention
from ejk_sequtils import reference_attention

CFG = FlashConfig(block_q=16, block_k=16)
B, T, S, N, K, H = 2, 19, 23, 4, 2, 40
FLT_MAX = float(np.finfo(np.float32).max)


def _bias(rng) -> jnp.ndarray:
    """float32 ``[B, 1, T, S]``: rows 0-2 all -FLT_MAX, 3-4 all -1e30, 5 all -inf, 6 half
    -FLT_MAX and half ordinary, 7 one -inf key; the rest ordinary."""
    bias = rng.standard_normal((B, 1, T, S)).astype(np.float32)
    bias[:, :, 0:3] = -FLT_MAX
    bias[:, :, 3:5] = -1e30
    bias[:, :, 5] = -np.inf
    bias[:, :, 6, : S // 2] = -FLT_MAX
    bias[:, :, 7, 3] = -np.inf
    return jnp.asarray(bias)


# (logit - max)·log2(e) overflows to -inf for a -FLT_MAX logit in a row whose max is
# larger: exp2 of it is the 0 it should be. IEEE arithmetic on a GPU is silent; NumPy, under
# Triton's interpreter, warns.
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("softmax_sinks", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_extreme_biases_forward_matches_reference(rng, make_inputs, close, dtype, softmax_sinks):
    q, k, v = make_inputs(rng, B, T, S, N, K, H, dtype)
    bias = _bias(rng)
    sinks = jnp.asarray(rng.standard_normal(N), jnp.float32) if softmax_sinks else None
    kw = dict(softmax_sinks=sinks, return_lse=True)
    out, lse = flash_attention(q, k, v, bias, config=CFG, **kw)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want_out, want_lse = reference_attention(*f32, bias, **kw)
    close(out, want_out, dtype, "out")
    close(lse, want_lse, dtype, "lse")
    if not softmax_sinks:
        # -FLT_MAX rows: softmax over equal logits is uniform (the mean of the values);
        # the -inf row is zero.
        mean_v = jnp.repeat(f32[2].mean(axis=1), N // K, axis=1)  # [B, N, H]
        close(out[:, 0], mean_v, dtype, "out", "uniform row")
        assert bool(jnp.all(out[:, 5] == 0.0))


@pytest.mark.xfail(
    reason="the backward recomputes p = exp(s - lse) from the float32 lse, and next to a "
    "logit of -1e30 or -FLT_MAX the lse = m + log(l) loses log(l) (and rows mixing them with "
    "ordinary logits overflow): the backward needs the row max and sum apart (not done)"
)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", ["float32"])
def test_extreme_biases_gradients_match_reference(rng, make_inputs, close, dtype):
    q, k, v = make_inputs(rng, B, T, S, N, K, H, dtype)
    bias = _bias(rng)
    d_out = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)

    def loss(fn, q, k, v, bias, **kw):
        return jnp.sum(fn(q, k, v, bias, **kw).astype(jnp.float32) * d_out)

    grad = jax.grad(loss, argnums=(1, 2, 3, 4))
    got = grad(flash_attention, q, k, v, bias, config=CFG, bwd_config=CFG)
    want = grad(reference_attention, *(x.astype(jnp.float32) for x in (q, k, v)), bias)
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want, strict=True):
        assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))), name
        close(g, w, dtype, "grad", name)
