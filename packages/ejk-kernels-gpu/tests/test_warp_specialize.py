"""The warp-specialised forward's host side: config fallback and the jax-triton launch fixes.

The kernel itself only runs on a Hopper GPU (see benchmarks/gpu_conformance.py); its
sm_90 build is compiled ahead of time in test_aot.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import reference_attention
from ejk_kernels_gpu import FlashConfig, flash_attention
from ejk_kernels_gpu._config import fwd_heuristic, fwd_search_space, ordinary_config
from ejk_kernels_gpu._launch_fix import redirect_scratch, threads_required

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


def test_heuristic_and_space_offer_it_only_when_allowed():
    assert fwd_heuristic(128, 2, False, warp_specialize=True) == WS
    assert not fwd_heuristic(128, 2, False).warp_specialize
    assert not fwd_heuristic(128, 4, False, warp_specialize=True).warp_specialize
    assert WS in fwd_search_space(128, 2, False, warp_specialize=True)
    assert WS not in fwd_search_space(128, 2, False)


def test_a_warp_specialised_config_runs_everywhere(rng):
    """Off Hopper (here: the interpreter) the config runs the ordinary kernel, correctly."""
    q, k, v = (jnp.asarray(rng.standard_normal((1, 40, 2, 16)), jnp.float32) for _ in range(3))
    cfg = FlashConfig(block_q=32, block_k=16, num_warps=4, num_stages=2, warp_specialize=True)
    got = flash_attention(q, k, v, config=cfg)
    np.testing.assert_allclose(got, reference_attention(q, k, v), atol=2e-5)


_PTX = """.visible .entry fwd_kernel(
\t.param .u64 .ptr .global .align 1 fwd_kernel_param_0,
\t.param .u64 .ptr .global .align 1 fwd_kernel_param_1,
\t.param .u64 .ptr .global .align 1 fwd_kernel_param_2,
\t.param .u64 .ptr .global .align 1 fwd_kernel_param_3
)
.reqntid 384
{
\tld.param.b64 \t%rd4, [fwd_kernel_param_2];
\tld.param.b64 \t%rd5, [fwd_kernel_param_0];
}
"""


def test_scratch_is_read_from_the_last_explicit_argument():
    fixed = redirect_scratch(_PTX, "fwd_kernel")
    assert "[fwd_kernel_param_2]" not in fixed
    assert "ld.param.b64 \t%rd4, [fwd_kernel_param_1];" in fixed
    assert "[fwd_kernel_param_0]" in fixed  # other parameters untouched
    assert threads_required(_PTX) == 384


def test_unexpected_ptx_fails_loudly():
    with pytest.raises(RuntimeError, match="parameter list"):
        redirect_scratch(".visible .entry fwd_kernel(\n)\n", "fwd_kernel")
    no_scratch = _PTX.replace("[fwd_kernel_param_2]", "[fwd_kernel_param_1]")
    assert redirect_scratch(no_scratch, "fwd_kernel") == no_scratch
