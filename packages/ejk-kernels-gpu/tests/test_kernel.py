"""The executor wrappers: heuristic selection, explicit configs, search spaces."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import pytest

from ejk_executor import ConfigCache, ConfigSelectorChain, Executor
from ejk_kernels_gpu import (
    FlashAttentionBackward,
    FlashAttentionForward,
    FlashBackwardConfig,
    FlashConfig,
    bwd_search_space,
    fits_shared_memory,
    flash_attention,
    fwd_search_space,
)
from ejk_kernels_gpu.flash._config import _shared_bytes
from ejk_sequtils import attention_tolerance, reference_attention


def test_executor_runs_the_forward_and_backward_kernels(rng, make_inputs):
    q, k, v = make_inputs(rng, 1, 20, 24, 2, 1, 16, "float32")
    executor = Executor(ConfigSelectorChain(cache=ConfigCache()))
    cfg = FlashConfig(block_q=16, block_k=16)
    out = executor(FlashAttentionForward(), q, k, v, causal=True, cfg=cfg)
    assert bool(jnp.all(out == flash_attention(q, k, v, causal=True, config=cfg)))
    tol = attention_tolerance(q.dtype)
    np.testing.assert_allclose(out, reference_attention(q, k, v, causal=True), rtol=tol, atol=tol)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    bwd = FlashBackwardConfig(block_keys=16, block_queries=16)
    dq, dk, dv = executor(FlashAttentionBackward(), q, k, v, d_out, causal=True, cfg=bwd)
    _, vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, causal=True), q, k, v)
    tol = attention_tolerance(q.dtype, "grad")
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), vjp(d_out), strict=True):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=name)


def test_search_spaces_fit_and_hold_the_heuristic():
    from ejk_kernels_gpu import bwd_heuristic, fwd_heuristic

    for head_dim in (64, 80, 128, 256):
        fwd = fwd_search_space(head_dim)
        bwd = bwd_search_space(head_dim)
        assert fwd and bwd
        assert all(fits_shared_memory("fwd", c, head_dim) for c in fwd)
        assert all(fits_shared_memory("dkdv", c, head_dim) for c in bwd)
        assert fits_shared_memory("fwd", fwd_heuristic(head_dim), head_dim)
        assert fits_shared_memory("dq", bwd_heuristic(head_dim), head_dim)
        for side in (False, True):  # every 16-bit choice, with and without a soft cap
            for cap in (False, True):
                cfg = bwd_heuristic(head_dim, 2, side, 4, soft_cap=cap)
                assert cfg in bwd_search_space(head_dim, 2, side), (head_dim, side, cap)


def test_backward_space_offers_both_ways_of_computing_dq():
    bwd = bwd_search_space(128, 2, side_inputs=False)
    assert {c.atomic_dq for c in bwd} == {False, True}
    # The atomic build stages dS and the float32 dq tile in shared memory: it costs more.
    plain = FlashBackwardConfig(block_keys=128, block_queries=64, num_warps=8, num_stages=3)
    atomic = msgspec.structs.replace(plain, atomic_dq=True)
    assert fits_shared_memory("dkdv", atomic, 128, 2, side_inputs=True)
    assert _shared_bytes("dkdv", atomic, 128, 2, False) > _shared_bytes(
        "dkdv", plain, 128, 2, False
    )
    with pytest.raises(TypeError, match=r"FlashBackwardConfig\.atomic_dq must be a bool"):
        FlashBackwardConfig(atomic_dq="yes")
    with pytest.raises(TypeError, match=r"FlashConfig\.atomic_dq must be a bool"):
        FlashConfig(atomic_dq="yes")  # (deprecated: read only as a backward config)


def test_dq_goes_by_tma_only_for_atomic_dq_on_hopper_with_whole_tile_rows():
    from ejk_kernels_gpu.flash._constexprs import dq_by_tma

    atomic = FlashBackwardConfig(
        block_keys=128, block_queries=64, num_warps=8, num_stages=3, atomic_dq=True
    )
    assert dq_by_tma(atomic, 128, hopper=True)
    assert not dq_by_tma(atomic, 128, hopper=False)  # elsewhere: pointer atomics
    assert not dq_by_tma(atomic, 80, hopper=True)  # a 128-wide tile would reach the next head
    assert not dq_by_tma(FlashBackwardConfig(block_keys=128, block_queries=64), 128, hopper=True)


def test_no_heuristic_or_tuning_space_offers_the_racy_warp_specialised_backward():
    """The warp-specialised dk/dv kernel gave different dk/dv (sometimes NaN) between two
    runs of one call on an H100 (2026-11-24): only an explicit config may ask for it."""
    from ejk_kernels_gpu import bwd_heuristic

    for head_dim in (64, 128, 256):
        for group in (1, 4):
            cfg = bwd_heuristic(head_dim, 2, False, group)
            assert not cfg.warp_specialize, (head_dim, group)
        space = bwd_search_space(head_dim, 2, side_inputs=False)
        assert not any(c.warp_specialize for c in space), head_dim


def test_a_config_from_disk_must_be_in_the_kernels_search_space(rng, make_inputs):
    from ejk_executor import Invocation

    q, k, v = make_inputs(rng, 1, 20, 24, 2, 1, 16, "float32")
    for kernel, args, huge in (
        (FlashAttentionForward(), (q, k, v), FlashConfig(block_q=2**40, block_k=64)),
        (
            FlashAttentionBackward(),
            (q, k, v, q),
            FlashBackwardConfig(block_keys=2**40, block_queries=64),
        ),
    ):
        inv = Invocation.make(kernel, args, {"causal": True})
        for cfg in kernel.config_space(inv):
            assert kernel.cached_cfg_problem(inv, cfg) is None
        assert "not in its search space" in kernel.cached_cfg_problem(inv, huge)
