"""Property tests: every function against a brute-force Python reference.

Shapes are fixed per test (values vary) so each jitted function compiles once and the
default run stays short; the wide versions are marked slow.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import ejk_sequtils as es

NUM_SEQS = 6  # sequences per drawn cu_seqlens (some of them empty)
TOTAL = 32  # static token count: at least the sum of lengths, the rest is padding
CHUNK = 3
TOTAL_CHUNKS = 12
FAST = settings(max_examples=25, deadline=None)

lens_strategy = st.lists(st.integers(0, 5), min_size=NUM_SEQS, max_size=NUM_SEQS)
# Ids >= 0 are segments (0 included), every negative id is padding.
segment_rows = st.lists(
    st.lists(st.integers(-2, 3), min_size=16, max_size=16), min_size=2, max_size=2
)


def _cu(lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _ref_tokens(lens, total):
    """Per token: (sequence id, position id), padding (-1, 0)."""
    out = [(s, p) for s, n in enumerate(lens) for p in range(n)]
    out += [(-1, 0)] * (total - len(out))
    return out[:total]


def _ref_runs(row):
    """Per token of one row: position within its run of one id >= 0 (0 for padding)."""
    positions, prev, run_start = [], None, 0
    for i, v in enumerate(row):
        if v >= 0 and v != prev:
            run_start = i
        positions.append(i - run_start if v >= 0 else 0)
        prev = v if v >= 0 else None
    return positions


token_fns = jax.jit(
    lambda cu: (
        es.prepare_sequence_ids(cu, total_length=TOTAL),
        es.prepare_position_ids(cu, total_length=TOTAL),
        es.prepare_token_indices(cu, total_length=TOTAL),
        es.cu_seqlens_to_segment_ids(cu, total_length=TOTAL),
        es.prepare_lens(cu),
    )
)
chunk_fns = jax.jit(
    lambda cu: (
        es.prepare_chunk_offsets(cu, CHUNK),
        es.prepare_chunk_indices(cu, CHUNK, total_chunks=TOTAL_CHUNKS),
    )
)


@FAST
@given(lens_strategy)
def test_per_token_views_match_brute_force(lens):
    seq, pos, idx, seg, got_lens = token_fns(_cu(lens))
    ref = _ref_tokens(lens, TOTAL)
    assert np.asarray(seq).tolist() == [s for s, _ in ref]
    assert np.asarray(pos).tolist() == [p for _, p in ref]
    assert np.asarray(idx).tolist() == [list(r) for r in ref]
    assert np.asarray(seg).tolist() == [s for s, _ in ref]  # padding -1, like seq
    assert np.asarray(got_lens).tolist() == lens


@FAST
@given(lens_strategy)
def test_chunk_views_match_brute_force(lens):
    offsets, indices = chunk_fns(_cu(lens))
    counts = [math.ceil(n / CHUNK) for n in lens]
    assert np.asarray(offsets).tolist() == [0, *np.cumsum(counts).tolist()]
    ref = [[s, c] for s, n in enumerate(counts) for c in range(n)]
    ref += [[-1, 0]] * (TOTAL_CHUNKS - len(ref))
    assert np.asarray(indices).tolist() == ref[:TOTAL_CHUNKS]


@FAST
@given(st.integers(-50, 50), st.integers(1, 9))
def test_cdiv_matches_ceil(a, b):
    assert es.cdiv(a, b) == math.ceil(a / b)
    assert int(es.cdiv(jnp.int32(a), b)) == math.ceil(a / b)


segments_to_cu = jax.jit(lambda s: es.segment_ids_to_cu_seqlens(s, num_seqs=NUM_SEQS))


@FAST
@given(
    st.lists(st.integers(1, 5), min_size=NUM_SEQS, max_size=NUM_SEQS),
    st.permutations(range(NUM_SEQS)),
    st.integers(-3, -1),
)
def test_segment_ids_to_cu_seqlens_inverts_cu_seqlens(lens, ids, pad):
    # Non-empty sequences with arbitrary distinct ids >= 0 (0 among them), trailing padding.
    segment_ids = np.full(TOTAL, pad, np.int32)
    cu = _cu(lens)
    for s in range(NUM_SEQS):
        segment_ids[cu[s] : cu[s + 1]] = ids[s]
    assert np.asarray(segments_to_cu(segment_ids)).tolist() == cu.tolist()
    assert np.asarray(es.segment_ids_to_cu_seqlens(segment_ids)).tolist() == cu.tolist()


position_fns = jax.jit(
    lambda s: (
        es.segment_ids_to_position_ids(s),
        es.segment_ids_to_mask(s),
        es.mask_to_segment_ids(es.segment_ids_to_mask(s)),
    )
)


@FAST
@given(segment_rows)
def test_segment_id_views_match_brute_force(rows):
    segment_ids = np.array(rows, np.int32)
    positions, mask, (q_ids, kv_ids) = position_fns(segment_ids)
    assert np.asarray(positions).tolist() == [_ref_runs(r) for r in rows]
    ref_mask = [[[a == b and a >= 0 for b in r] for a in r] for r in rows]
    assert np.asarray(mask).tolist() == ref_mask
    # Rebuilding from the recovered ids gives the same mask, and the ids are a relabelling.
    np.testing.assert_array_equal(es.segment_ids_to_mask(q_ids), mask)
    np.testing.assert_array_equal(q_ids, kv_ids)
    for r, q in zip(rows, np.asarray(q_ids).tolist(), strict=True):
        pairs = {(a, b) for a, b in zip(r, q, strict=True) if a >= 0}
        assert len(pairs) == len({a for a, _ in pairs}) == len({b for _, b in pairs})
        # Recovered ids are 0, 1, ... in order of first appearance; padding is -1.
        firsts = list(dict.fromkeys(a for a in r if a >= 0))
        assert all(b == firsts.index(a) for a, b in pairs)
        assert all(b == -1 for a, b in zip(r, q, strict=True) if a < 0)


position_to_segment = jax.jit(es.position_ids_to_segment_ids)


@FAST
@given(st.lists(st.lists(st.integers(-1, 3), min_size=16, max_size=16), min_size=2, max_size=2))
def test_position_ids_to_segment_ids_matches_brute_force(rows):
    got = np.asarray(position_to_segment(np.array(rows, np.int32))).tolist()
    for row, out in zip(rows, got, strict=True):
        ref, current, prev_valid = [], -1, False
        for p in row:
            valid = p >= 0
            if valid and (p == 0 or not prev_valid):
                current += 1
            ref.append(current if valid else -1)
            prev_valid = valid
        assert out == ref


def _ref_representable(mask: np.ndarray) -> bool:
    """Distinct non-empty row patterns must be pairwise disjoint."""
    patterns = {tuple(r) for r in mask.tolist() if any(r)}
    seen = np.zeros(mask.shape[1], int)
    for p in patterns:
        seen += np.array(p, int)
    return bool((seen <= 1).all())


masks = st.lists(st.lists(st.booleans(), min_size=7, max_size=7), min_size=5, max_size=5)
representable = jax.jit(es.is_segment_representable)


@FAST
@given(st.lists(masks, min_size=3, max_size=3))
def test_is_segment_representable_matches_brute_force(batch):
    mask = np.array(batch, bool)  # [3, 5, 7]
    assert np.asarray(representable(mask)).tolist() == [_ref_representable(m) for m in mask]


cross_fns = jax.jit(
    lambda q, k: (
        es.segment_ids_to_mask((q, k)),
        es.mask_to_segment_ids(es.segment_ids_to_mask((q, k))),
        es.mask_to_segment_ids(es.segment_ids_to_mask((q, k)), padding_id=-4),
    )
)


@FAST
@given(
    st.lists(st.integers(-2, 3), min_size=5, max_size=5),
    st.lists(st.integers(-2, 3), min_size=7, max_size=7),
)
def test_cross_masks_round_trip(q, k):
    mask, (q_ids, kv_ids), (q_other, kv_other) = cross_fns(
        np.array([q], np.int32), np.array([k], np.int32)
    )
    assert np.asarray(mask)[0].tolist() == [[a == b and a >= 0 for b in k] for a in q]
    rebuilt = es.segment_ids_to_mask((q_ids, kv_ids))
    np.testing.assert_array_equal(rebuilt, mask)
    # -1 (the default padding_id) marks exactly the queries that see no key and the keys
    # no query sees; every other id is >= 0.
    np.testing.assert_array_equal(np.asarray(q_ids)[0] == -1, ~np.asarray(mask)[0].any(1))
    np.testing.assert_array_equal(np.asarray(kv_ids)[0] == -1, ~np.asarray(mask)[0].any(0))
    assert np.asarray(q_ids).min(initial=-1) >= -1 and np.asarray(kv_ids).min(initial=-1) >= -1
    # Another padding_id changes the padding entries only.
    np.testing.assert_array_equal(np.where(q_ids == -1, -4, q_ids), q_other)
    np.testing.assert_array_equal(np.where(kv_ids == -1, -4, kv_ids), kv_other)


lens_from_mask = jax.jit(
    lambda m: (es.prepare_lens_from_mask(m), es.prepare_cu_seqlens_from_mask(m))
)


@FAST
@given(masks)
def test_lengths_from_mask_match_brute_force(rows):
    lens, cu = lens_from_mask(np.array(rows, bool))
    assert np.asarray(lens).tolist() == [sum(r) for r in rows]
    assert np.asarray(cu).tolist() == [0, *np.cumsum([sum(r) for r in rows]).tolist()]


finite_or_masked = st.one_of(st.floats(-1e4, 1e4, width=32), st.just(-np.inf))
lse_rows = jax.jit(lambda x: es.log_sum_exp(x, axis=1))


@FAST
@given(st.lists(st.lists(finite_or_masked, min_size=6, max_size=6), min_size=4, max_size=4))
def test_log_sum_exp_matches_float64(rows):
    got = np.asarray(lse_rows(np.array(rows, np.float32)))
    for row, value in zip(rows, got, strict=True):
        finite = [v for v in row if v != -np.inf]
        if not finite:
            assert value == -np.inf
            continue
        m = max(finite)
        ref = m + math.log(sum(math.exp(v - m) for v in finite))
        assert math.isclose(value, ref, rel_tol=1e-5, abs_tol=1e-4)


# Subnormals are left out: XLA on CPU flushes them to zero, so their sign is lost.
normal_floats = st.floats(-1e3, 1e3, width=32, allow_subnormal=False)
divide = jax.jit(lambda n, d: es.safe_divide(n, d, 1e-3))


@FAST
@given(
    st.lists(
        st.tuples(normal_floats, normal_floats),
        min_size=8,
        max_size=8,
    )
)
def test_safe_divide_matches_brute_force(pairs):
    num, den = (np.array(v, np.float32) for v in zip(*pairs, strict=True))
    got = np.asarray(divide(num, den))
    for n, d, value in zip(num.tolist(), den.tolist(), got.tolist(), strict=True):
        clamped = d if abs(d) >= 1e-3 else math.copysign(1e-3, d) if d != 0 else 1e-3
        assert math.isclose(value, n / np.float32(clamped), rel_tol=1e-5, abs_tol=1e-30)


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 9), st.integers(1, 4), st.integers(-2, 1))
def test_chunk_round_trip(length, chunk_size, axis):
    x = (
        np.arange(2 * 10).reshape(2, 10)[:, :length]
        if axis in (1, -1)
        else np.arange(10 * 2).reshape(10, 2)[:length]
    )
    chunks = np.asarray(es.chunk_array(x, chunk_size, axis=axis, pad_value=-1))
    a = axis % 2
    assert chunks.shape[a : a + 2] == (math.ceil(length / chunk_size), chunk_size)
    flat = np.moveaxis(chunks, (a, a + 1), (0, 1)).reshape(-1, *np.delete(chunks.shape, [a, a + 1]))
    assert (flat[length:] == -1).all()
    np.testing.assert_array_equal(es.unchunk_array(chunks, length, axis=axis), x)
