"""The reference against a float64 NumPy loop written from the definition, and its gradients."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_sequtils import (
    dropout_keep_mask,
    dropout_key,
    fold_sinks,
    reference_attention,
    visibility_mask,
)

B, T, S, N, K, H = 2, 7, 9, 6, 2, 5


def _u32_mix(h: int, x: int) -> int:
    m = 0xFFFFFFFF
    h = (h ^ ((x * 0x9E3779B1) & m)) & m
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & m
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def _keep(seed: int, b: int, n: int, i: int, j: int, rate: float) -> bool:
    h = seed & 0xFFFFFFFF
    for x in (b, n, i, j):
        h = _u32_mix(h, x)
    return (h >> 8) >= round(rate * (1 << 24))


def _seq_of(cu, idx):
    """(sequence, local position) of token idx, or (None, None) for padding."""
    for s in range(len(cu) - 1):
        if cu[s] <= idx < cu[s + 1]:
            return s, idx - cu[s]
    return None, None


def loop_attention(
    q,
    k,
    v,
    bias=None,
    *,
    scale=None,
    causal=False,
    window=None,
    cap=None,
    sinks=None,
    seg=None,
    cu_q=None,
    cu_k=None,
    rate=0.0,
    seed=0,
):
    """Attention one row at a time in float64, straight from the definition."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b_, t_, n_, h_ = q.shape
    s_, k_ = k.shape[1], k.shape[2]
    scale = h_**-0.5 if scale is None else scale
    out = np.zeros((b_, t_, n_, v.shape[-1]))
    lse = np.full((b_, n_, t_), -np.inf)
    if seg is not None and not isinstance(seg, tuple):
        seg = (seg, seg)
    if cu_q is not None and cu_k is None:
        cu_k = cu_q
    for b, n, i in itertools.product(range(b_), range(n_), range(t_)):
        kvh = n // (n_ // k_)
        logits, vals, cols = [], [], []
        for j in range(s_):
            li, lj = i, j
            if cu_q is not None:
                si, li = _seq_of(cu_q, i)
                sj, lj = _seq_of(cu_k, j)
                if si is None or si != sj:
                    continue
            if causal and lj > li:
                continue
            if window is not None and not (li - window[0] <= lj <= li + window[1]):
                continue
            if seg is not None and not (seg[0][b, i] >= 0 and seg[0][b, i] == seg[1][b, j]):
                continue
            x = scale * q[b, i, n] @ k[b, j, kvh]
            if bias is not None:
                x += bias[b % bias.shape[0], n % bias.shape[1], i, j]
            if cap is not None:
                x = cap * np.tanh(x / cap)
            logits.append(x)
            vals.append(v[b, j, kvh])
            cols.append(j)
        terms = list(logits) + ([sinks[n]] if sinks is not None else [])
        if not terms:
            continue
        m = max(terms)
        denom = sum(np.exp(t - m) for t in terms)
        lse[b, n, i] = m + np.log(denom)
        for x, val, j in zip(logits, vals, cols, strict=True):
            p = np.exp(x - m) / denom
            if rate > 0:
                p = p / (1 - rate) if _keep(seed, b, n, i, j, rate) else 0.0
            out[b, i, n] += p * val
    return out, lse


@pytest.fixture
def qkv():
    rng = np.random.default_rng(0)
    return tuple(
        rng.standard_normal(s).astype(np.float32)
        for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H))
    )


def _seg(rng, length, batch=B):
    return np.sort(rng.integers(-1, 3, size=(batch, length)), axis=1).astype(np.int32)


CASES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"sliding_window": (2, 1)},
    "window_int_causal": {"sliding_window": 3, "causal": True},
    "softcap": {"logits_soft_cap": 2.0},
    "sinks": {"softmax_sinks": np.linspace(-1, 1, N).astype(np.float32)},
    "bias": {"bias": "bias"},
    "scale": {"softmax_scale": 0.3},
    "dropout": {"dropout_rate": 0.3, "dropout_seed": 1234},
    "segments_cross": {"segment_ids": "cross"},
}


def _loop_kwargs(kw):
    window = kw.get("sliding_window")
    if isinstance(window, int):
        window = (window, window)
    return dict(
        scale=kw.get("softmax_scale"),
        causal=kw.get("causal", False),
        window=window,
        cap=kw.get("logits_soft_cap"),
        sinks=kw.get("softmax_sinks"),
        seg=kw.get("segment_ids"),
        cu_q=kw.get("cu_seqlens_q"),
        cu_k=kw.get("cu_seqlens_k"),
        rate=kw.get("dropout_rate", 0.0),
        seed=kw.get("dropout_seed", 0),
    )


@pytest.mark.parametrize("case", CASES)
def test_matches_float64_loop(case, qkv):
    rng = np.random.default_rng(1)
    kw = dict(CASES[case])
    bias = None
    if kw.pop("bias", None):
        bias = rng.standard_normal((B, 1, T, S)).astype(np.float32)
    if kw.get("segment_ids") == "cross":
        kw["segment_ids"] = (_seg(rng, T), _seg(rng, S))
    out, lse = reference_attention(*map(jnp.asarray, qkv), bias, return_lse=True, **kw)
    want_out, want_lse = loop_attention(*qkv, bias, **_loop_kwargs(kw))
    assert out.shape == (B, T, N, H) and out.dtype == jnp.float32
    assert lse.shape == (B, N, T) and lse.dtype == jnp.float32
    np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=2e-5, atol=2e-5)


def test_packed_with_empty_sequences_and_padding():
    rng = np.random.default_rng(2)
    total = 12
    q = rng.standard_normal((1, total, N, H)).astype(np.float32)
    k = rng.standard_normal((1, total + 2, K, H)).astype(np.float32)
    v = rng.standard_normal((1, total + 2, K, H)).astype(np.float32)
    cu_q = np.array([0, 3, 3, 8, 10], np.int32)  # an empty sequence, two padding rows
    cu_k = np.array([0, 4, 5, 9, 13], np.int32)  # seq 1 has a key but no query
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    out, lse = reference_attention(q, k, v, return_lse=True, **kw)
    want_out, want_lse = loop_attention(q, k, v, **_loop_kwargs(kw))
    np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(out)[0, 10:] == 0) and np.all(np.isneginf(np.asarray(lse)[0, :, 10:]))


def test_fully_masked_rows_are_zero_with_zero_finite_gradients(qkv):
    q, k, v = map(jnp.asarray, qkv)
    seg_q = jnp.array([[1, 1, -2, -1, 2, 2, 5]] * B, jnp.int32)  # -2, -1 padding; 5 sees no key
    seg_k = jnp.array([[1, 1, 1, 2, 2, -1, -1, 3, 3]] * B, jnp.int32)
    sinks = jnp.linspace(-1.0, 1.0, N)

    def loss(q, k, v, sinks):
        out = reference_attention(q, k, v, segment_ids=(seg_q, seg_k), softmax_sinks=sinks)
        return jnp.sum(out * jnp.arange(out.size, dtype=out.dtype).reshape(out.shape))

    out = reference_attention(q, k, v, segment_ids=(seg_q, seg_k))
    assert np.all(np.asarray(out)[:, [2, 3, 6]] == 0)
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(grads[0])[:, [2, 3, 6]] == 0)
    assert np.all(np.asarray(grads[1])[:, [5, 6, 7, 8]] == 0)  # keys nobody sees


@pytest.mark.parametrize("case", ["plain", "causal", "softcap", "sinks", "bias", "window"])
def test_gradients_match_finite_differences(case):
    from jax.test_util import check_grads

    rng = np.random.default_rng(3)
    shapes = ((1, 4, 4, 3), (1, 5, 2, 3), (1, 5, 2, 3))
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)
    kw = dict(CASES[case])
    args = [q, k, v]
    if kw.pop("bias", None):
        args.append(jnp.asarray(rng.standard_normal((1, 4, 4, 5)), jnp.float32))
    if "softmax_sinks" in kw:
        sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
        kw.pop("softmax_sinks")

        def f(q, k, v, sinks):
            return reference_attention(q, k, v, softmax_sinks=sinks, **kw)

        args.append(sinks)
    else:

        def f(*a):
            return reference_attention(*a, **kw)

    with jax.default_matmul_precision("highest"):
        check_grads(f, tuple(args), order=1, modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-2)


def test_gqa_gradient_sums_over_group(qkv):
    q, k, v = map(jnp.asarray, qkv)
    full_k = jnp.repeat(k, N // K, axis=2)
    full_v = jnp.repeat(v, N // K, axis=2)
    dk = jax.grad(lambda k: reference_attention(q, k, v, causal=True).sum())(k)
    dk_full = jax.grad(lambda k: reference_attention(q, k, full_v, causal=True).sum())(full_k)
    np.testing.assert_allclose(dk, dk_full.reshape(B, S, K, N // K, H).sum(3), rtol=1e-5, atol=1e-5)


def test_matches_jax_dot_product_attention(qkv):
    q, k, v = map(jnp.asarray, qkv)
    bias = jnp.asarray(np.random.default_rng(4).standard_normal((1, N, T, S)), jnp.float32)
    for causal in (False, True):
        want = jax.nn.dot_product_attention(q, k, v, bias, is_causal=causal, implementation="xla")
        got = reference_attention(q, k, v, bias, causal=causal)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_dropout_mask_is_the_documented_hash_and_keeps_the_rate():
    mask = np.asarray(dropout_keep_mask(77, 2, 3, 5, 4, 0.25))
    want = np.array(
        [
            [[[_keep(77, b, n, i, j, 0.25) for j in range(4)] for i in range(5)] for n in range(3)]
            for b in range(2)
        ]
    )
    np.testing.assert_array_equal(mask, want)
    big = np.asarray(dropout_keep_mask(jnp.uint32(5), 2, 4, 64, 64, 0.25))
    assert abs(big.mean() - 0.75) < 0.02
    # a traced int32 seed gives the same mask as the Python int
    jitted = jax.jit(lambda s: dropout_keep_mask(s, 2, 3, 5, 4, 0.25))(jnp.int32(77))
    np.testing.assert_array_equal(jitted, mask)


def test_dropout_offsets_draw_the_slice_of_the_whole_mask():
    """A shard that passes its origin (b0, n0, i0, j0), traced or not, draws exactly its
    slice of the whole call's mask; `dropout_key` carries the same numbers to kernels."""
    whole = np.asarray(dropout_keep_mask(9, 4, 6, 20, 24, 0.4))
    part = jax.jit(
        lambda b0, n0, i0, j0: dropout_keep_mask(9, 2, 3, 7, 5, 0.4, offsets=(b0, n0, i0, j0))
    )(2, 3, 11, 17)
    np.testing.assert_array_equal(part, whole[2:4, 3:6, 11:18, 17:22])
    np.testing.assert_array_equal(dropout_keep_mask(9, 4, 6, 20, 24, 0.4, offsets=None), whole)
    key = dropout_key(jnp.int32(-1), (1, 2, 3, jnp.int32(4)))
    assert key.dtype == jnp.uint32
    np.testing.assert_array_equal(key, [2**32 - 1, 1, 2, 3, 4])
    np.testing.assert_array_equal(dropout_key(5), [5, 0, 0, 0, 0])
    with pytest.raises(ValueError, match=r"four indices \(batch, head, row, column\)"):
        dropout_keep_mask(9, 1, 1, 2, 2, 0.4, offsets=(1, 2))
    with pytest.raises(TypeError, match="the row offset of dropout must be an integer scalar"):
        dropout_key(9, (0, 0, 1.5, 0))


def test_low_precision_inputs_keep_their_dtype(qkv):
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in qkv)
    out, lse = reference_attention(q, k, v, return_lse=True)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sliding_window": (1, -2)}, r"sliding_window sizes must be >= 0"),
        ({"sliding_window": (1, 2, 3)}, r"sliding_window must be an int or \(left, right\)"),
        ({"dropout_rate": 0.1}, r"dropout_seed is required"),
        ({"dropout_rate": 1.0, "dropout_seed": 1}, r"dropout_rate must be in \[0, 1\)"),
        (
            {"cu_seqlens_q": np.array([0, 3, 7], np.int32)},
            r"packed input \(cu_seqlens\) needs batch 1",
        ),
    ],
)
def test_bad_arguments_are_named(kwargs, match, qkv):
    with pytest.raises(ValueError, match=match):
        reference_attention(*map(jnp.asarray, qkv), **kwargs)


def test_head_count_mismatch_is_named():
    q = jnp.zeros((1, 3, 5, 4))
    k = jnp.zeros((1, 3, 2, 4))
    with pytest.raises(ValueError, match=r"heads=5 of q must be a multiple of kv_heads=2"):
        reference_attention(q, k, k)


def test_segment_id_zero_is_an_ordinary_segment():
    """ejKernel's and splash's convention: ids from 0, -1 for padding; no document is lost."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((1, 4, 2, 8)), jnp.float32)
    ids = jnp.asarray([[0, 0, 1, -1]], jnp.int32)
    out = reference_attention(q, q, q, segment_ids=ids)
    first_doc = reference_attention(q[:, :2], q[:, :2], q[:, :2])
    np.testing.assert_allclose(out[:, :2], first_doc, rtol=1e-6, atol=1e-6)
    assert np.any(np.asarray(out[:, :2]) != 0)
    assert np.all(np.asarray(out[:, 3]) == 0)  # padding


def test_padding_with_zero_keeps_real_tokens_exact():
    """A model that pads with 0 (and numbers documents from 1) gets exact outputs on its
    real tokens: padding is then a segment of its own, which no real token sees."""
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((1, 6, 2, 8)), jnp.float32)
    zero_pad = reference_attention(q, q, q, segment_ids=jnp.asarray([[1, 1, 2, 2, 0, 0]]))
    neg_pad = reference_attention(q, q, q, segment_ids=jnp.asarray([[1, 1, 2, 2, -1, -1]]))
    np.testing.assert_array_equal(zero_pad[:, :4], neg_pad[:, :4])


def test_several_sinks_per_head_fold_by_logsumexp():
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 5, 4, 8)), jnp.float32) for _ in range(3))
    sinks = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    got = reference_attention(q, k, v, softmax_sinks=sinks, return_lse=True)
    want = reference_attention(q, k, v, softmax_sinks=fold_sinks(sinks), return_lse=True)
    np.testing.assert_array_equal(got[0], want[0])
    # The denominator holds every sink: compare with the loop that adds each exp(sink).
    scores = np.einsum("btnh,bsnh->bnts", np.float64(q), np.float64(k)) * 8**-0.5
    denom = np.exp(scores).sum(-1) + np.exp(np.float64(sinks)).sum(-1)[None, :, None]
    np.testing.assert_allclose(got[1], np.log(denom), rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda s: reference_attention(q, k, v, softmax_sinks=s).sum())(sinks)
    assert g.shape == (4, 3) and np.all(np.isfinite(np.asarray(g)))
    assert fold_sinks(jnp.zeros((4, 0))).shape == (4,)


@pytest.mark.parametrize("empty", ["B", "T", "S"])
def test_empty_axes(empty):
    sizes = {"B": 2, "T": 5, "S": 7, **{empty: 0}}
    q = jnp.ones((sizes["B"], sizes["T"], 2, 4))
    k = jnp.ones((sizes["B"], sizes["S"], 1, 4))
    out, lse = reference_attention(q, k, k, return_lse=True)
    assert out.shape == q.shape and lse.shape == (sizes["B"], 2, sizes["T"])
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
    sinks = jnp.asarray([0.5, -1.0])
    out, lse = reference_attention(q, k, k, softmax_sinks=sinks, return_lse=True)
    assert np.all(np.asarray(out) == 0)
    if empty == "S":
        np.testing.assert_allclose(
            lse, np.broadcast_to(np.asarray(sinks)[None, :, None], lse.shape)
        )


def test_visibility_offsets_are_global_positions():
    full = visibility_mask(12, 12, causal=True, sliding_window=(3, 1))
    part = visibility_mask(4, 6, causal=True, sliding_window=(3, 1), q_offset=8, kv_offset=3)
    np.testing.assert_array_equal(part, full[:, :, 8:12, 3:9])


def test_mask_joins_the_visibility():
    rng = np.random.default_rng(6)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 5, 2, 4)), jnp.float32) for _ in range(3))
    mask = jnp.asarray(rng.random((1, 2, 5, 5)) < 0.6)
    got = reference_attention(q, k, v, mask=mask, logits_soft_cap=2.0)
    capped = reference_attention(q, k, v, bias=jnp.where(mask, 0.0, -jnp.inf), logits_soft_cap=2.0)
    assert not np.allclose(got, capped)  # a soft cap would turn a -inf bias into -cap
    np.testing.assert_allclose(
        got, loop_attention_masked(q, k, v, mask, cap=2.0), rtol=2e-5, atol=2e-5
    )


def loop_attention_masked(q, k, v, mask, cap):
    q, k, v, mask = (np.asarray(x, np.float64) for x in (q, k, v, mask))
    s = np.einsum("btnh,bsnh->bnts", q, k) * q.shape[-1] ** -0.5
    s = cap * np.tanh(s / cap)
    s = np.where(np.broadcast_to(mask, s.shape) > 0, s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    p = np.where(np.isfinite(s), np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    den = p.sum(-1, keepdims=True)
    p = np.where(den > 0, p / np.where(den > 0, den, 1), 0)
    return np.einsum("bnts,bsnh->btnh", p, v)
