"""Forward conformance against the float32 reference, in Triton's interpreter on CPU."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_gpu import FlashConfig, flash_attention
from ejk_sequtils import reference_attention

SMALL = FlashConfig(block_q=16, block_k=16)
B, T, S, N, K, H = 2, 33, 47, 4, 2, 40


def _ids(rng, batch, length):
    ids = np.sort(rng.integers(-1, 3, size=(batch, length)), axis=1)  # -1: padding
    return jnp.asarray(ids, jnp.int32)


def _check(close, got, want, dtype, name):
    """Shapes and dtypes first, then values (``want``: the float32 reference's)."""
    got_out, got_lse = got
    want_out, want_lse = want
    assert got_out.shape == want_out.shape and got_out.dtype == jnp.dtype(dtype), name
    assert got_lse.shape == want_lse.shape and got_lse.dtype == jnp.float32, name
    close(got_out, want_out, dtype, "out", name)
    close(got_lse, want_lse, dtype, "lse", name)


CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(sliding_window=(5, 3)),
    "causal_window": dict(causal=True, sliding_window=7),
    "soft_cap": dict(logits_soft_cap=1.5),
    "sinks": dict(softmax_sinks="sinks"),
    "bias_full": dict(bias=(B, N)),
    "bias_bcast_b": dict(bias=(1, N)),
    "bias_bcast_n": dict(bias=(B, 1)),
    "segments": dict(segment_ids="pair"),
    "dropout": dict(dropout_rate=0.3, dropout_seed=7),
    "everything": dict(
        causal=True,
        sliding_window=(9, 2),
        logits_soft_cap=3.0,
        softmax_sinks="sinks",
        bias=(1, N),
        segment_ids="pair",
        dropout_rate=0.2,
        dropout_seed=11,
        softmax_scale=0.3,
    ),
}


def _resolve(rng, kw, q_len=T, kv_len=S, batch=B, heads=N):
    kw = dict(kw)
    if kw.get("softmax_sinks") == "sinks":
        kw["softmax_sinks"] = jnp.asarray(rng.standard_normal(heads), jnp.float32)
    if "bias" in kw:
        bb, bn = kw["bias"]
        kw["bias"] = jnp.asarray(rng.standard_normal((bb, bn, q_len, kv_len)), jnp.float32)
    if kw.get("segment_ids") == "pair":
        kw["segment_ids"] = (_ids(rng, batch, q_len), _ids(rng, batch, kv_len))
    return kw


# float16 takes bfloat16's path with another element type: the slow run keeps it.
@pytest.mark.parametrize(
    "dtype", ["float32", pytest.param("float16", marks=pytest.mark.slow), "bfloat16"]
)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_reference(rng, make_inputs, close, case, dtype):
    q, k, v = make_inputs(rng, B, T, S, N, K, H, dtype)
    kw = _resolve(rng, CASES[case])
    if "bias" in kw:
        kw["bias"] = kw["bias"].astype(dtype)
    got = flash_attention(q, k, v, config=SMALL, return_lse=True, **kw)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    if "bias" in kw:
        kw["bias"] = kw["bias"].astype(jnp.float32)
    want = reference_attention(*f32, return_lse=True, **kw)
    _check(close, got, want, dtype, case)


def test_forward_matches_reference_in_float16(rng, make_inputs, close):
    """float16's representative in the default run: every feature at once (the slow run
    has float16's whole matrix)."""
    test_forward_matches_reference(rng, make_inputs, close, "everything", "float16")


def test_varlen_with_empty_sequences_and_padding(rng, make_inputs, close):
    total_q, total_k = 41, 37
    cu_q = jnp.asarray([0, 9, 9, 30, 38], jnp.int32)  # an empty sequence, 3 padding rows
    cu_k = jnp.asarray([0, 5, 12, 12, 33], jnp.int32)  # a sequence with queries but no keys
    q, k, v = make_inputs(rng, 1, total_q, total_k, 4, 1, 32, "float32")
    for kw in (dict(), dict(causal=True), dict(sliding_window=(4, 1), softmax_sinks="sinks")):
        kw = _resolve(rng, kw, total_q, total_k, 1, 4)
        got = flash_attention(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, config=SMALL, return_lse=True, **kw
        )
        want = reference_attention(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True, **kw
        )
        _check(close, got, want, "float32", str(kw.keys()))


def test_fully_masked_rows_are_zero_not_nan(rng, make_inputs):
    q, k, v = make_inputs(rng, 1, 19, 23, 2, 2, 16, "float32")
    q_ids = jnp.asarray(np.r_[-np.ones(5), np.ones(14)][None], jnp.int32)  # 5 padding rows
    kv_ids = jnp.asarray(np.r_[np.ones(10), 2 * np.ones(13)][None], jnp.int32)
    out, lse = flash_attention(q, k, v, segment_ids=(q_ids, kv_ids), config=SMALL, return_lse=True)
    assert bool(jnp.all(out[:, :5] == 0.0))
    assert bool(jnp.all(jnp.isneginf(lse[:, :, :5])))
    assert not bool(jnp.any(jnp.isnan(out)))


def test_default_config_and_determinism(rng, make_inputs):
    q, k, v = make_inputs(rng, 1, 21, 70, 2, 1, 64, "float16")
    a = flash_attention(q, k, v, causal=True)
    b = flash_attention(q, k, v, causal=True)
    assert bool(jnp.all(a == b))
    want = reference_attention(q.astype(jnp.float32), k, v, causal=True)
    assert float(jnp.max(jnp.abs(a.astype(jnp.float32) - want))) < 4e-3


def test_under_jit_with_traced_offsets_and_seed(rng, make_inputs):
    import jax

    q, k, v = make_inputs(rng, 1, 30, 30, 2, 2, 16, "float32")
    cu = jnp.asarray([0, 12, 30], jnp.int32)
    seed = jnp.asarray(9, jnp.uint32)

    @jax.jit
    def run(q, k, v, cu, seed):
        return flash_attention(
            q, k, v, cu_seqlens_q=cu, causal=True, dropout_rate=0.1, dropout_seed=seed,
            config=SMALL,
        )  # fmt: skip

    got = run(q, k, v, cu, seed)
    want = reference_attention(
        q, k, v, cu_seqlens_q=cu, causal=True, dropout_rate=0.1, dropout_seed=seed
    )
    assert float(jnp.max(jnp.abs(got - want))) < 1e-5


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(sliding_window=(1, 2, 3)), ValueError, "sliding_window"),
        (dict(sliding_window=-1), ValueError, "sliding_window"),
        (dict(dropout_rate=0.5), ValueError, "dropout_seed"),
        (dict(dropout_rate=1.0, dropout_seed=1), ValueError, "dropout_rate"),
        (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
        # Shape errors: ValueError in production, jaxtyping's TypeCheckError (a TypeError)
        # first when the tests switch runtime shape checks on; both name the argument.
        (dict(softmax_sinks=jnp.zeros(3)), (ValueError, TypeError), "softmax_sinks"),
        (dict(bias=jnp.zeros((3, 1, 5, 7))), (ValueError, TypeError), "bias"),
        (dict(cu_seqlens_k=jnp.asarray([0, 7])), ValueError, "cu_seqlens_q"),
        (dict(segment_ids=jnp.zeros((1, 5), jnp.int32)), ValueError, "self attention"),
        (dict(config=dict(block_q=16)), TypeError, "config"),
    ],
)
def test_bad_arguments_are_named(kwargs, exc, match):
    q = jnp.zeros((1, 5, 4, 8))
    k = jnp.zeros((1, 7, 2, 8))
    with pytest.raises(exc, match=match):
        flash_attention(q, k, k, **kwargs)


def test_bad_shapes_and_dtypes_are_named():
    q = jnp.zeros((1, 5, 3, 8))
    k = jnp.zeros((1, 7, 2, 8))
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        flash_attention(q, k, k)
    with pytest.raises(TypeError, match=r"q must have a floating dtype|parameter 'q'"):
        flash_attention(q.astype(jnp.int32), k, k)
    with pytest.raises(ValueError, match="batch 1"):
        flash_attention(
            jnp.zeros((2, 5, 2, 8)), jnp.zeros((2, 5, 2, 8)), jnp.zeros((2, 5, 2, 8)),
            cu_seqlens_q=jnp.asarray([0, 5]),
        )  # fmt: skip


def test_unsupported_requests_raise_not_implemented():
    q = jnp.zeros((1, 5, 2, 8))
    with pytest.raises(NotImplementedError, match="head_dim"):
        flash_attention(q, q, jnp.zeros((1, 5, 2, 16)))
    big = jnp.zeros((1, 5, 1, 320))
    with pytest.raises(NotImplementedError, match="head_dim <= 256"):
        flash_attention(big, big, big)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="block_q"):
        FlashConfig(block_q=48)
    with pytest.raises(ValueError, match="block_k"):
        FlashConfig(block_k=8)
    with pytest.raises(TypeError, match="num_warps"):
        FlashConfig(num_warps=4.0)
    with pytest.raises(ValueError, match="num_stages"):
        FlashConfig(num_stages=0)
