"""Paged attention: `validate_paged_attention`, `gather_pages` and `paged_reference_attention`.

The reference is held to a float64 NumPy loop that reads each key straight from its
page (``page_table[b, j // page_size]``, slot ``j % page_size``), so a wrong gather, a
wrong position rule or a swapped axis fails here, below every backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_sequtils import (
    PagedAttentionRequest,
    assert_allclose,
    attention_tolerance,
    fold_sinks,
    gather_pages,
    paged_reference_attention,
    paged_visibility,
    ragged_rows,
    validate_paged_attention,
)

# Pairwise-distinct sizes: pool pages, page size, kv heads, head dim, table columns.
P, PAGE, K, H, COLS = 11, 4, 2, 8, 5
CAPACITY = COLS * PAGE


def _pool(rng, dtype=np.float32):
    k = rng.standard_normal((P, PAGE, K, H)).astype(dtype)
    v = rng.standard_normal((P, PAGE, K, H)).astype(dtype)
    return k, v


def _table(rng, kv_lens):
    """Random page ids, shared between sequences and out of order; entries past each
    sequence's last page hold garbage that must never be read."""
    table = rng.integers(0, P, size=(len(kv_lens), COLS)).astype(np.int32)
    for b, n in enumerate(kv_lens):
        table[b, -(-n // PAGE) :] = rng.choice([-7, P, 10**6])
    return table


def _naive(q_rows, seq, pos, k_pages, v_pages, table, *, scale, window, cap, sinks):
    """float64 loop: row r (sequence seq[r], position pos[r]) over the keys it sees."""
    q_rows, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q_rows, k_pages, v_pages))
    rows, heads, _ = q_rows.shape
    group = heads // k_pages.shape[2]
    out = np.zeros(q_rows.shape)
    for r in range(rows):
        p = pos[r]
        first = 0 if window is None else max(0, p - window[0])
        keys = list(range(first, p + 1)) if p >= 0 else []
        if not keys:
            continue
        page = [table[seq[r], j // PAGE] for j in keys]
        slot = [j % PAGE for j in keys]
        for n in range(heads):
            kk = k_pages[page, slot, n // group]
            vv = v_pages[page, slot, n // group]
            s = scale * kk @ q_rows[r, n]
            if cap is not None:
                s = cap * np.tanh(s / cap)
            m = s.max() if sinks is None else max(s.max(), sinks[n])
            e = np.exp(s - m)
            denom = e.sum() + (0.0 if sinks is None else np.exp(sinks[n] - m))
            out[r, n] = e @ vv / denom
    return out


def _dense_rows(kv_lens, q_len):
    seq = np.repeat(np.arange(len(kv_lens)), q_len)
    pos = np.concatenate([np.arange(n - q_len, n) for n in kv_lens]) if len(kv_lens) else seq
    return seq, pos


FEATURES = [
    {},
    {"sliding_window": (3, 0)},
    {"logits_soft_cap": 2.5},
    {"softmax_sinks": "sinks"},
    {"sliding_window": 6, "logits_soft_cap": 4.0, "softmax_sinks": "sinks"},
]


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize(("q_len", "heads"), [(1, 6), (3, 2), (7, 4)])
def test_reference_matches_loop(features, q_len, heads):
    rng = np.random.default_rng(q_len * 10 + heads)
    # 0 (idle slot), shorter than q_len (negative positions), a page boundary, full.
    kv_lens = np.array([0, 2, PAGE, 13, CAPACITY], np.int32)
    k_pages, v_pages = _pool(rng)
    table = _table(rng, kv_lens)
    q = rng.standard_normal((len(kv_lens), q_len, heads, H)).astype(np.float32)
    kwargs = dict(features)
    if "softmax_sinks" in kwargs:
        kwargs["softmax_sinks"] = rng.standard_normal((heads, 2)).astype(np.float32)
    request = validate_paged_attention(q, k_pages, v_pages, table, kv_lens, **kwargs)
    out = paged_reference_attention(request)
    assert out.shape == q.shape
    assert out.dtype == q.dtype
    seq, pos = _dense_rows(kv_lens, q_len)
    sinks = None if request.softmax_sinks is None else np.asarray(request.softmax_sinks)
    expected = _naive(
        q.reshape(-1, heads, H),
        seq,
        pos,
        k_pages,
        v_pages,
        table,
        scale=request.softmax_scale,
        window=request.sliding_window,
        cap=request.logits_soft_cap,
        sinks=sinks,
    )
    assert_allclose(out.reshape(-1, heads, H), expected, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out[0]) == 0)  # the idle slot
    assert np.all(np.asarray(out[1, : max(q_len - 2, 0)]) == 0)  # negative positions


def test_ragged_matches_loop_and_dense():
    rng = np.random.default_rng(1)
    heads = 4
    # A prefill chunk, two decode steps, an empty sequence, a chunk longer than its keys.
    kv_lens = np.array([9, 17, 1, 0, 3], np.int32)
    q_lens = np.array([6, 1, 1, 0, 5])
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    k_pages, v_pages = _pool(rng)
    table = _table(rng, kv_lens)
    q = rng.standard_normal((cu[-1], heads, H)).astype(np.float32)
    sinks = rng.standard_normal(heads).astype(np.float32)
    request = validate_paged_attention(
        q,
        k_pages,
        v_pages,
        table,
        kv_lens,
        cu_q_lens=cu,
        sliding_window=(4, 2),
        softmax_sinks=sinks,
    )
    assert request.is_ragged and request.batch == 5 and request.num_q_rows == cu[-1]
    out, lse = paged_reference_attention(request, return_lse=True)
    assert out.shape == q.shape and lse.shape == (heads, cu[-1])
    seq = np.repeat(np.arange(len(q_lens)), q_lens)
    pos = np.concatenate([np.arange(n - t, n) for n, t in zip(kv_lens, q_lens, strict=True)])
    expected = _naive(
        q, seq, pos, k_pages, v_pages, table, scale=H**-0.5, window=(4, 2), cap=None, sinks=sinks
    )
    assert_allclose(out, expected, rtol=1e-5, atol=1e-5)

    # Sequence 0's rows of the ragged call are the [B, T] call of that sequence alone.
    dense = validate_paged_attention(
        q[None, :6],
        k_pages,
        v_pages,
        table[:1],
        kv_lens[:1],
        sliding_window=(4, 2),
        softmax_sinks=sinks,
    )
    dense_out, dense_lse = paged_reference_attention(dense, return_lse=True)
    assert_allclose(out[:6], dense_out[0], rtol=1e-6, atol=1e-6)
    assert_allclose(lse[:, :6], dense_lse[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtypes_and_jit(dtype):
    rng = np.random.default_rng(2)
    kv_lens = jnp.asarray([5, 20, 0], jnp.int32)
    k_pages, v_pages = (jnp.asarray(x, dtype) for x in _pool(rng))
    table = jnp.asarray(_table(rng, np.asarray(kv_lens)))
    q = jnp.asarray(rng.standard_normal((3, 2, 4, H)), dtype)

    @jax.jit
    def run(q, k_pages, v_pages, table, kv_lens):
        return paged_reference_attention(
            validate_paged_attention(q, k_pages, v_pages, table, kv_lens, logits_soft_cap=3.0)
        )

    out = run(q, k_pages, v_pages, table, kv_lens)
    assert out.dtype == dtype
    f32 = [x.astype(jnp.float32) for x in (q, k_pages, v_pages)]
    expected = paged_reference_attention(
        validate_paged_attention(*f32, table, kv_lens, logits_soft_cap=3.0)
    )
    tol = attention_tolerance(dtype, "out")
    assert_allclose(out, expected, rtol=tol, atol=tol)


def test_gather_pages_reads_only_pages_in_use():
    rng = np.random.default_rng(3)
    kv_lens = np.array([0, 5, CAPACITY], np.int32)
    k_pages, _ = _pool(rng)
    table = _table(rng, kv_lens)
    out = np.asarray(gather_pages(k_pages, table, kv_lens))
    assert out.shape == (3, CAPACITY, K, H)
    for b, n in enumerate(kv_lens):
        for j in range(CAPACITY):
            want = k_pages[table[b, j // PAGE], j % PAGE] if j < n else 0.0
            np.testing.assert_array_equal(out[b, j], want)


def test_nan_in_unused_slots_never_reaches_the_output():
    """Slots past kv_lens (stale or uninitialised pages) may hold anything."""
    rng = np.random.default_rng(4)
    k_pages, v_pages = _pool(rng)
    kv_lens = np.array([6], np.int32)
    table = np.array([[3, 8, 0, 0, 0]], np.int32)
    k_pages[8, 2:] = np.nan
    v_pages[8, 2:] = np.nan
    k_pages[0] = np.inf
    q = rng.standard_normal((1, 2, 2, H)).astype(np.float32)
    out = paged_reference_attention(validate_paged_attention(q, k_pages, v_pages, table, kv_lens))
    assert np.all(np.isfinite(np.asarray(out)))


def test_normal_form():
    rng = np.random.default_rng(5)
    k_pages, v_pages = _pool(rng)
    q = np.zeros((2, 3, 6, H), np.float32)
    kv_lens = np.array([3, 7], np.int32)
    r = validate_paged_attention(
        q, k_pages, v_pages, _table(rng, kv_lens), kv_lens, sliding_window=5,
        softmax_sinks=np.zeros((6, 3), np.float32),
    )  # fmt: skip
    assert isinstance(r, PagedAttentionRequest)
    assert (r.batch, r.num_q_rows, r.heads, r.kv_heads, r.head_dim) == (2, 3, 6, K, H)
    assert (r.page_size, r.pages_per_seq, r.num_pages, r.capacity) == (PAGE, COLS, P, CAPACITY)
    assert r.sliding_window == (5, 5) and r.softmax_scale == H**-0.5 and r.cu_q_lens is None
    assert r.softmax_sinks.shape == (6,)
    np.testing.assert_allclose(r.softmax_sinks, fold_sinks(np.zeros((6, 3), np.float32)))
    assert r.features() == {"sliding_window", "softmax_sinks"}


def _args(**changes):
    rng = np.random.default_rng(6)
    k_pages, v_pages = _pool(rng)
    args = {
        "q": np.zeros((2, 3, 4, H), np.float32),
        "k_pages": k_pages,
        "v_pages": v_pages,
        "page_table": np.zeros((2, COLS), np.int32),
        "kv_lens": np.array([3, 7], np.int32),
    }
    return {**args, **changes}


BAD = [
    ({"page_table": np.zeros((2, COLS), np.float32)}, TypeError, r"page_table must have an integer dtype"),
    ({"page_table": np.zeros((2, COLS), np.int64)}, TypeError, r"page_table must be int32, got page_table.dtype=int64"),
    ({"page_table": np.zeros((3, COLS), np.int32)}, ValueError, r"page_table must have shape \[B, pages_per_seq\]=\(2, 5\)"),
    ({"page_table": np.zeros((2,), np.int32)}, ValueError, r"page_table must be rank 2"),
    ({"page_table": [[0] * COLS] * 2}, TypeError, r"page_table must be an integer jax or NumPy array"),
    ({"kv_lens": np.array([3, 7], np.int64)}, TypeError, r"kv_lens must be int32"),
    ({"kv_lens": np.array([3.0, 7.0])}, TypeError, r"kv_lens must have an integer dtype"),
    ({"kv_lens": np.array([3, 7, 1], np.int32)}, ValueError, r"kv_lens must have shape \[B\]=\(2,\), got kv_lens.shape=\(3,\)"),
    ({"kv_lens": np.array([3, CAPACITY + 1], np.int32)}, ValueError, r"kv_lens must be in \[0, pages_per_seq \* page_size = 20\], got kv_lens\[1\]=21"),
    ({"kv_lens": np.array([-1, 2], np.int32)}, ValueError, r"kv_lens must be in .* got kv_lens\[0\]=-1"),
    ({"page_table": np.full((2, COLS), P, np.int32)}, ValueError, r"page_table\[0, 0\]=11 is not a page of the pool \[0, 11\)"),
    ({"k_pages": np.zeros((P, PAGE, 3, H), np.float32), "v_pages": np.zeros((P, PAGE, 3, H), np.float32)}, ValueError, r"q heads=4 must be a multiple of the pages' kv heads=3"),
    ({"k_pages": np.zeros((P, PAGE, K, H + 1), np.float32), "v_pages": np.zeros((P, PAGE, K, H + 1), np.float32)}, ValueError, r"k_pages must have q's head_dim 8"),
    ({"v_pages": np.zeros((P, PAGE, K, H + 1), np.float32)}, ValueError, r"v_pages must have k_pages' shape"),
    ({"k_pages": np.zeros((P, PAGE, K), np.float32)}, ValueError, r"k_pages must be rank 4 \[P, page_size, K, H\]"),
    ({"k_pages": np.zeros((P, PAGE, K, H), np.float16), "v_pages": np.zeros((P, PAGE, K, H), np.float16)}, TypeError, r"q, k_pages and v_pages must share one dtype"),
    ({"k_pages": np.zeros((P, 0, K, H), np.float32), "v_pages": np.zeros((P, 0, K, H), np.float32)}, ValueError, r"page_size > 0"),
    ({"q": np.zeros((2, 4, H), np.float32)}, ValueError, r"q must be rank 4 \[B, T, N, H\], got q.shape=\(2, 4, 8\)"),
    ({"q": np.zeros((2, 3, 4, H), np.int32)}, TypeError, r"q must have a floating dtype"),
    ({"softmax_scale": -1.0}, ValueError, r"softmax_scale must be a finite number > 0"),
    ({"logits_soft_cap": 0.0}, ValueError, r"logits_soft_cap must be a finite number > 0"),
    ({"sliding_window": (1, 2, 3)}, ValueError, r"sliding_window must be an int or \(left, right\)"),
    ({"softmax_sinks": np.zeros((3,), np.float32)}, ValueError, r"softmax_sinks must have shape \[N\]=\(4,\)"),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "error", "match"), BAD)
def test_bad_input_names_the_argument(changes, error, match, no_shape_checks):
    with pytest.raises(error, match=match):
        validate_paged_attention(**_args(**changes))


RAGGED_BAD = [
    ({"cu_q_lens": np.array([0, 2, 4], np.int64)}, TypeError, r"cu_q_lens must be int32"),
    ({"cu_q_lens": np.array([0, 5], np.int32)}, ValueError, r"page_table must have shape \[B, pages_per_seq\]=\(1, 5\)"),
    ({"cu_q_lens": np.array([1, 2, 5], np.int32)}, ValueError, r"cu_q_lens must start at 0"),
    ({"cu_q_lens": np.array([0, 3, 2], np.int32)}, ValueError, r"cu_q_lens must be non-decreasing"),
    ({"cu_q_lens": np.array([0, 2, 4], np.int32)}, ValueError, r"cu_q_lens must end at total_q=5 \(q.shape\[0\]\), got cu_q_lens\[-1\]=4"),
    ({"cu_q_lens": np.array([0, 2, 7], np.int32)}, ValueError, r"cu_q_lens ends at 7, past the 5"),
    ({"q": np.zeros((1, 5, 4, H), np.float32)}, ValueError, r"q must be rank 3 \[total_q, N, H\] \(with cu_q_lens\)"),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "error", "match"), RAGGED_BAD)
def test_ragged_bad_input_names_the_argument(changes, error, match, no_shape_checks):
    args = _args(q=np.zeros((5, 4, H), np.float32), cu_q_lens=np.array([0, 2, 5], np.int32))
    validate_paged_attention(**args)  # the unchanged call is valid
    with pytest.raises(error, match=match):
        validate_paged_attention(**{**args, **changes})


def test_traced_values_are_not_checked():
    """Inside jit the values are unknown: shapes and dtypes are still checked, values not."""
    args = _args()

    @jax.jit
    def run(kv_lens, page_table):
        request = validate_paged_attention(**{**args, "kv_lens": kv_lens, "page_table": page_table})
        return paged_reference_attention(request)

    too_long = np.array([3, CAPACITY + 9], np.int32)
    assert run(too_long, np.full((2, COLS), 10**6, np.int32)).shape == (2, 3, 4, H)
    with pytest.raises(ValueError, match=r"kv_lens must have shape \[B\]=\(2,\)"):
        run(np.array([3, 7, 1], np.int32), args["page_table"])


def test_paged_visibility_is_bottom_right():
    first = np.array([-2, 0, 5], np.int32)
    mask = np.asarray(paged_visibility(first, 3, 9, sliding_window=(2, 7)))
    assert mask.shape == (3, 1, 3, 9)
    for r, f in enumerate(first):
        for t in range(3):
            pos = f + t
            want = [(pos - 2 <= j <= pos) for j in range(9)]
            assert mask[r, 0, t].tolist() == want, (r, t)


def test_ragged_rows():
    kv_lens = np.array([5, 0, 2], np.int32)
    cu = np.array([0, 3, 3, 6], np.int32)
    args = _args(q=np.zeros((6, 4, H), np.float32), kv_lens=kv_lens, cu_q_lens=cu)
    args["page_table"] = np.zeros((3, COLS), np.int32)
    seq, pos = ragged_rows(validate_paged_attention(**args))
    assert seq.tolist() == [0, 0, 0, 2, 2, 2]
    assert pos.tolist() == [2, 3, 4, -1, 0, 1]
