"""FP8 KV pages: `quantize_kv` / `dequantize_kv`, their validation in
`validate_paged_attention`, and the paged reference on fp8 pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_sequtils import (
    FP8_KV_DTYPE,
    FP8_KV_MAX,
    assert_allclose,
    dequantize_kv,
    gather_pages,
    paged_reference_attention,
    quantize_kv,
    validate_paged_attention,
)

# Pairwise-distinct sizes: pool pages, page size, kv heads, head dim.
P, PAGE, K, H = 7, 4, 2, 12


def _pool(seed, spread=True):
    """f32 ``[P, PAGE, K, H]`` whose rows differ in magnitude by up to 1e4 (and one zero row)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((P, PAGE, K, H)).astype(np.float32)
    if spread:
        x *= 10.0 ** rng.uniform(-2, 2, size=(P, PAGE, K, 1)).astype(np.float32)
    x[1, 2, 0] = 0.0
    return jnp.asarray(x)


def test_quantize_round_trip_within_e4m3_rounding():
    x = _pool(0)
    q, scales = quantize_kv(x)
    assert q.dtype == FP8_KV_DTYPE and q.shape == x.shape
    assert scales.dtype == jnp.float32 and scales.shape == x.shape[:-1]
    back = np.asarray(dequantize_kv(q, scales))
    x, s = np.asarray(x), np.asarray(scales)[..., None]
    assert np.isfinite(back).all()
    # Each row's amax lands on 448: nothing saturates, nothing overflows to NaN.
    amax = np.abs(x).max(-1)
    live = amax > 0
    assert np.all(np.abs(np.asarray(q, np.float32)).max(-1)[live] == FP8_KV_MAX)
    # e4m3 keeps 3 mantissa bits: half an ulp is 2**-4 of the value in the normal range
    # (|x| / scale >= 2**-6) and 2**-10 (half the subnormal spacing) below it.
    err = np.abs(back - x)
    normal = np.abs(x) / s >= 2.0**-6
    assert np.all(err[normal] <= 2.0**-4 * np.abs(x[normal]) * (1 + 1e-6))
    assert np.all(err[~normal] <= 2.0**-10 * np.broadcast_to(s, x.shape)[~normal] * (1 + 1e-6))
    # A row of zeros: scale 1, zeros back.
    assert float(scales[1, 2, 0]) == 1.0 and np.all(back[1, 2, 0] == 0)


def test_quantize_under_jit_and_scalar_dequantize():
    x = _pool(1, spread=False)
    q, scales = jax.jit(quantize_kv)(x)
    q2, scales2 = quantize_kv(x)
    assert np.array_equal(np.asarray(q, np.float32), np.asarray(q2, np.float32))
    assert np.array_equal(scales, scales2)
    # A scalar scale multiplies every element.
    one = dequantize_kv(q, jnp.float32(0.25))
    assert_allclose(one, np.asarray(q, np.float32) * 0.25, rtol=0.0, atol=0.0)


def _request_args(seed, *, scalar=False):
    rng = np.random.default_rng(seed)
    k, v = _pool(seed), _pool(seed + 1)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    if scalar:
        ks, vs = jnp.float32(0.03), 0.5
    q = jnp.asarray(rng.standard_normal((3, 2, 4, H)), jnp.float32)
    table = jnp.asarray(rng.integers(0, P, size=(3, 3)), jnp.int32)
    kv_lens = jnp.asarray([0, 5, 12], jnp.int32)
    return (q, kq, vq, table, kv_lens), {"k_scales": ks, "v_scales": vs}


@pytest.mark.parametrize("scalar", [False, True])
def test_reference_dequantizes(scalar):
    """The reference on fp8 pages is the reference on their dequantised float32 values."""
    args, scales = _request_args(3, scalar=scalar)
    q, kq, vq, table, kv_lens = args
    request = validate_paged_attention(*args, **scales, sliding_window=(6, 0))
    assert request.is_quantized and "fp8_kv" in request.features()
    out = paged_reference_attention(request)
    k = dequantize_kv(kq, scales["k_scales"])
    v = dequantize_kv(vq, scales["v_scales"])
    plain = validate_paged_attention(q, k, v, table, kv_lens, sliding_window=(6, 0))
    assert not plain.is_quantized and "fp8_kv" not in plain.features()
    assert_allclose(out, paged_reference_attention(plain), rtol=1e-6, atol=1e-6)
    # gather_pages dequantises only the gathered rows: the same as gathering the values.
    gathered = gather_pages(kq, table, kv_lens, scales=scales["k_scales"])
    assert gathered.dtype == jnp.float32
    assert_allclose(gathered, gather_pages(k, table, kv_lens), rtol=0.0, atol=0.0)


def _bad(args, scales):
    q, kq, vq = args[:3]
    bf16 = kq.astype(jnp.bfloat16)
    ks = scales["k_scales"]
    return [
        ({"k_scales": None, "v_scales": None}, ValueError,
         r"k_pages of dtype float8_e4m3fn need k_scales \(float32 \[P, page_size, K\]=\(7, 4, 2\) or a scalar\), got k_scales=None"),
        ({"v_scales": None}, ValueError, r"v_pages of dtype float8_e4m3fn need v_scales"),
        ({"k_scales": ks[:, :2]}, ValueError,
         r"k_scales must have shape \[P, page_size, K\]=\(7, 4, 2\) or \(\), got k_scales.shape=\(7, 2, 2\)"),
        ({"v_scales": jnp.ones((P, PAGE, K, 1), jnp.float32)}, ValueError, r"v_scales.shape=\(7, 4, 2, 1\)"),
        ({"k_scales": ks.astype(jnp.bfloat16)}, TypeError, r"k_scales must be float32, got k_scales.dtype=bfloat16"),
        ({"k_scales": "1.0"}, TypeError, r"k_scales must be float32 \[P, page_size, K\]"),
        ({"k_pages": bf16, "v_pages": bf16, "q": q.astype(jnp.bfloat16)}, TypeError,
         r"k_scales is only for float8_e4m3fn pages, got k_scales with k_pages.dtype=bfloat16"),
        ({"v_pages": vq.astype(jnp.float32)}, TypeError,
         r"must share one dtype .* k_pages.dtype=float8_e4m3fn, v_pages.dtype=float32"),
        ({"k_pages": kq.astype(jnp.float8_e5m2), "v_pages": vq.astype(jnp.float8_e5m2)}, TypeError,
         r"k_pages in 8 bits must be float8_e4m3fn \(with scales\), got k_pages.dtype=float8_e5m2"),
    ]  # fmt: skip


def test_bad_scales_name_the_argument(no_shape_checks):
    args, scales = _request_args(5)
    names = ("q", "k_pages", "v_pages", "page_table", "kv_lens")
    for changes, error, match in _bad(args, scales):
        call = {**dict(zip(names, args, strict=True)), **scales, **changes}
        with pytest.raises(error, match=match):
            validate_paged_attention(**call)
    # With unquantised pages and no scales: no scale fields.
    q, kq, vq, table, kv_lens = args
    plain = validate_paged_attention(q, kq.astype(q.dtype), vq.astype(q.dtype), table, kv_lens)
    assert plain.k_scales is None and plain.v_scales is None
