"""The facade reaches the kernel builds the kernel package picks for the same call.

Every launch of `ejk_kernels_gpu` (kernel, grid, compile-time arguments, warps, stages) is
recorded while ``ejk_attention.flash_attention(implementation="triton")`` and
``ejk_kernels_gpu.flash_attention`` compute the same call, forward and backward, in
Triton's interpreter; the two lists must be equal. A facade that hands the kernels
another config (for decoding: one that turns the split-KV route off) fails here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejk_attention
import ejk_kernels_gpu
from ejk_kernels_gpu.flash import _backward_launch, _forward_launch, _select
from ejk_kernels_gpu.paged import _launch as _paged_launch

_LAUNCHING = (_forward_launch, _backward_launch, _paged_launch)


@pytest.fixture(name="launches")
def launches_fixture(monkeypatch):
    """The launches of every kernel of `ejk_kernels_gpu`, in order, as comparable tuples."""
    seen = []
    launch = _forward_launch.launch

    def recording(kernel, grid, inputs, out_shapes, constexprs, **options):
        name = getattr(kernel, "__name__", None) or kernel.fn.__name__
        static = tuple(sorted((k, repr(v)) for k, v in constexprs.items()))
        shapes = tuple((x.shape, str(x.dtype)) for x in inputs if x is not None)
        seen.append((name, tuple(grid), static, shapes, tuple(sorted(options.items()))))
        return launch(kernel, grid, inputs, out_shapes, constexprs, **options)

    for module in _LAUNCHING:
        monkeypatch.setattr(module, "launch", recording)
    return seen


def _inputs(q_len, kv_len, heads=4, kv_heads=2, head_dim=16, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((1, q_len, heads, head_dim), (1, kv_len, kv_heads, head_dim))
    q, k, v = (
        jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (shapes[0], *shapes[1:] * 2)
    )
    return q, k, v


def _builds(launches, fn, q, k, v, kwargs):
    """The launches of ``fn``'s forward and of its gradient with respect to q, k and v."""
    start = len(launches)
    out = fn(q, k, v, **kwargs)
    jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, **kwargs) ** 2), argnums=(0, 1, 2))(q, k, v)
    return out, launches[start:]


@pytest.mark.parametrize("call", ["decode", "packed", "window"])
def test_facade_runs_the_kernel_packages_builds(launches, monkeypatch, call):
    monkeypatch.setattr(_select, "MIN_DECODE_KEYS", 64)  # decoding at an interpreter's size
    if call == "decode":
        q, k, v = _inputs(q_len=1, kv_len=80)
        kwargs = {}
    elif call == "packed":
        q, k, v = _inputs(q_len=37, kv_len=37)
        kwargs = {"cu_seqlens_q": jnp.asarray([0, 11, 30, 37], jnp.int32), "causal": True}
    else:
        q, k, v = _inputs(q_len=29, kv_len=29)
        kwargs = {"sliding_window": (6, 0), "causal": True}

    direct_out, direct = _builds(launches, ejk_kernels_gpu.flash_attention, q, k, v, kwargs)
    facade_kwargs = dict(kwargs, implementation="triton")
    facade_out, facade = _builds(launches, ejk_attention.flash_attention, q, k, v, facade_kwargs)

    names = [launch[0] for launch in direct]
    assert ("paged_kernel" in names) == (call == "decode"), names
    assert [launch[0] for launch in facade] == names
    assert facade == direct
    np.testing.assert_array_equal(np.asarray(facade_out), np.asarray(direct_out))
