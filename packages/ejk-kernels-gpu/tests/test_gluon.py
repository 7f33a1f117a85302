"""The Gluon forward's host side: config checks, which calls take it, its launch contract,
and the jax-triton hook that launches Gluon kernels.

Gluon kernels do not run in Triton's interpreter, so the kernel itself is checked on a
Hopper GPU (benchmarks/gpu_conformance.py, docs/performance.md) and built for sm_90 here
(test_aot.py: both configs, unmasked and causal, no spills). The tests below pretend to be
on Hopper and stand in for the kernel with the reference, to check everything around it.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_gpu import FlashConfig, _jax_triton_fix, flash_attention
from ejk_kernels_gpu._config import fwd_heuristic, fwd_search_space, ordinary_config
from ejk_sequtils import reference_attention

GLUON = FlashConfig(block_q=128, block_k=128, num_warps=4, num_stages=3, gluon=True)
GLUON2 = FlashConfig(block_q=128, block_k=128, num_warps=4, num_stages=2, gluon=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(gluon=1), TypeError, "gluon must be a bool"),
        (dict(gluon=True, warp_specialize=True), ValueError, "cannot be combined"),
        (dict(gluon=True, atomic_dq=True), ValueError, "cannot be combined"),
        (dict(gluon=True, block_q=64), ValueError, "128x128 tiles"),
        (dict(gluon=True, block_k=64), ValueError, "128x128 tiles"),
        (dict(gluon=True, num_warps=8), ValueError, "128x128 tiles"),
        (dict(gluon=True, num_stages=4), ValueError, "num_stages 2 or 3"),
    ],
)  # fmt: skip
def test_config_rejects_what_the_gluon_build_cannot_run(kwargs, error, match):
    base = dict(block_q=128, block_k=128, num_warps=4, num_stages=2)
    with pytest.raises(error, match=match):
        FlashConfig(**{**base, **kwargs})


def test_the_gluon_build_is_no_backward_config():
    q = jnp.zeros((1, 128, 1, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"bwd_config\.gluon"):
        flash_attention(q, q, q, bwd_config=GLUON)


def test_heuristic_and_space_offer_it_only_when_allowed():
    assert fwd_heuristic(128, 2, False, warp_specialize=True) == GLUON
    assert not fwd_heuristic(128, 2, False).gluon
    assert not fwd_heuristic(128, 4, False, warp_specialize=True).gluon  # float32
    assert not fwd_heuristic(64, 2, False, warp_specialize=True).gluon
    assert {GLUON, GLUON2} <= set(fwd_search_space(128, 2, False, warp_specialize=True))
    assert not any(c.gluon for c in fwd_search_space(128, 2, False))
    assert not any(c.gluon for c in fwd_search_space(256, 2, False, warp_specialize=True))


def test_ordinary_config_keeps_the_tiles():
    twin = FlashConfig(block_q=128, block_k=128, num_warps=8, num_stages=3)
    assert ordinary_config(GLUON, 128, 2, side_inputs=False) == twin
    assert ordinary_config(GLUON2, 128, 2, side_inputs=False) == twin


@pytest.fixture(name="gluon_launches")
def gluon_launches_fixture(on_hopper):
    """Pretend to be on Hopper; record each forward launch, and answer the Gluon kernel's
    with the reference (out, lse) it must produce and an empty scratch buffer."""
    seen = []

    def record(name, grid, inputs, outs, consts, kwargs):
        if name == "gluon_fwd_kernel":
            seen.append((name, grid, dict(consts), [(o.shape, o.dtype) for o in outs], kwargs))
            q, k, v, sinks = inputs
            f32 = [x.astype(jnp.float32) for x in (q, k, v)]
            out, lse = reference_attention(
                *f32, causal=consts["CAUSAL"], softmax_scale=consts["QK"] / math.log2(math.e),
                softmax_sinks=sinks if consts["HAS_SINKS"] else None, return_lse=True,
            )  # fmt: skip
            return out.astype(q.dtype), lse, jnp.zeros(outs[2].shape, outs[2].dtype)
        if name == "fwd_kernel":
            seen.append((name, grid, dict(consts), None, kwargs))
        return None

    on_hopper(record)
    return seen


def test_unmasked_and_causal_calls_launch_it_by_default(gluon_launches, rng, edge):
    """Its launch: grid, constexprs, outputs (lse [B, N, T]); values, lse and gradients of
    the whole call (the backward kernels, interpreted, take the lse it returns)."""
    causal, q_len, kv_len, kv_heads, sinks = edge
    heads = 4
    q = jnp.asarray(rng.standard_normal((2, q_len, heads, 128)), jnp.bfloat16)
    kv = (2, kv_len, kv_heads, 128)
    k, v = (jnp.asarray(rng.standard_normal(kv), jnp.bfloat16) for _ in range(2))
    s = jnp.asarray(rng.standard_normal(heads), jnp.float32) if sinks else None

    def loss(q, k, v):
        out, lse = flash_attention(q, k, v, causal=causal, softmax_sinks=s, return_lse=True)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(lse)

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    [(_, grid, consts, outs, kw)] = gluon_launches
    assert grid == (-(-q_len // 128), 2 * heads)
    assert {k: consts[k] for k in ("T", "S", "N", "G", "H", "CAUSAL", "HAS_SINKS")} == dict(
        T=q_len, S=kv_len, N=heads, G=heads // kv_heads, H=128, CAUSAL=causal, HAS_SINKS=sinks
    )
    assert consts["QK"] == pytest.approx(128**-0.5 * math.log2(math.e))
    assert (consts["BM"], consts["BN"], consts["STAGES"], kw["num_warps"]) == (128, 128, 3, 4)
    assert outs[:2] == [(q.shape, q.dtype), ((2, heads, q_len), jnp.float32)]
    assert outs[2][0][0] >= _jax_triton_fix.scratch_bytes(grid)  # four TMA descriptors a program

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]

    def ref_loss(q, k, v):
        out, lse = reference_attention(q, k, v, causal=causal, softmax_sinks=s, return_lse=True)
        return jnp.sum(out.astype(jnp.bfloat16).astype(jnp.float32) ** 2) + jnp.sum(lse)

    ref_grads = jax.grad(ref_loss, argnums=(0, 1, 2))(*f32)
    for got, ref in zip(grads, ref_grads, strict=True):
        err = float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
        assert err < 2e-2


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(causal=True, sliding_window=(8, 0)),  # a mask it cannot do
        dict(logits_soft_cap=5.0),
        dict(bias=True),
        dict(dtype=jnp.float32),
        dict(head_dim=64),
        dict(kv_len=200),  # key length off its 128-key tiles
    ],
)  # fmt: skip
def test_other_calls_run_the_ordinary_kernel_correctly(gluon_launches, rng, kwargs):
    """An explicit Gluon config falls back to the ordinary kernel with the same tiles."""
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", jnp.bfloat16)
    head_dim = kwargs.pop("head_dim", 128)
    kv_len = kwargs.pop("kv_len", 128)
    q = jnp.asarray(rng.standard_normal((1, 128, 1, head_dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((1, kv_len, 1, head_dim)), dtype) for _ in range(2))
    if kwargs.pop("bias", False):
        kwargs["bias"] = jnp.asarray(rng.standard_normal((1, 1, 128, kv_len)), dtype)
    got = flash_attention(q, k, v, config=GLUON, **kwargs)
    assert [(name, c["BLOCK_M"], c["BLOCK_N"]) for name, _, c, _, _ in gluon_launches] == [
        ("fwd_kernel", 128, 128)
    ]
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    if "bias" in kwargs:
        kwargs["bias"] = kwargs["bias"].astype(jnp.float32)
    ref = reference_attention(*f32, **kwargs)
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, atol=tol)


class _Fn:
    """A kernel as the hook sees it (hashable, like a JITFunction)."""

    arg_names = ("q_ptr", "o_ptr", "scratch_ptr", "T")

    def __init__(self, gluon: bool):
        self.gluon = gluon

    def is_gluon(self) -> bool:
        return self.gluon


def test_jax_triton_hook_compiles_gluon_kernels_itself(monkeypatch, scratch_ptx):
    """Triton kernels keep jax-triton's path; a Gluon kernel is compiled by `compile_gluon`
    once per signature and handed to jaxlib with its scratch redirected (the thread count
    follows from `_KernelLib`, which `install` puts in front of jaxlib)."""
    made, compiled = [], []

    def original(*args, **kw):
        return "triton path"

    def fake_compile(fn, signature, constexprs, num_warps, capability):
        compiled.append((signature, constexprs, num_warps, capability))
        meta = SimpleNamespace(name="gluon_fwd_kernel", shared=4096)
        return SimpleNamespace(metadata=meta, asm={"ptx": scratch_ptx("gluon_fwd_kernel")})

    lib = SimpleNamespace(
        TritonKernel=lambda *args: made.append(args) or "kernel",
        get_compute_capability=lambda device: 90,
    )
    triton_lib = SimpleNamespace(get_or_create_triton_kernel=original, triton_kernel_call_lib=lib)
    monkeypatch.setattr(_jax_triton_fix, "compile_gluon", fake_compile)
    _jax_triton_fix._install_gluon(triton_lib)
    get = triton_lib.get_or_create_triton_kernel
    kw = dict(num_warps=4, num_stages=3, num_ctas=1, compute_capability=None,
              enable_fp_fusion=True, metaparams=dict(T=128), dump=False)  # fmt: skip
    assert get(None, "cuda", _Fn(False), ["*bf16"], [], **kw) == "triton path"
    gluon = _Fn(True)
    dtypes = ["*bf16", "*bf16", "*u8"]
    first = get(None, "cuda", gluon, dtypes, [], **kw)
    assert get(None, "cuda", gluon, dtypes, [], **kw) is first  # cached
    assert compiled == [(dict(q_ptr="*bf16", o_ptr="*bf16", scratch_ptr="*u8"), dict(T=128), 4, 90)]
    kernel, attrs = first
    assert kernel == "kernel" and set(attrs) == {(0,), (1,), (2,)}
    [(name, warps, _, shared, ptx, *_)] = made
    assert (name, warps, shared) == ("gluon_fwd_kernel", 4, 4096)
    assert "[gluon_fwd_kernel_param_1]" in ptx and "[gluon_fwd_kernel_param_2]" not in ptx
