"""The `triton` flex backend runs ejk's own masks without a score_mod on the built-in kernels
(`flex._builtin`): the same values, lse and gradients as the flex kernels and the reference."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import (
    and_masks,
    causal_mask,
    create_block_mask,
    document_mask,
    flex_attention,
    or_masks,
    prefix_lm_mask,
    sliding_window_mask,
)
from ejk_attention.flex import _triton
from ejk_attention.flex._builtin import builtin_masks
from ejk_sequtils import attention_tolerance

# Not importorskip: triton must not be imported before the kernels switch its interpreter on.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

B, T, N, K, H = 2, 48, 4, 2, 16
BLOCK = 16


def _ids(t=T, padding=5):
    ids = np.repeat(np.arange(4), -(-t // 4))[:t][None].repeat(B, 0)
    ids[1] = np.sort((ids[1] + 1) % 3)
    ids[:, t - padding :] = -1  # padding rows: no key, zeros out
    return jnp.asarray(ids, jnp.int32)


def test_recognised_masks():
    ids = _ids()
    assert builtin_masks(causal_mask) == {"causal": True}
    assert builtin_masks(sliding_window_mask((7, 2))) == {"sliding_window": (7, 2)}
    combined = builtin_masks(
        and_masks(causal_mask, and_masks(document_mask(ids), sliding_window_mask(5)))
    )
    assert combined.keys() == {"causal", "segment_ids", "sliding_window"}
    assert combined["sliding_window"] == (5, 5)
    user = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    for other in (
        user,
        and_masks(causal_mask, user),
        or_masks(causal_mask, sliding_window_mask(3)),
        prefix_lm_mask(jnp.int32(4)),
        and_masks(causal_mask, causal_mask),
    ):
        assert builtin_masks(other) is None


def _inputs(dtype, t=T, s=T):
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (B, t, N, H), dtype)
    k = jax.random.normal(keys[1], (B, s, K, H), dtype)
    v = jax.random.normal(keys[2], (B, s, K, H), dtype)
    w = jax.random.normal(keys[3], (B, t, N, H), jnp.float32)
    return q, k, v, w


def _value_and_grads(impl, q, k, v, w, block_mask, **kw):
    def loss(q, k, v, block_mask):
        out, lse = flex_attention(q, k, v, block_mask=block_mask, return_lse=True,
                                  implementation=impl, **kw)  # fmt: skip
        return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(
            jnp.where(jnp.isfinite(lse), lse, 0.0)
        ), (out, lse)

    # The mask crosses jit as an argument: the window stays static, the ids traced.
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    grads, (out, lse) = grad(q, k, v, block_mask)
    return out, lse, grads


def _masks(t, s):
    self_ids = _ids(t)
    cross = (
        _ids(t),
        jnp.asarray(np.sort(np.random.default_rng(1).integers(-1, 4, (B, s)), 1), jnp.int32),
    )
    masks = {
        "causal": causal_mask,
        "window": sliding_window_mask((9, 3)),
        "causal documents window": and_masks(
            causal_mask, document_mask(self_ids), sliding_window_mask((11, 0))
        ),
        "documents [T] ids": document_mask(self_ids[0]),
        "cross documents": document_mask(cross),
    }
    if t != s:
        del masks["causal documents window"], masks["documents [T] ids"]
    return masks


@pytest.mark.parametrize(
    ("t", "s", "dtype"),
    [
        (T, T, jnp.float32),
        (40, 56, jnp.bfloat16),
        pytest.param(T, T, jnp.bfloat16, marks=pytest.mark.slow),
        pytest.param(40, 56, jnp.float32, marks=pytest.mark.slow),
    ],
)
def test_routed_calls_match_the_flex_kernels_and_the_reference(t, s, dtype, monkeypatch):
    q, k, v, w = _inputs(dtype, t, s)
    ran = []
    monkeypatch.setattr(
        _triton.TritonFlexBackend,
        "run",
        lambda *a: ran.append(1) or pytest.fail("flex kernels ran"),
    )
    tol = attention_tolerance(dtype)
    for name, mask_mod in _masks(t, s).items():
        block_mask = create_block_mask(mask_mod, B, None, t, s, block_size=BLOCK)
        got = _value_and_grads("triton", q, k, v, w, block_mask)
        want = _value_and_grads("xla", q, k, v, w, block_mask)
        for what, g, r in zip(
            ("out", "lse", "dq", "dk", "dv"),
            (got[0], got[1], *got[2]),
            (want[0], want[1], *want[2]),
            strict=True,
        ):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                       rtol=tol, atol=tol, err_msg=f"{name} {what}")  # fmt: skip
        if "documents" in name:  # padding rows: zeros, lse -inf
            assert not np.asarray(got[0][:, t - 5 :], np.float32).any()
            assert np.isneginf(np.asarray(got[1])[..., t - 5 :]).all()
    assert not ran


def test_score_mods_other_masks_and_given_configs_run_the_flex_kernels(monkeypatch):
    from ejk_kernels_gpu.flex import FlexConfig

    q, k, v, _ = _inputs(jnp.float32)
    calls = []
    real = _triton.TritonFlexBackend.run
    monkeypatch.setattr(
        _triton.TritonFlexBackend, "run", lambda self, *a: calls.append(1) or real(self, *a)
    )
    causal = create_block_mask(causal_mask, None, None, T, T, block_size=BLOCK)
    prefix = create_block_mask(prefix_lm_mask(jnp.int32(9)), None, None, T, T, block_size=BLOCK)
    flex_attention(q, k, v, lambda s, b, h, i, j: s * 0.5, causal, implementation="triton")
    flex_attention(q, k, v, block_mask=prefix, implementation="triton")
    config = FlexConfig(block_q=16, block_k=16)
    flex_attention(q, k, v, block_mask=causal, implementation="triton", config=config)
    assert len(calls) == 3
    flex_attention(q, k, v, block_mask=causal, implementation="triton")
    assert len(calls) == 3


def test_block_sizes_the_flex_kernels_refuse_still_run_built_in():
    q, k, v, _ = _inputs(jnp.float32)
    mask = create_block_mask(causal_mask, None, None, T, T, block_size=(8, 4))
    got = flex_attention(q, k, v, block_mask=mask, implementation="triton")
    want = flex_attention(q, k, v, block_mask=mask, implementation="xla")
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    own = create_block_mask(lambda b, h, i, j: i >= j, None, None, T, T, block_size=(8, 4))
    with pytest.raises(NotImplementedError, match=r"powers of two in \[16, 256\]"):
        flex_attention(q, k, v, block_mask=own, implementation="triton")
