"""blocksparse_attention_request: a validated request taken as it is, its refusals, causal and
window joined to the mask."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import ejk_kernels_tpu._ops as ops
from ejk_kernels_tpu import (
    CausalMask,
    MultiHeadMask,
    NumpyMask,
    blocksparse_attention,
    blocksparse_attention_request,
    unsupported_reason,
)
from ejk_sequtils import attention_tolerance, reference_attention, validate_attention

T, S, N, K, H = 128, 256, 4, 2, 64


def _qkv(head_dim_v=H, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (1, T, N, H), dtype)
    k = jax.random.normal(ks[1], (1, S, K, H), dtype)
    v = jax.random.normal(ks[2], (1, S, K, head_dim_v), dtype)
    return q, k, v


def _random_mask(seed):
    return NumpyMask(np.random.default_rng(seed).random((T, S)) < 0.6)


MASKS = {
    "none": None,
    "mask": _random_mask(0),
    "multihead": MultiHeadMask([_random_mask(0), _random_mask(1)] * 2),
    "array": jnp.asarray(MultiHeadMask([_random_mask(0), _random_mask(1)] * 2).dense()),
}


@pytest.mark.parametrize("kind", MASKS)
def test_causal_and_window_of_the_request_join_the_mask(kind):
    mask = MASKS[kind]
    q, k, v = _qkv()
    sinks = jax.random.normal(jax.random.key(5), (N, 2))
    request = validate_attention(
        q, k, v, causal=True, sliding_window=(50, 10), softmax_sinks=sinks, return_lse=True
    )
    out, lse = blocksparse_attention_request(request, mask)
    dense = None
    if mask is not None:
        dense = jnp.asarray(mask if kind == "array" else mask.dense())
        dense = dense.reshape((1,) * (4 - dense.ndim) + dense.shape)
    r_out, r_lse = reference_attention(q, k, v, **request.keyword_arguments(), mask=dense)
    tol = attention_tolerance(q.dtype, "out")
    np.testing.assert_allclose(out, r_out, atol=tol, rtol=tol)
    tol = attention_tolerance(q.dtype, "lse")
    np.testing.assert_allclose(lse, r_lse, atol=tol, rtol=tol)


def test_the_request_is_not_validated_again(monkeypatch):
    q, k, v = _qkv()
    request = validate_attention(q, k, v, causal=True)
    want = blocksparse_attention_request(request, None)

    def refuse(*args, **kwargs):
        raise AssertionError("validate_attention called again")

    monkeypatch.setattr(ops, "validate_attention", refuse)
    np.testing.assert_array_equal(blocksparse_attention_request(request, None), want)
    with pytest.raises(AssertionError, match="called again"):
        blocksparse_attention(q, k, v, CausalMask((T, S)))


def _bias_request():
    q, k, v = _qkv()
    return validate_attention(q, k, v, jnp.zeros((1, 1, T, S)))


def _packed_request():
    q, _, _ = _qkv()
    return validate_attention(q, q, q, cu_seqlens_q=jnp.asarray([0, 60, T], jnp.int32))


def _head_dim_request():
    return validate_attention(*_qkv(head_dim_v=32))


def _float64_request():
    q, k, v = (np.asarray(x, np.float64) for x in _qkv())
    return validate_attention(q, k, v)


@pytest.mark.parametrize(
    ("make_request", "reason"),
    [
        (_bias_request, "take no additive bias"),
        (_packed_request, "take no cu_seqlens (pass packed sequences as segment_ids)"),
        (_head_dim_request, "need v's head_dim 32 == q's 64"),
        (_float64_request, "take float32, bfloat16 or float16, got float64"),
    ],
)
def test_what_the_kernels_cannot_serve_is_refused_with_the_reason(make_request, reason):
    request = make_request()
    got = unsupported_reason(request)
    assert got is not None and reason in got
    with pytest.raises(NotImplementedError, match=re.escape(got)):
        blocksparse_attention_request(request, None)


def test_float16_is_refused_only_when_compiling_for_tpu():
    request = validate_attention(*_qkv(dtype=jnp.float16))
    assert unsupported_reason(request, interpret=False) == (
        "the block-sparse kernels on TPU take float32 or bfloat16, got float16"
    )
    # The interpreter takes float16.
    assert unsupported_reason(request, interpret=pltpu.InterpretParams()) is None
    assert unsupported_reason(validate_attention(*_qkv()), interpret=False) is None
