"""A wide sampled grid of shapes and feature combinations (slow: run with ``-m slow``; the
default run keeps `DEFAULT_CASES`)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_gpu import FlashBackwardConfig, FlashConfig, flash_attention
from ejk_sequtils import reference_attention

SHAPES = [  # (B, T, S, N, K, H)
    (1, 17, 17, 3, 1, 64),
    (2, 40, 29, 4, 4, 80),
    (1, 64, 96, 2, 2, 96),
    (2, 33, 65, 6, 2, 32),
    (1, 50, 50, 2, 1, 128),
]
FEATURES = ["causal", "window", "cap", "sinks", "bias", "segments", "dropout"]
CONFIGS = [FlashConfig(block_q=16, block_k=32), FlashConfig(block_q=32, block_k=16)]


def _cases():
    rng = np.random.default_rng(7)
    combos = [c for r in (1, 2, 3) for c in itertools.combinations(FEATURES, r)]
    picks = rng.choice(len(combos), size=24, replace=False)
    return [(SHAPES[i % len(SHAPES)], combos[j], CONFIGS[i % 2]) for i, j in enumerate(picks)]


# The default run's representative of the head dims off a power of two (80: padded to 128
# in registers) with three features, at the grid's float32 tolerances.
DEFAULT_CASES = [((2, 40, 29, 4, 4, 80), ("window", "cap", "bias"), CONFIGS[0])]


@pytest.mark.parametrize(
    ("shape", "features", "cfg"),
    [pytest.param(*c, marks=pytest.mark.slow) for c in _cases()] + DEFAULT_CASES,
)
def test_sampled_grid(rng, shape, features, cfg):
    batch, q_len, kv_len, heads, kv_heads, head_dim = shape
    q = jnp.asarray(rng.standard_normal((batch, q_len, heads, head_dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((batch, kv_len, kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((batch, kv_len, kv_heads, head_dim)), jnp.float32)
    kw: dict = {}
    bias = sinks = None
    if "causal" in features:
        kw["causal"] = True
    if "window" in features:
        kw["sliding_window"] = (int(rng.integers(0, 9)), int(rng.integers(0, 9)))
    if "cap" in features:
        kw["logits_soft_cap"] = 2.5
    if "dropout" in features:
        kw.update(dropout_rate=0.2, dropout_seed=int(rng.integers(1 << 31)))
    if "segments" in features:
        q_ids = np.sort(rng.integers(-1, 3, (batch, q_len)), axis=1)
        kv_ids = np.sort(rng.integers(-1, 3, (batch, kv_len)), axis=1)
        kw["segment_ids"] = (jnp.asarray(q_ids, jnp.int32), jnp.asarray(kv_ids, jnp.int32))
    if "bias" in features:
        bias = jnp.asarray(rng.standard_normal((1, heads, q_len, kv_len)), jnp.float32)
    if "sinks" in features:
        sinks = jnp.asarray(rng.standard_normal((heads,)), jnp.float32)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def loss(fn, q, k, v, bias, sinks, **extra):
        out = fn(q, k, v, bias, softmax_sinks=sinks, **kw, **extra)
        return jnp.sum(out * d_out), out

    grad = jax.grad(loss, argnums=(1, 2, 3), has_aux=True)
    bwd = FlashBackwardConfig.from_flash_config(cfg)  # the same tile shapes
    got, got_out = grad(flash_attention, q, k, v, bias, sinks, config=cfg, bwd_config=bwd)
    want, want_out = grad(reference_attention, q, k, v, bias, sinks)
    assert float(jnp.max(jnp.abs(got_out - want_out))) < 2e-5
    for g, w in zip(got, want, strict=True):
        assert not bool(jnp.any(jnp.isnan(g)))
        assert float(jnp.max(jnp.abs(g - w))) < 5e-5 * (float(jnp.max(jnp.abs(w))) + 1.0)
