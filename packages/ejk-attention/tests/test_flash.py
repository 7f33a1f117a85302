"""`flash_attention`: conformance with the reference, backend choice and fall-through, input errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import flash_attention, reference_attention
from ejk_kernels_gpu.build._triton import arithmetic_dtype
from ejk_sequtils import attention_tolerance

# Pairwise-distinct sizes, so a swapped axis fails loudly.
B, T, S, N, K, H = 2, 19, 23, 6, 2, 8


def _qkv(dtype=jnp.float32, t=T, s=S, b=B, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((b, t, N, H), (b, s, K, H), (b, s, K, H))
    return tuple(jnp.asarray(rng.standard_normal(x), dtype) for x in shapes)


def _seg(rng, length, batch=B):
    return jnp.asarray(np.sort(rng.integers(-1, 3, size=(batch, length)), axis=1), jnp.int32)


def _case(name):
    rng = np.random.default_rng(1)
    return {
        "plain": {},
        "causal": {"causal": True},
        "window": {"sliding_window": (4, 2)},
        "softcap_sinks": {
            "logits_soft_cap": 3.0,
            "softmax_sinks": jnp.linspace(-1.0, 1.0, N),
        },
        "bias": {"bias": jnp.asarray(rng.standard_normal((1, N, T, S)), jnp.float32)},
        "segments": {"segment_ids": (_seg(rng, T), _seg(rng, S))},
        "dropout": {"dropout_rate": 0.25, "dropout_seed": 7},
    }[name]


CASES = ["plain", "causal", "window", "softcap_sinks", "bias", "segments", "dropout"]


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_on_the_kernel(case):
    """The facade's default path on this platform (xla, the reference, on a CPU) is tested
    where it is defined; here the facade runs a kernel (triton, interpreted)."""
    q, k, v = _qkv()
    kw = _case(case)
    out, lse = flash_attention(q, k, v, return_lse=True, implementation="triton", **kw)
    want, want_lse = reference_attention(q, k, v, return_lse=True, **kw)
    assert out.shape == (B, T, N, H) and out.dtype == q.dtype
    assert lse.shape == (B, N, T) and lse.dtype == jnp.float32
    tol = attention_tolerance(q.dtype)
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("implementation", "ran"), [(None, "xla"), ("xla", "xla"), (("cudnn", "triton"), "triton")]
)
def test_implementation_picks_the_backend(monkeypatch, implementation, ran):
    from ejk_attention import _backends

    calls = []
    for name in ("xla", "triton"):
        backend = _backends.BACKENDS[name]

        class Spy(type(backend)):
            def run(self, request, config, bwd_config, _name=name):
                calls.append(_name)
                return super().run(request, config, bwd_config)

        monkeypatch.setitem(_backends.BACKENDS, name, Spy())
    q, k, v = _qkv()
    flash_attention(q, k, v, implementation=implementation)
    assert calls == [ran]


def test_under_jit_and_grad_is_deterministic():
    q, k, v = _qkv()

    @jax.jit
    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, causal=True, implementation="triton") ** 2)

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(
        lambda q, k, v: jnp.sum(reference_attention(q, k, v, causal=True) ** 2), argnums=(0, 1, 2)
    )(q, k, v)
    for g, w in zip(grads, want, strict=True):
        tol = attention_tolerance(q.dtype, "grad")
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
    again = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for g, a in zip(grads, again, strict=True):
        np.testing.assert_array_equal(g, a)


def test_packed_input_and_bf16():
    q, k, v = _qkv(jnp.bfloat16, t=12, s=12, b=1)
    cu = jnp.array([0, 5, 5, 11], jnp.int32)
    out = flash_attention(q, k, v, cu_seqlens_q=cu, causal=True, implementation="triton")
    assert out.dtype == jnp.bfloat16
    want = reference_attention(q, k, v, cu_seqlens_q=cu, causal=True)
    # (interpreted, the kernel runs bfloat16 in float32: one rounding of the output)
    tol = attention_tolerance(jnp.bfloat16, computed_in=arithmetic_dtype(jnp.bfloat16))
    np.testing.assert_allclose(
        out.astype(jnp.float32), want.astype(jnp.float32), rtol=tol, atol=tol
    )


def test_explicit_cudnn_on_cpu_says_why():
    q, k, v = _qkv()
    with pytest.raises(
        NotImplementedError, match=r"implementation='cudnn' cannot serve .*needs an NVIDIA GPU"
    ):
        flash_attention(q, k, v, implementation="cudnn")


def test_sequence_falls_through_and_reports_every_reason(monkeypatch):
    from ejk_attention import _backends

    class Refusing(_backends.TritonBackend):
        def run(self, request, config, bwd_config):
            raise NotImplementedError("no kernel for this shape")

    monkeypatch.setitem(_backends.BACKENDS, "triton", Refusing())
    q, k, v = _qkv()
    out = flash_attention(q, k, v, implementation=["triton", "cudnn", "xla"])
    tol = attention_tolerance(q.dtype)
    np.testing.assert_allclose(out, reference_attention(q, k, v), rtol=tol, atol=tol)
    with pytest.raises(
        NotImplementedError, match=r"triton: no kernel for this shape; cudnn: cuDNN needs"
    ):
        flash_attention(q, k, v, implementation=("triton", "cudnn"))


def _unchecked(fn):
    """``fn`` without the jaxtyping/beartype wrapper these tests run under (if any).

    The runtime shape checks may reject a bad call first (a TypeError); the facade's own
    message, which users without those checks see, is pinned on the unwrapped function.
    """
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _call_both(exc, match, overrides):
    q, k, v = _qkv()
    args = {"q": q, "k": k, "v": v, **overrides}
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises((exc, TypeError)):
        flash_attention(q, k, v, **args)
    with pytest.raises(exc, match=match):
        _unchecked(flash_attention)(q, k, v, **args)


_F = np.zeros((B, T, N, H), np.float32)
BAD_VALUES = [
    ({"q": _F[0]}, r"q must be rank 4 \[B, T, N, H\], got q.shape=\(19, 6, 8\)"),
    (
        {"k": jnp.zeros((B, S, 4, H)), "v": jnp.zeros((B, S, 4, H))},
        r"q heads=6 must be a multiple of k/v heads=4",
    ),
    ({"k": jnp.zeros((3, S, K, H)), "v": jnp.zeros((3, S, K, H))}, r"k must have q's batch size 2"),
    ({"k": jnp.zeros((B, S, K, 4)), "v": jnp.zeros((B, S, K, 4))}, r"k must have q's head_dim 8"),
    ({"v": jnp.zeros((B, S + 1, K, H))}, r"v must match k in \[B, S, K\]"),
    (
        {"bias": jnp.zeros((B, N, T, T))},
        r"bias must have shape \[1\|2, 1\|6, 19, 23\], got bias.shape=\(2, 6, 19, 19\)",
    ),
    ({"softmax_scale": -1.0}, r"softmax_scale must be a finite number > 0, got -1.0"),
    ({"sliding_window": (1, -2)}, r"sliding_window sizes must be >= 0, got \(1, -2\)"),
    ({"sliding_window": (1, 2, 3)}, r"sliding_window must be an int or \(left, right\)"),
    ({"logits_soft_cap": 0.0}, r"logits_soft_cap must be a finite number > 0, got 0.0"),
    (
        {"softmax_sinks": jnp.zeros((K,))},
        r"softmax_sinks must have shape \[N\]=\(6,\) or \[N, num_sinks\].*got softmax_sinks.shape=\(2,\)",
    ),
    (
        {"segment_ids": jnp.zeros((B, T), jnp.int32)},
        r"segment_ids of shape \(2, 19\) is for self attention",
    ),
    (
        {"segment_ids": (jnp.zeros((B, T), jnp.int32), jnp.zeros((B, T), jnp.int32))},
        r"segment_ids\[1\] must have shape \(2, 23\), got \(2, 19\)",
    ),
    (
        {"segment_ids": (1, 2, 3)},
        r"segment_ids must be \[B, T\] or a \(q_ids, kv_ids\) pair, got 3 items",
    ),
    ({"dropout_rate": 0.1}, r"dropout_seed is required when dropout_rate=0.1 > 0"),
    ({"dropout_rate": 1.0, "dropout_seed": 1}, r"dropout_rate must be in \[0, 1\), got 1.0"),
    (
        {"implementation": "flash"},
        r"implementation must be one of \('xla', 'triton', 'pallas', 'cudnn'\), got 'flash'",
    ),
    ({"implementation": []}, r"implementation must not be an empty sequence"),
    ({"in_specs": jax.sharding.PartitionSpec("x")}, r"in_specs/out_specs need mesh="),
]


@pytest.mark.parametrize(("overrides", "match"), BAD_VALUES, ids=lambda x: str(x)[:40])
def test_bad_values_are_named(overrides, match):
    _call_both(ValueError, match, overrides)


BAD_TYPES = [
    (
        {"q": _F.tolist()},
        r"q must be a floating jax or NumPy array, got list of shape \(2, 19, 6, 8\)$",
    ),
    ({"q": _F.astype(np.int32)}, r"q must have a floating dtype, got q.dtype=int32"),
    (
        {"k": jnp.zeros((B, S, K, H), jnp.float16)},
        r"q, k and v must share one dtype \(no promotion: cast them first\), got q.dtype=float32, k.dtype=float16",
    ),
    ({"causal": 1}, r"causal must be a bool, got 1"),
    ({"softmax_scale": "0.5"}, r"softmax_scale must be a real number, got '0.5'"),
    ({"sliding_window": 2.5}, r"sliding_window must be an int or \(left, right\), got 2.5"),
    ({"segment_ids": jnp.zeros((B, T), jnp.float32)}, r"segment_ids must have an integer dtype"),
    (
        {"dropout_rate": 0.5, "dropout_seed": jnp.float32(1)},
        r"dropout_seed must be an int, an int32/uint32 scalar array or a jax.random.key",
    ),
    ({"implementation": 3}, r"implementation must be None, a name or a sequence of names, got 3"),
]


@pytest.mark.parametrize(("overrides", "match"), BAD_TYPES, ids=lambda x: str(x)[:40])
def test_bad_types_are_named(overrides, match):
    _call_both(TypeError, match, overrides)


@pytest.mark.parametrize(
    ("cu", "match"),
    [
        (
            np.array([0, 7, 4, 12], np.int32),
            r"cu_seqlens_q must be non-decreasing, got cu_seqlens_q\[1\]=7 > cu_seqlens_q\[2\]=4",
        ),
        (np.array([1, 7, 12], np.int32), r"cu_seqlens_q must start at 0, got cu_seqlens_q\[0\]=1"),
        (np.array([0, 7, 13], np.int32), r"cu_seqlens_q ends at 13, past the 12 packed tokens"),
        (np.array([[0, 12]], np.int32), r"cu_seqlens_q must be rank 1"),
    ],
)
def test_bad_cu_seqlens_are_named(cu, match):
    q, k, v = _qkv(t=12, s=12, b=1)
    with pytest.raises(ValueError, match=match):
        _unchecked(flash_attention)(q, k, v, cu_seqlens_q=cu)


# Offsets validate_attention refuses when concrete; under jit they cannot be read.
BAD_CU = {
    "decreasing": [0, 7, 4, 12],
    "not from 0": [1, 7, 12, 12],
    "past the end": [0, 7, 12, 13],
}


@pytest.mark.parametrize("implementation", ["xla", "triton"])
@pytest.mark.parametrize("bad", sorted(BAD_CU))
def test_invalid_cu_seqlens_under_jit_give_nan_not_plausible_numbers(bad, implementation):
    """A traced cu_seqlens is not checked at trace time: invalid offsets make the output,
    the lse and the gradients NaN (valid offsets under the same jit give the reference)."""
    q, k, v = _qkv(t=12, s=12, b=1)

    @jax.jit
    def call(q, k, v, cu_q, cu_k):
        return flash_attention(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, return_lse=True,
            implementation=implementation,
        )  # fmt: skip

    good = jnp.array([0, 5, 5, 12], jnp.int32)
    out, lse = call(q, k, v, good, good)
    want = reference_attention(q, k, v, cu_seqlens_q=good, causal=True)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    assert np.isfinite(np.asarray(out)).all()
    bad_cu = jnp.array(BAD_CU[bad], jnp.int32)
    for cu_q, cu_k in ((bad_cu, good), (good, bad_cu)):
        out, lse = call(q, k, v, cu_q, cu_k)
        assert np.isnan(np.asarray(out)).all() and np.isnan(np.asarray(lse)).all()
    if implementation == "xla":
        grads = jax.grad(lambda q, k, v: jnp.sum(call(q, k, v, bad_cu, bad_cu)[0]), (0, 1, 2))(
            q, k, v
        )
        assert all(np.isnan(np.asarray(g)).all() for g in grads)


def test_packed_needs_batch_one():
    q, k, v = _qkv(t=12, s=12)
    with pytest.raises(ValueError, match=r"packed input \(cu_seqlens_q\) needs batch 1"):
        flash_attention(q, k, v, cu_seqlens_q=np.array([0, 12], np.int32))
