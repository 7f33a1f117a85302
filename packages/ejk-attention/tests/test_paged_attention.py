"""`paged_attention` / `ragged_paged_attention` against the float32 paged reference.

Random page tables share pages between sequences and list them out of order; their
entries past each sequence's last page hold garbage, and the pool's unused slots hold
NaN, so a backend that reads either fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import (
    _backends,
    _paged,
    _paged_backends,
    _paged_xla,
    paged_attention,
    ragged_paged_attention,
)
from ejk_sequtils import (
    FP8_KV_DTYPE,
    assert_allclose,
    attention_tolerance,
    dequantize_kv,
    paged_reference_attention,
    quantize_kv,
    validate_paged_attention,
)

# Pool pages, page size, head dim: pairwise distinct from the other sizes below.
P, PAGE, H = 13, 8, 24


def _has_triton_paged() -> bool:
    try:
        import ejk_kernels_gpu
    except ImportError:
        return False
    return hasattr(ejk_kernels_gpu, "paged_attention_request")


def _inputs(seed, kv_lens, *, cols, heads, kv_heads, dtype, q_rows):
    """q ``q_rows`` (a shape), pools whose slots past every length are NaN, a random table."""
    rng = np.random.default_rng(seed)
    kv_lens = np.asarray(kv_lens, np.int32)
    table = rng.integers(0, P, size=(len(kv_lens), cols)).astype(np.int32)
    for b, n in enumerate(kv_lens):
        table[b, -(-n // PAGE) :] = rng.choice([-3, P + 4])
    pools = []
    for _ in range(2):
        pool = rng.standard_normal((P, PAGE, kv_heads, H)).astype(np.float32)
        used = np.zeros((P, PAGE), bool)
        for b, n in enumerate(kv_lens):
            for j in range(n):
                used[table[b, j // PAGE], j % PAGE] = True
        pool[~used] = np.nan
        pools.append(jnp.asarray(pool, dtype))
    q = jnp.asarray(rng.standard_normal((*q_rows, heads, H)), dtype)
    return q, pools[0], pools[1], jnp.asarray(table), jnp.asarray(kv_lens)


def _expected(q, k_pages, v_pages, table, kv_lens, **kwargs):
    """The reference on the float32-upcast inputs."""
    f32 = (x.astype(jnp.float32) for x in (q, k_pages, v_pages))
    return paged_reference_attention(validate_paged_attention(*f32, table, kv_lens, **kwargs))


def _sinks(heads):
    return jnp.asarray(np.random.default_rng(9).standard_normal((heads, 2)), jnp.float32)


CASES = [
    # (q_len, heads, kv_heads, features)
    (1, 6, 2, {}),
    (1, 4, 1, {"sliding_window": (9, 0)}),  # MQA
    (5, 6, 2, {"logits_soft_cap": 3.0}),
    (5, 6, 3, {"softmax_sinks": True}),
    (17, 4, 2, {"sliding_window": 12, "logits_soft_cap": 5.0, "softmax_sinks": True}),
    (64, 2, 2, {}),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(("q_len", "heads", "kv_heads", "features"), CASES)
def test_xla_matches_reference(dtype, q_len, heads, kv_heads, features):
    cols = 9
    capacity = cols * PAGE
    # 0 (idle), shorter than q_len (negative positions), a page edge, random, full.
    kv_lens = [0, max(q_len - 3, 1), PAGE, 37, capacity]
    args = _inputs(q_len, kv_lens, cols=cols, heads=heads, kv_heads=kv_heads, dtype=dtype,
                   q_rows=(len(kv_lens), q_len))  # fmt: skip
    kwargs = dict(features)
    if kwargs.pop("softmax_sinks", False):
        kwargs["softmax_sinks"] = _sinks(heads)
    out = paged_attention(*args, implementation="xla", **kwargs)
    assert out.shape == args[0].shape and out.dtype == dtype
    tol = attention_tolerance(dtype, "out")
    assert_allclose(out, _expected(*args, **kwargs), rtol=tol, atol=tol)
    assert np.all(np.asarray(out[0], np.float32) == 0)  # the idle slot


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_mixes_prefill_and_decode(dtype):
    kv_lens = [40, 3, 0, 71, 9, 2]
    q_lens = [13, 1, 0, 1, 9, 4]  # prefill chunks, decode steps, an idle slot, T_b > kv_len
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    args = _inputs(7, kv_lens, cols=9, heads=6, kv_heads=2, dtype=dtype, q_rows=(int(cu[-1]),))
    kwargs = {"sliding_window": (20, 0), "softmax_sinks": _sinks(6), "logits_soft_cap": 6.0}
    out = ragged_paged_attention(*args, cu, implementation="xla", **kwargs)
    assert out.shape == args[0].shape and out.dtype == dtype
    expected = _expected(*args, cu_q_lens=cu, **kwargs)
    tol = attention_tolerance(dtype, "out")
    assert_allclose(out, expected, rtol=tol, atol=tol)
    # The decode row of sequence 1 is the [B, T=1] call of that sequence.
    q, k_pages, v_pages, table, lens = args
    one = paged_attention(q[13:14][None], k_pages, v_pages, table[1:2], lens[1:2], **kwargs)
    assert_allclose(out[13], one[0, 0], rtol=tol, atol=tol)


def test_chunked_over_sequences(monkeypatch):
    """A batch larger than the memory budget runs in chunks (lax.map): same values."""
    args = _inputs(3, [5, 0, 33, 60, 1], cols=8, heads=4, kv_heads=2, dtype=jnp.float32,
                   q_rows=(5, 2))  # fmt: skip
    whole = paged_attention(*args, implementation="xla")
    # 1: one sequence at a time; 15000: two at a time (7168 elements each), then the fifth.
    for budget in (1, 15_000):
        monkeypatch.setattr(_paged_xla, "_CHUNK_ELEMENTS", budget)
        _paged_xla._paged.clear_cache()
        chunked = paged_attention(*args, implementation="xla")
        assert_allclose(chunked, whole, rtol=1e-6, atol=1e-6)
    _paged_xla._paged.clear_cache()


def test_under_jit_with_traced_lengths():
    args = _inputs(4, [7, 50, 0], cols=8, heads=4, kv_heads=1, dtype=jnp.float32, q_rows=(3, 3))
    step = jax.jit(lambda *a: paged_attention(*a, sliding_window=(6, 0)))
    out = step(*args)
    assert_allclose(out, _expected(*args, sliding_window=(6, 0)), rtol=1e-4, atol=1e-4)
    other = (*args[:4], jnp.asarray([2, 49, 0], jnp.int32))  # same compiled step
    assert_allclose(step(*other), _expected(*other, sliding_window=(6, 0)), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not _has_triton_paged(), reason="ejk_kernels_gpu has no paged kernel")
def test_triton_matches_reference():
    """The Triton kernel through the facade (interpreted on CPU): float32, small."""
    args = _inputs(5, [0, 3, 21], cols=4, heads=4, kv_heads=2, dtype=jnp.float32, q_rows=(3, 2))
    kwargs = {"sliding_window": (10, 0), "softmax_sinks": _sinks(4)}
    out = paged_attention(*args, implementation="triton", **kwargs)
    assert_allclose(out, _expected(*args, **kwargs), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not _has_triton_paged(), reason="ejk_kernels_gpu has no paged kernel")
def test_triton_config_from_the_executor(monkeypatch):
    """No config: the executor's choice (here the kernel's heuristic); a config: that one."""
    import ejk_kernels_gpu

    seen = []
    monkeypatch.setattr(
        ejk_kernels_gpu, "paged_attention_request", lambda r, config: seen.append(config) or r.q
    )
    args = _inputs(5, [3, 9], cols=2, heads=4, kv_heads=2, dtype=jnp.float32, q_rows=(2, 1))
    paged_attention(*args, implementation="triton")
    backend = _backends.BACKENDS["triton"].paged
    request = validate_paged_attention(*args)
    assert seen[0] == backend.invocations(request)["forward"].kernel.heuristic_cfg(
        backend.invocations(request)["forward"]
    )
    paged_attention(*args, implementation="triton", config=seen[0])
    assert seen[1] is seen[0]


def test_default_is_xla_off_gpu(monkeypatch):
    calls = []

    class Recording(_paged_backends.PagedXlaBackend):
        def run(self, request, config, bwd_config):
            calls.append(request.q.shape)
            return super().run(request, config, bwd_config)

    monkeypatch.setattr(_backends.BACKENDS["xla"], "paged", Recording())
    args = _inputs(6, [4, 9], cols=2, heads=2, kv_heads=1, dtype=jnp.float32, q_rows=(2, 1))
    paged_attention(*args)
    assert calls == [(2, 1, 2, H)]


def test_implementation_names():
    args = _inputs(6, [4, 9], cols=2, heads=2, kv_heads=1, dtype=jnp.float32, q_rows=(2, 1))
    with pytest.raises(ValueError, match=r"implementation must be one of \('xla', 'triton'"):
        paged_attention(*args, implementation="cuda")
    with pytest.raises(NotImplementedError, match=r"implementation='cudnn' cannot serve"):
        paged_attention(*args, implementation="cudnn")
    out = paged_attention(*args, implementation=("cudnn", "xla"))
    assert_allclose(out, _expected(*args), rtol=1e-4, atol=1e-4)


def _has_pallas_paged() -> bool:
    try:
        import ejk_kernels_tpu
    except ImportError:
        return False
    return hasattr(ejk_kernels_tpu, "paged_attention_request")


needs_pallas = pytest.mark.skipif(not _has_pallas_paged(), reason="no ejk_kernels_tpu paged kernel")


@needs_pallas
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_matches_reference(dtype):
    """The Pallas kernel through the facade (Pallas' TPU interpreter on CPU): both forms."""
    args = _inputs(5, [0, 3, 21, 72], cols=9, heads=4, kv_heads=2, dtype=dtype, q_rows=(4, 2))
    kwargs = {"sliding_window": (10, 0), "softmax_sinks": _sinks(4), "logits_soft_cap": 4.0}
    tol = attention_tolerance(dtype, "out")
    out = paged_attention(*args, implementation="pallas", **kwargs)
    assert_allclose(out, _expected(*args, **kwargs), rtol=tol, atol=tol)
    kv_lens = [40, 3, 0, 9]
    q_lens = [13, 1, 0, 4]  # a prefill chunk, a decode step, an idle slot, T_b > kv_len
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    args = _inputs(7, kv_lens, cols=9, heads=4, kv_heads=1, dtype=dtype, q_rows=(int(cu[-1]),))
    out = ragged_paged_attention(*args, cu, implementation="pallas", **kwargs)
    assert_allclose(out, _expected(*args, cu_q_lens=cu, **kwargs), rtol=tol, atol=tol)


@needs_pallas
def test_pallas_is_the_default_on_tpu_with_the_executors_config(monkeypatch):
    """On TPU ``implementation=None`` runs pallas, with the executor's config (here the
    kernel's heuristic) or the one given; a request it refuses falls through to xla."""
    import ejk_kernels_tpu

    seen = []
    monkeypatch.setattr(_paged, "platform_of", lambda request: "tpu")
    monkeypatch.setattr(
        ejk_kernels_tpu, "paged_attention_request", lambda r, config: seen.append(config) or r.q
    )
    # Eager calls run a compiled function traced once per signature: the patches above (and
    # below) are no cache key, so each one drops what earlier calls compiled.
    _paged._eager_call.clear_cache()
    args = _inputs(5, [3, 9], cols=2, heads=4, kv_heads=2, dtype=jnp.float32, q_rows=(2, 1))
    paged_attention(*args)
    backend = _backends.BACKENDS["pallas"].paged
    inv = backend.invocations(validate_paged_attention(*args))["forward"]
    assert seen == [inv.kernel.heuristic_cfg(inv)]
    assert isinstance(seen[0], ejk_kernels_tpu.RaggedPagedConfig)
    config = ejk_kernels_tpu.RaggedPagedConfig(block_q=32, pages_per_block=1)
    paged_attention(*args, config=config)
    assert seen[1] is config
    monkeypatch.setattr(ejk_kernels_tpu, "unsupported_paged_reason", lambda r: "no, because")
    _paged._eager_call.clear_cache()
    out = paged_attention(*args)
    assert len(seen) == 2  # pallas refused: xla served it
    assert_allclose(out, _expected(*args), rtol=1e-4, atol=1e-4)
    with pytest.raises(NotImplementedError, match=r"'pallas' cannot serve .*: no, because"):
        paged_attention(*args, implementation="pallas")


def _valid():
    q, k_pages, v_pages, table, kv_lens = _inputs(
        8, [4, 9], cols=2, heads=4, kv_heads=2, dtype=jnp.float32, q_rows=(2, 1)
    )
    return {"q": q, "k_pages": k_pages, "v_pages": v_pages, "page_table": table, "kv_lens": kv_lens}


BAD = [
    ({"page_table": jnp.zeros((2, 2), jnp.float32)}, TypeError, r"page_table must have an integer dtype"),
    ({"page_table": np.zeros((2, 2), np.int64)}, TypeError, r"page_table must be int32"),
    ({"page_table": jnp.zeros((3, 2), jnp.int32)}, ValueError, r"page_table must have shape \[B, pages_per_seq\]=\(2, 2\)"),
    ({"kv_lens": jnp.zeros((2, 1), jnp.int32)}, ValueError, r"kv_lens must have shape \[B\]=\(2,\)"),
    ({"kv_lens": jnp.asarray([4, 17], jnp.int32)}, ValueError, r"kv_lens must be in \[0, pages_per_seq \* page_size = 16\], got kv_lens\[1\]=17"),
    ({"k_pages": jnp.zeros((P, PAGE, 3, H)), "v_pages": jnp.zeros((P, PAGE, 3, H))}, ValueError, r"q heads=4 must be a multiple of the pages' kv heads=3"),
    ({"k_pages": jnp.zeros((P, PAGE, 2, H + 8)), "v_pages": jnp.zeros((P, PAGE, 2, H + 8))}, ValueError, r"k_pages must have q's head_dim 24"),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "error", "match"), BAD)
def test_bad_input_names_the_argument(changes, error, match, no_shape_checks):
    with pytest.raises(error, match=match):
        paged_attention(**{**_valid(), **changes})


def test_ragged_bad_cu_q_lens(no_shape_checks):
    args = _valid()
    q = jnp.zeros((3, 4, H))
    with pytest.raises(ValueError, match=r"cu_q_lens must end at total_q=3"):
        ragged_paged_attention(**{**args, "q": q}, cu_q_lens=jnp.asarray([0, 1, 2], jnp.int32))
    with pytest.raises(TypeError, match=r"cu_q_lens must have an integer dtype"):
        ragged_paged_attention(**{**args, "q": q}, cu_q_lens=jnp.asarray([0.0, 1.0, 3.0]))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40))
def test_sampled_grid(seed):
    """Random batch, lengths, page size, table width, heads, T, features and dtype."""
    rng = np.random.default_rng(100 + seed)
    kv_heads = int(rng.choice([1, 2, 3]))
    heads = kv_heads * int(rng.choice([1, 2, 4]))
    cols = int(rng.integers(1, 10))
    q_len = int(rng.choice([1, 2, 7, 33, 64]))
    batch = int(rng.integers(1, 6))
    kv_lens = rng.integers(0, cols * PAGE + 1, size=batch)
    kv_lens[0] = int(rng.choice([0, cols * PAGE]))
    dtype = [jnp.float32, jnp.bfloat16, jnp.float16][seed % 3]
    args = _inputs(seed, kv_lens, cols=cols, heads=heads, kv_heads=kv_heads, dtype=dtype,
                   q_rows=(batch, q_len))  # fmt: skip
    kwargs = {}
    if rng.random() < 0.5:
        kwargs["sliding_window"] = (int(rng.integers(0, 40)), int(rng.integers(0, 3)))
    if rng.random() < 0.4:
        kwargs["logits_soft_cap"] = float(rng.uniform(1, 20))
    if rng.random() < 0.4:
        kwargs["softmax_sinks"] = _sinks(heads)
    tol = attention_tolerance(dtype, "out")
    out = paged_attention(*args, implementation="xla", **kwargs)
    assert_allclose(out, _expected(*args, **kwargs), rtol=tol, atol=tol)
    # The same rows as one ragged call (every sequence with T_b = min(T, ...) rows).
    q_lens = rng.integers(0, q_len + 1, size=batch)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    rows = np.concatenate(
        [np.stack([np.full(t, b), np.arange(t)], 1) for b, t in enumerate(q_lens)]
    )
    q = args[0][rows[:, 0], rows[:, 1]] if len(rows) else args[0].reshape(-1, heads, H)[:0]
    ragged = (q, *args[1:])
    out = ragged_paged_attention(*ragged, cu, implementation="xla", **kwargs)
    assert_allclose(out, _expected(*ragged, cu_q_lens=cu, **kwargs), rtol=tol, atol=tol)


def test_ragged_under_jit_rows_past_the_last_sequence_are_zero():
    """Traced cu_q_lens cannot be checked: rows past cu_q_lens[-1] give zeros, as the
    reference defines, and the others are exact."""
    kv_lens = [30, 4, 12]
    args = _inputs(11, kv_lens, cols=5, heads=4, kv_heads=2, dtype=jnp.float32, q_rows=(20,))
    cu = jnp.asarray([0, 9, 10, 16], jnp.int32)  # 4 rows of padding at the end
    out = jax.jit(ragged_paged_attention)(*args, cu)
    q, *rest = args
    expected = _expected(q[:16], *rest, cu_q_lens=cu)
    assert_allclose(out[:16], expected, rtol=1e-4, atol=1e-4)
    assert np.all(np.asarray(out[16:]) == 0)


def _quantized(args, *, scalar):
    """``args`` with fp8 pools: ``(args, scales, dequantised)`` where ``dequantised`` is the
    call on the float32 values the fp8 pools hold (the NaN slots stay NaN, scales too)."""
    q, k_pages, v_pages, table, kv_lens = args
    if scalar:
        scales = {"k_scales": jnp.float32(1 / 64), "v_scales": 1 / 32}
        kq, vq = ((x.astype(jnp.float32) / s).astype(FP8_KV_DTYPE)
                  for x, s in ((k_pages, 1 / 64), (v_pages, 1 / 32)))  # fmt: skip
    else:
        (kq, ks), (vq, vs) = quantize_kv(k_pages), quantize_kv(v_pages)
        scales = {"k_scales": ks, "v_scales": vs}
    plain = (dequantize_kv(kq, scales["k_scales"]), dequantize_kv(vq, scales["v_scales"]))
    return (q, kq, vq, table, kv_lens), scales, (q, *plain, table, kv_lens)


FP8_CASES = [
    # (q_len, heads, kv_heads, features)
    (1, 6, 2, {}),  # GQA decode
    (5, 4, 1, {"sliding_window": (9, 0), "softmax_sinks": True}),  # MQA, a few new tokens
    (3, 6, 3, {"logits_soft_cap": 4.0}),
]


@pytest.mark.parametrize("scalar", [False, True], ids=["per_token", "scalar"])
@pytest.mark.parametrize(("q_len", "heads", "kv_heads", "features"), FP8_CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_xla_matches_reference_on_the_dequantised_cache(dtype, q_len, heads, kv_heads,
                                                            features, scalar):  # fmt: skip
    kv_lens = [0, 2, PAGE, 37, 9 * PAGE]
    args = _inputs(21, kv_lens, cols=9, heads=heads, kv_heads=kv_heads, dtype=jnp.float32,
                   q_rows=(len(kv_lens), q_len))  # fmt: skip
    args = (args[0].astype(dtype), *args[1:])
    fp8, scales, plain = _quantized(args, scalar=scalar)
    kwargs = dict(features)
    if kwargs.pop("softmax_sinks", False):
        kwargs["softmax_sinks"] = _sinks(heads)
    out = paged_attention(*fp8, **scales, implementation="xla", **kwargs)
    assert out.shape == args[0].shape and out.dtype == dtype
    tol = attention_tolerance(dtype, "out")
    assert_allclose(out, _expected(*plain, **kwargs), rtol=tol, atol=tol)
    assert np.all(np.asarray(out[0], np.float32) == 0)  # the idle slot


def test_fp8_xla_ragged_and_chunked(monkeypatch):
    """The ragged form, and a batch cut into chunks (each dequantises its own pages)."""
    kv_lens = [40, 3, 0, 71, 9]
    q_lens = [13, 1, 0, 1, 4]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    args = _inputs(17, kv_lens, cols=9, heads=6, kv_heads=2, dtype=jnp.float32,
                   q_rows=(int(cu[-1]),))  # fmt: skip
    fp8, scales, plain = _quantized(args, scalar=False)
    kwargs = {"sliding_window": (20, 0), "logits_soft_cap": 6.0}
    expected = _expected(*plain, cu_q_lens=cu, **kwargs)
    out = ragged_paged_attention(*fp8, cu, **scales, implementation="xla", **kwargs)
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(_paged_xla, "_CHUNK_ELEMENTS", 1)
    _paged_xla._paged.clear_cache()
    _paged_xla._ragged.clear_cache()
    try:
        out = ragged_paged_attention(*fp8, cu, **scales, implementation="xla", **kwargs)
    finally:
        _paged_xla._paged.clear_cache()
        _paged_xla._ragged.clear_cache()
    assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_fp8_under_jit_with_traced_scales():
    args = _inputs(4, [7, 50, 0], cols=8, heads=4, kv_heads=2, dtype=jnp.float32, q_rows=(3, 1))
    fp8, scales, plain = _quantized(args, scalar=False)
    step = jax.jit(lambda *a, k_scales, v_scales: paged_attention(
        *a, k_scales=k_scales, v_scales=v_scales))  # fmt: skip
    assert_allclose(step(*fp8, **scales), _expected(*plain), rtol=1e-4, atol=1e-4)
    half = {name: s * 0.5 for name, s in scales.items()}  # same compiled step, new scales
    plain_half = (plain[0], plain[1] * 0.5, plain[2] * 0.5, *plain[3:])
    assert_allclose(step(*fp8, **half), _expected(*plain_half), rtol=1e-4, atol=1e-4)


def test_fp8_bad_input_names_the_argument(no_shape_checks):
    """The facade passes the scales to `validate_paged_attention` (all its cases are in
    ejk-sequtils' tests); one of each kind here."""
    fp8, scales, _ = _quantized(tuple(_valid().values()), scalar=False)
    with pytest.raises(ValueError, match=r"k_pages of dtype float8_e4m3fn need k_scales"):
        paged_attention(*fp8)
    with pytest.raises(
        ValueError,
        match=r"v_scales must have shape \[P, page_size, K\]=\(13, 8, 2\) or \(\), got v_scales.shape=\(13, 8\)",
    ):
        paged_attention(*fp8, k_scales=scales["k_scales"], v_scales=scales["v_scales"][..., 0])
    with pytest.raises(TypeError, match=r"k_scales must be float32, got k_scales.dtype=float16"):
        paged_attention(*fp8, k_scales=scales["k_scales"].astype(jnp.float16), v_scales=1.0)
    with pytest.raises(
        TypeError,
        match=r"k_scales is only for float8_e4m3fn pages, got k_scales with k_pages.dtype=float32",
    ):
        paged_attention(*_valid().values(), k_scales=1.0, v_scales=1.0)


@pytest.mark.parametrize("scalar", [False, True], ids=["per_token", "scalar"])
@pytest.mark.parametrize(
    "implementation",
    [
        pytest.param("triton", marks=pytest.mark.skipif(not _has_triton_paged(), reason="no paged Triton kernel")),
        pytest.param("pallas", marks=needs_pallas),
    ],
)  # fmt: skip
def test_fp8_kernels_match_reference_on_the_dequantised_cache(implementation, scalar):
    """The Triton kernel (Triton's interpreter) and the Pallas kernel (Pallas' TPU
    interpreter) through the facade read fp8 pages with their scales: GQA decode and a
    ragged batch, against the reference on the dequantised float32 cache."""
    args = _inputs(23, [0, 3, 21, 40], cols=6, heads=6, kv_heads=2, dtype=jnp.float32,
                   q_rows=(4, 1))  # fmt: skip
    fp8, scales, plain = _quantized(args, scalar=scalar)
    kwargs = {"sliding_window": (30, 0), "softmax_sinks": _sinks(6)}
    out = paged_attention(*fp8, **scales, implementation=implementation, **kwargs)
    assert_allclose(out, _expected(*plain, **kwargs), rtol=1e-4, atol=1e-4)
    cu = jnp.asarray([0, 5, 6, 6, 9], jnp.int32)  # a prefill chunk, a decode row, idle, 3 rows
    args = _inputs(24, [30, 4, 0, 17], cols=6, heads=4, kv_heads=1, dtype=jnp.float32,
                   q_rows=(9,))  # fmt: skip
    fp8, scales, plain = _quantized(args, scalar=scalar)
    out = ragged_paged_attention(*fp8, cu, **scales, implementation=implementation)
    assert_allclose(out, _expected(*plain, cu_q_lens=cu), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_fp8_sampled_grid(seed):
    """Random batch, lengths, table width, heads, T, features, per-token or scalar scales,
    through every backend present, against the reference on the dequantised cache."""
    rng = np.random.default_rng(300 + seed)
    kv_heads = int(rng.choice([1, 2, 3]))
    heads = kv_heads * int(rng.choice([1, 2, 4]))
    cols = int(rng.integers(1, 7))
    q_len = int(rng.choice([1, 2, 7]))
    batch = int(rng.integers(1, 5))
    kv_lens = rng.integers(0, cols * PAGE + 1, size=batch)
    args = _inputs(seed, kv_lens, cols=cols, heads=heads, kv_heads=kv_heads, dtype=jnp.float32,
                   q_rows=(batch, q_len))  # fmt: skip
    fp8, scales, plain = _quantized(args, scalar=bool(seed % 2))
    kwargs = {}
    if rng.random() < 0.5:
        kwargs["sliding_window"] = (int(rng.integers(0, 30)), 0)
    if rng.random() < 0.4:
        kwargs["logits_soft_cap"] = float(rng.uniform(1, 20))
    if rng.random() < 0.4:
        kwargs["softmax_sinks"] = _sinks(heads)
    expected = _expected(*plain, **kwargs)
    names = ["xla"] + ["triton"] * _has_triton_paged() + ["pallas"] * _has_pallas_paged()
    for name in names:
        out = paged_attention(*fp8, **scales, implementation=name, **kwargs)
        assert_allclose(out, expected, rtol=1e-4, atol=1e-4, err_msg=name)
