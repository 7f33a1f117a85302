"""The warp-specialised forward: its code in the interpreter, its host side (which calls take
it, config fallback) and the jax-triton launch fixes.

The specialisation itself (producer and consumer warpgroups) only happens on a Hopper GPU
(see benchmarks/gpu_conformance.py); its sm_90 build is compiled ahead of time in
test_aot.py. The interpreter runs the same kernel code (TMA descriptors, the lse tile,
the causal block mask) as one program, which is what the tests below check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_gpu import FlashBackwardConfig, FlashConfig, flash_attention
from ejk_kernels_gpu.build._jax_triton_fix import redirect_scratch, threads_required
from ejk_kernels_gpu.flash import _backward_launch, _select
from ejk_kernels_gpu.flash._config import ordinary_config
from ejk_kernels_gpu.flash._select import fwd_heuristic, fwd_search_space
from ejk_sequtils import reference_attention

WS = FlashConfig(block_q=128, block_k=128, num_warps=4, num_stages=2, warp_specialize=True)


def test_warp_specialize_must_be_bool():
    with pytest.raises(TypeError, match="warp_specialize"):
        FlashConfig(warp_specialize=1)


def test_ordinary_config_keeps_tiles_and_fits():
    assert ordinary_config(WS, 128, 2, side_inputs=False) == FlashConfig(
        block_q=128, block_k=128, num_warps=8, num_stages=3
    )
    # With side-input tiles a third stage does not fit: the stage count stays.
    assert ordinary_config(WS, 128, 2, side_inputs=True).num_stages == 2
    plain = FlashConfig()
    assert ordinary_config(plain, 128) is plain


def test_the_space_offers_it_only_when_allowed():
    """(The heuristic takes the Gluon forward where this one could run: test_gluon.py.)"""
    assert WS in fwd_search_space(128, 2, False, warp_specialize=True)
    assert WS not in fwd_search_space(128, 2, False)
    assert WS not in fwd_search_space(128, 4, False, warp_specialize=True)
    assert not fwd_heuristic(128, 2, False).warp_specialize


def test_a_warp_specialised_config_runs_everywhere(rng):
    """Off Hopper (here: the interpreter) the config runs the ordinary kernel, correctly."""
    q, k, v = (jnp.asarray(rng.standard_normal((1, 40, 2, 16)), jnp.float32) for _ in range(3))
    cfg = FlashConfig(block_q=32, block_k=16, num_warps=4, num_stages=2, warp_specialize=True)
    got = flash_attention(q, k, v, config=cfg)
    np.testing.assert_allclose(got, reference_attention(q, k, v), atol=2e-5)


@pytest.fixture(name="launches")
def launches_fixture(on_hopper):
    """Pretend to be on Hopper and record each forward launch's WS and CAUSAL constexprs."""
    seen = []

    def record(name, grid, inputs, outs, consts, kwargs):
        if name == "fwd_kernel":
            seen.append((consts["WS"], consts["CAUSAL"]))

    on_hopper(record)
    return seen


def test_warp_specialised_build_computes_attention(launches, rng, edge):
    """Values and lse of the warp-specialised build (interpreted), causal included: query
    lengths off the block size (TMA zero fill and clipped stores), longer than the keys,
    grouped kv heads (descriptor strides)."""
    causal, q_len, kv_len, kv_heads, sinks = edge
    q = jnp.asarray(rng.standard_normal((2, q_len, 4, 128)), jnp.float32)
    shape = (2, kv_len, kv_heads, 128)
    k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    s = jnp.asarray(rng.standard_normal(4), jnp.float32) if sinks else None
    out, lse = flash_attention(q, k, v, causal=causal, softmax_sinks=s, config=WS, return_lse=True)
    assert launches == [(True, causal)]
    ref, ref_lse = reference_attention(q, k, v, causal=causal, softmax_sinks=s, return_lse=True)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5)


def test_other_masks_never_take_the_warp_specialised_build(launches, rng):
    """An explicit warp-specialised config falls back to the ordinary kernel (same tiles)."""
    q, k, v = (jnp.asarray(rng.standard_normal((1, 128, 1, 128)), jnp.float32) for _ in range(3))
    for kwargs in (dict(causal=True, sliding_window=(8, 0)), dict(logits_soft_cap=5.0)):
        got = flash_attention(q, k, v, config=WS, **kwargs)
        np.testing.assert_allclose(got, reference_attention(q, k, v, **kwargs), atol=2e-5)
    assert launches == [(False, True), (False, False)]
    flash_attention(q, k[:, :0], v[:, :0], config=WS)  # no key block: nothing to load
    assert launches[-1] == (False, False)


WS_BWD = FlashBackwardConfig(
    block_keys=128, block_queries=64, num_warps=4, num_stages=2, warp_specialize=True
)


def test_warp_specialised_backward_runs_no_atomic_dq():
    with pytest.raises(ValueError, match="warp_specialize and atomic_dq"):
        FlashBackwardConfig(warp_specialize=True, atomic_dq=True)


@pytest.fixture(name="bwd_launches")
def bwd_launches_fixture(monkeypatch):
    """Pretend to be on Hopper and record each backward launch's kernel and WS constexpr
    (the Gluon dk/dv and dq kernels, which the interpreter cannot run, answer zeros)."""
    seen = []
    launch = _backward_launch.launch

    def spy(kernel, grid, inputs, outs, consts, **kwargs):
        seen.append((kernel.__name__, consts.get("WS", False)))
        if kernel.__name__.startswith("gluon_"):  # not interpretable: zeros stand in
            return tuple(jnp.zeros(o.shape, o.dtype) for o in outs)
        return launch(kernel, grid, inputs, outs, consts, **kwargs)

    monkeypatch.setattr(_select, "hopper_gpu", lambda: True)
    monkeypatch.setattr(_backward_launch, "launch", spy)
    return seen


def _grads(attn, q, k, v, s, d_out, **kwargs):
    """Gradients of a loss that uses the output and the lse (so the lse cotangent too)."""

    def loss(q, k, v, s):
        out, lse = attn(q, k, v, softmax_sinks=s, return_lse=True, **kwargs)
        return jnp.sum(out * d_out) + jnp.sum(jnp.sin(lse))

    return jax.grad(loss, argnums=(0, 1, 2, 3) if s is not None else (0, 1, 2))(q, k, v, s)


def test_warp_specialised_backward_computes_gradients(bwd_launches, rng, edge):
    """dq, dk, dv (and dsinks) of the warp-specialised backward (interpreted): query lengths
    off the tiles (TMA zero fill, clipped stores, padded lse rows), grouped kv heads."""
    causal, q_len, kv_len, kv_heads, sinks = edge
    q = jnp.asarray(rng.standard_normal((2, q_len, 4, 128)), jnp.float32)
    shape = (2, kv_len, kv_heads, 128)
    k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    s = jnp.asarray(rng.standard_normal(4), jnp.float32) if sinks else None
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    got = _grads(flash_attention, q, k, v, s, d_out, causal=causal, bwd_config=WS_BWD)
    assert bwd_launches == [("dkdv_kernel", True), ("dq_kernel", True)]
    want = _grads(reference_attention, q, k, v, s, d_out, causal=causal)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=5e-5, rtol=1e-4)


def test_warp_specialised_backward_config_falls_back_where_it_cannot_run(bwd_launches, rng):
    q, k, v = (jnp.asarray(rng.standard_normal((1, 128, 2, 64)), jnp.float32) for _ in range(3))
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    kwargs = dict(causal=True, sliding_window=(16, 0))
    got = _grads(flash_attention, q, k, v, None, d_out, bwd_config=WS_BWD, **kwargs)
    want = _grads(reference_attention, q, k, v, None, d_out, **kwargs)
    assert bwd_launches == [("dkdv_kernel", False), ("dq_kernel", False)]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(causal=True, sliding_window=8)])
def test_backward_never_takes_the_warp_specialised_build_by_default(bwd_launches, rng, kwargs):
    """Its dk/dv kernel is not deterministic on an H100 (benchmarks/results/, 2026-11-24): the
    heuristic never gives a call the warp-specialised build, even where it could run
    (causal alone or with a window: the Gluon kernels)."""
    q, k, v = (jnp.asarray(rng.standard_normal((1, 128, 1, 128)), jnp.float16) for _ in range(3))
    # The forward as the Triton build (the heuristic's Gluon one cannot be interpreted).
    loss = lambda q: jnp.sum(flash_attention(q, k, v, config=WS, **kwargs).astype(jnp.float32))
    jax.grad(loss)(q)
    assert {w for _, w in bwd_launches} == {False}
    # multi-head, 16-bit: dq by the Gluon dk/dv kernel's TMA reduces; with a window (its
    # block table) the Gluon dq kernel beside it
    want = ["gluon_dkdv_kernel"]
    if "sliding_window" in kwargs:
        want.append("gluon_dq_kernel")
    assert [name for name, _ in bwd_launches] == want


def test_scratch_is_read_from_the_last_explicit_argument(scratch_ptx):
    ptx = scratch_ptx("fwd_kernel")
    fixed = redirect_scratch(ptx, "fwd_kernel")
    assert "[fwd_kernel_param_2]" not in fixed
    assert "ld.param.b64 \t%rd4, [fwd_kernel_param_1];" in fixed
    assert "[fwd_kernel_param_0]" in fixed  # other parameters untouched
    assert threads_required(ptx) == 384


def test_unexpected_ptx_fails_loudly(scratch_ptx):
    with pytest.raises(RuntimeError, match="parameter list"):
        redirect_scratch(".visible .entry fwd_kernel(\n)\n", "fwd_kernel")
    no_scratch = scratch_ptx("fwd_kernel").replace("[fwd_kernel_param_2]", "[fwd_kernel_param_0]")
    assert redirect_scratch(no_scratch, "fwd_kernel") == no_scratch
