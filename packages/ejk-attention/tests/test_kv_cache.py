"""`PagedKVCache`: allocation from the free stack, release, overflow, and attention over it.

A plain Python model (each slot's tokens in a list) is the truth: after every step the
cache must hold exactly those tokens, live slots must own disjoint pages, and the free
stack must hold every other page once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import PagedKVCache, paged_attention, reference_attention
from ejk_sequtils import assert_allclose, dequantize_kv, gather_pages, quantize_kv

NUM_PAGES, PAGE, K, H, SLOTS, COLS = 12, 4, 2, 8, 5, 6


def _cache(num_pages=NUM_PAGES, dtype=jnp.float32):
    return PagedKVCache.create(
        num_pages=num_pages, page_size=PAGE, kv_heads=K, head_dim=H, max_seqs=SLOTS,
        pages_per_seq=COLS, dtype=dtype,
    )  # fmt: skip


def _check(cache, truth):
    """The cache holds ``truth`` (slot -> list of (k, v) [K, H] arrays), and its pages add up."""
    lens = np.asarray(cache.kv_lens)
    assert lens.tolist() == [len(truth.get(s, [])) for s in range(SLOTS)]
    table = np.asarray(cache.page_table)
    owned = [table[s, : -(-n // PAGE)].tolist() for s, n in enumerate(lens)]
    flat = [p for pages in owned for p in pages]
    free = np.asarray(cache.free_pages)[: int(cache.num_free)].tolist()
    assert len(set(flat)) == len(flat), f"live slots share pages: {owned}"
    assert sorted(flat + free) == list(range(cache.k_pages.shape[0])), (owned, free)
    keys = np.asarray(gather_pages(cache.k_pages, cache.page_table, cache.kv_lens))
    values = np.asarray(gather_pages(cache.v_pages, cache.page_table, cache.kv_lens))
    for s, tokens in truth.items():
        for j, (k, v) in enumerate(tokens):
            np.testing.assert_array_equal(keys[s, j], k)
            np.testing.assert_array_equal(values[s, j], v)


def test_create():
    cache = _cache()
    assert cache.k_pages.shape == (NUM_PAGES, PAGE, K, H)
    assert cache.page_table.shape == (SLOTS, COLS) and cache.page_table.dtype == jnp.int32
    assert int(cache.num_free) == NUM_PAGES and not cache.overflow.any()
    assert (cache.page_size, cache.max_seqs, cache.capacity) == (PAGE, SLOTS, COLS * PAGE)
    leaves = jax.tree.leaves(cache)
    assert len(leaves) == 7 and all(isinstance(x, jax.Array) for x in leaves)


def test_append_release_cycles_under_jit():
    """Random prefill/decode/release steps; after each the cache equals the Python model."""
    rng = np.random.default_rng(0)
    append = jax.jit(PagedKVCache.append)
    release = jax.jit(PagedKVCache.release)
    cache, truth = _cache(num_pages=40), {}
    for step in range(14):
        seq_ids = rng.permutation(SLOTS)[:3].astype(np.int32)
        seq_ids[rng.random(3) < 0.2] = -1  # padding entries of the batch
        t = 5
        num_new = rng.integers(0, t + 1, size=3).astype(np.int32)
        k_new = rng.standard_normal((3, t, K, H)).astype(np.float32)
        v_new = rng.standard_normal((3, t, K, H)).astype(np.float32)
        for b, s in enumerate(seq_ids):
            if s >= 0 and len(truth.get(s, [])) + num_new[b] <= COLS * PAGE:
                truth.setdefault(s, []).extend(
                    (k_new[b, j], v_new[b, j]) for j in range(num_new[b])
                )
        cache = append(cache, k_new, v_new, jnp.asarray(seq_ids), jnp.asarray(num_new))
        assert not cache.overflow.any()  # 40 pages hold every slot full
        _check(cache, truth)
        if step % 3 == 2:
            gone = np.array([rng.integers(SLOTS), -1], np.int32)
            cache = release(cache, jnp.asarray(gone))
            truth.pop(int(gone[0]), None)
            _check(cache, truth)


def test_pages_run_out():
    """No free page: that sequence is refused and flagged, nothing else changes."""
    rng = np.random.default_rng(1)
    cache = _cache(num_pages=3)
    k = rng.standard_normal((2, 6, K, H)).astype(np.float32)
    cache = cache.append(k, k, np.array([0, 1], np.int32))  # 2 pages each: only slot 0 fits
    assert np.asarray(cache.kv_lens).tolist() == [6, 0, 0, 0, 0]
    assert np.asarray(cache.overflow).tolist() == [False, True, False, False, False]
    _check(cache, {0: [(k[0, j], k[0, j]) for j in range(6)]})
    # Slot 0 still grows within its page (no new page needed), slot 2 takes the last page.
    one = rng.standard_normal((2, 1, K, H)).astype(np.float32)
    cache = cache.append(one, one, np.array([0, 2], np.int32))
    assert np.asarray(cache.kv_lens).tolist() == [7, 0, 1, 0, 0] and int(cache.num_free) == 0
    # Releasing slot 0 frees its pages and the flag of slot 1 stays until it is released.
    cache = cache.release(np.array([0, 1], np.int32))
    assert int(cache.num_free) == 2 and not cache.overflow.any()


def test_row_full():
    cache = _cache()
    k = np.ones((1, COLS * PAGE, K, H), np.float32)
    cache = cache.append(k, k, np.array([3], np.int32))
    assert int(cache.kv_lens[3]) == COLS * PAGE and not cache.overflow.any()
    cache = cache.append(k[:, :1], k[:, :1], np.array([3], np.int32))
    assert int(cache.kv_lens[3]) == COLS * PAGE and bool(cache.overflow[3])


def test_decode_through_the_cache_matches_dense_reference():
    """Prefill two prompts, decode three steps in a jitted step; each step's attention
    over the cache equals the dense reference over the tokens appended so far."""
    rng = np.random.default_rng(2)
    heads, prompt = 4, (7, 2)
    slots = jnp.asarray([4, 1], jnp.int32)
    cache = _cache(dtype=jnp.float32)
    dense_k = [rng.standard_normal((n, K, H)).astype(np.float32) for n in prompt]
    dense_v = [rng.standard_normal((n, K, H)).astype(np.float32) for n in prompt]
    pad = max(prompt)
    k_new = np.stack([np.pad(k, ((0, pad - len(k)), (0, 0), (0, 0))) for k in dense_k])
    v_new = np.stack([np.pad(v, ((0, pad - len(v)), (0, 0), (0, 0))) for v in dense_v])
    cache = cache.append(k_new, v_new, slots, np.asarray(prompt, np.int32))

    @jax.jit
    def step(cache, q, k, v):
        cache = cache.append(k, v, slots)
        table, lens = cache.lookup(slots)
        return cache, paged_attention(q, cache.k_pages, cache.v_pages, table, lens)

    for _ in range(3):
        q = rng.standard_normal((2, 1, heads, H)).astype(np.float32)
        k = rng.standard_normal((2, 1, K, H)).astype(np.float32)
        v = rng.standard_normal((2, 1, K, H)).astype(np.float32)
        cache, out = step(cache, q, k, v)
        for b in range(2):
            dense_k[b] = np.concatenate([dense_k[b], k[b]])
            dense_v[b] = np.concatenate([dense_v[b], v[b]])
            # One query at the last position sees every key (no causal cut left).
            expected = reference_attention(q[b : b + 1], dense_k[b][None], dense_v[b][None])
            assert_allclose(out[b : b + 1], expected, rtol=1e-4, atol=1e-4)


def test_lookup_padding_is_idle():
    cache = _cache().append(np.ones((1, 3, K, H), np.float32), np.ones((1, 3, K, H), np.float32),
                            np.array([2], np.int32))  # fmt: skip
    table, lens = cache.lookup(np.array([2, -1], np.int32))
    assert lens.tolist() == [3, 0] and table.shape == (2, COLS)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda c: c.append(np.ones((2, 1, K, H)), np.ones((2, 1, K, H)), np.array([1, 1], np.int32)), ValueError, r"seq_ids must not repeat a sequence"),
        (lambda c: c.append(np.ones((1, 1, K, H)), np.ones((1, 1, K, H)), np.array([SLOTS], np.int32)), ValueError, r"seq_ids must be in \[-1, 5\)"),
        (lambda c: c.append(np.ones((1, 1, K + 1, H)), np.ones((1, 1, K + 1, H)), np.array([0], np.int32)), ValueError, r"k_new must be \[B, T, K, H\] with \[K, H\]=\(2, 8\)"),
        (lambda c: c.append(np.ones((1, 1, K, H)), np.ones((1, 2, K, H)), np.array([0], np.int32)), ValueError, r"v_new must have k_new's shape"),
        (lambda c: c.append(np.ones((1, 1, K, H)), np.ones((1, 1, K, H)), np.array([0, 1], np.int32)), ValueError, r"seq_ids must have shape \[B\]=\(1,\)"),
        (lambda c: c.release(np.array([0.0])), TypeError, r"seq_ids must be an integer array"),
        (lambda c: PagedKVCache.create(num_pages=0, page_size=4, kv_heads=1, head_dim=8, max_seqs=1, pages_per_seq=1), ValueError, r"num_pages must be > 0"),
        (lambda c: PagedKVCache.create(num_pages=2, page_size=4, kv_heads=1, head_dim=8, max_seqs=1, pages_per_seq=1, dtype=jnp.int32), TypeError, r"dtype must be a floating dtype"),
    ],
)  # fmt: skip
def test_bad_input(call, error, match, no_shape_checks):
    with pytest.raises(error, match=match):
        call(_cache())


def test_traced_repeats_are_skipped():
    """Inside jit a repeated id cannot be refused: its later entries are skipped."""
    k = np.ones((2, 2, K, H), np.float32)
    cache = jax.jit(PagedKVCache.append)(_cache(), k, k, jnp.asarray([1, 1], jnp.int32))
    assert int(cache.kv_lens[1]) == 2 and int(cache.num_free) == NUM_PAGES - 1


def test_cache_is_a_scan_carry():
    """A whole decode loop inside lax.scan: the cache is the carry, shapes stay static."""
    rng = np.random.default_rng(3)
    ks = jnp.asarray(rng.standard_normal((6, 2, 1, K, H)), jnp.float32)  # 6 steps, 2 slots
    slots = jnp.asarray([0, 2], jnp.int32)

    def body(cache, k):
        cache = cache.append(k, k, slots)
        return cache, cache.kv_lens[slots]

    cache, lens = jax.jit(lambda c, ks: jax.lax.scan(body, c, ks))(_cache(), ks)
    assert np.asarray(lens)[:, 0].tolist() == [1, 2, 3, 4, 5, 6]
    truth = {s: [(np.asarray(ks[t, b, 0]),) * 2 for t in range(6)] for b, s in enumerate((0, 2))}
    _check(cache, truth)


FP8 = jnp.float8_e4m3fn


def test_fp8_create_and_append_quantise_per_token_and_kv_head():
    cache = _cache(dtype=FP8)
    assert cache.is_quantized and cache.k_pages.dtype == FP8
    assert cache.k_scales.shape == (NUM_PAGES, PAGE, K) and cache.k_scales.dtype == jnp.float32
    assert len(jax.tree.leaves(cache)) == 9 and not _cache().is_quantized
    rng = np.random.default_rng(4)
    k = rng.standard_normal((2, 6, K, H)).astype(np.float32) * 10.0 ** rng.uniform(
        -2, 2, (2, 6, K, 1)
    )
    v = rng.standard_normal((2, 6, K, H)).astype(np.float32)
    k[0, 1, 0] = 0.0  # a zero token: scale 1, zeros back
    slots = jnp.asarray([3, 0], jnp.int32)
    cache = jax.jit(PagedKVCache.append)(cache, k, v, slots, jnp.asarray([6, 4], jnp.int32))
    # The cache holds exactly quantize_kv of each token, at its slot.
    for pages, scales, x in (
        (cache.k_pages, cache.k_scales, k),
        (cache.v_pages, cache.v_scales, v),
    ):
        held = gather_pages(pages, cache.page_table, cache.kv_lens, scales=scales)
        for b, (s, n) in enumerate(((3, 6), (0, 4))):
            xq, xs = quantize_kv(x[b, :n])
            assert_allclose(held[s, :n], dequantize_kv(xq, xs), rtol=0.0, atol=0.0)
            # Within e4m3's rounding of the input (half an ulp: 2**-4 of the element,
            # or 2**-10 of the scale below e4m3's normal range).
            bound = np.maximum(2.0**-4 * np.abs(x[b, :n]), 2.0**-10 * np.asarray(xs)[..., None])
            assert np.all(np.abs(np.asarray(held[s, :n]) - x[b, :n]) <= bound * (1 + 1e-6))
    assert np.all(np.asarray(gather_pages(cache.k_pages, cache.page_table, cache.kv_lens,
                                          scales=cache.k_scales)[3, 1, 0]) == 0)  # fmt: skip


def test_fp8_cache_output_close_to_the_float_cache():
    """Decode through an FP8 cache and through float32 / bfloat16 caches of the same
    tokens (random normal q, k, v; 300 keys, GQA 8/2, head_dim 64).

    Measured: the FP8 output's relative error (Frobenius norm) is 3.5-3.7 % of the float
    cache's, in float32 and bfloat16 alike. e4m3 keeps 3 mantissa bits: its rounding error
    is about 2.4 % RMS of a normal-distributed token (per-token amax scaling), and k and v
    both carry it (sqrt(2) x 2.4 % ~ 3.4 %); the bound 5 % leaves seeds their spread.
    """
    rng = np.random.default_rng(5)
    batch, length, heads = 3, 300, 8
    k = rng.standard_normal((batch, length, K, 64)).astype(np.float32)
    v = rng.standard_normal((batch, length, K, 64)).astype(np.float32)
    q = rng.standard_normal((batch, 1, heads, 64)).astype(np.float32)
    slots = jnp.asarray([2, 0, 4], jnp.int32)
    for dtype in (jnp.float32, jnp.bfloat16):
        outs = []
        for cache_dtype in (dtype, FP8):
            cache = PagedKVCache.create(num_pages=40, page_size=8, kv_heads=K, head_dim=64,
                                        max_seqs=SLOTS, pages_per_seq=40, dtype=cache_dtype)  # fmt: skip
            cache = cache.append(k.astype(dtype), v.astype(dtype), slots)
            out = jax.jit(PagedKVCache.attend)(cache, jnp.asarray(q, dtype), slots)
            assert out.dtype == dtype
            outs.append(np.asarray(out, np.float64))
        error = np.linalg.norm(outs[1] - outs[0]) / np.linalg.norm(outs[0])
        assert 0.005 < error < 0.05, f"{dtype}: relative error {error:.4f}"


def test_fp8_decode_matches_the_reference_on_the_dequantised_cache():
    """`attend` passes the scales: the output is attention over exactly the values the
    FP8 cache holds (dequantised), to float32 rounding."""
    rng = np.random.default_rng(6)
    slots = jnp.asarray([1, 3], jnp.int32)
    cache = _cache(num_pages=20, dtype=FP8)
    k = rng.standard_normal((2, 9, K, H)).astype(np.float32)
    v = rng.standard_normal((2, 9, K, H)).astype(np.float32)
    cache = cache.append(k, v, slots, jnp.asarray([9, 5], jnp.int32))
    q = rng.standard_normal((2, 1, 4, H)).astype(np.float32)
    out = cache.attend(q, slots, sliding_window=(6, 0))
    for b, n in enumerate((9, 5)):
        (kq, ks), (vq, vs) = quantize_kv(k[b, :n]), quantize_kv(v[b, :n])
        seen = slice(max(n - 7, 0), n)  # the window (6, 0) of the last position
        keys, values = dequantize_kv(kq, ks)[seen], dequantize_kv(vq, vs)[seen]
        expected = reference_attention(q[b : b + 1], keys[None], values[None])
        assert_allclose(out[b : b + 1], expected, rtol=1e-5, atol=1e-5)


def test_fp8_bad_dtype(no_shape_checks):
    with pytest.raises(TypeError, match=r"dtype in 8 bits must be float8_e4m3fn, got dtype="):
        _cache(dtype=jnp.float8_e5m2)
