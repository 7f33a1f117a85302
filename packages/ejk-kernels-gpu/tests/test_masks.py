"""The block tables that drive block skipping, checked against the reference visibility.

Every visible (query, key) pair must lie in a visited block; blocks listed as fully
visible must be visible everywhere; and causal/window/packed tables must skip blocks.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_gpu import FlashBackwardConfig, FlashConfig
from ejk_kernels_gpu.flash import _tables
from ejk_kernels_gpu.flash._select import CallOptions
from ejk_sequtils import visibility_mask

CU_Q = [0, 9, 9, 30, 38]
CU_K = [0, 5, 12, 12, 33]


def _visited(table, length, block, inner, other_len):
    """bool [length, other_len]: pairs a program visits, and pairs it treats as unmasked."""
    seen = np.zeros((length, other_len), bool)
    full = np.zeros((length, other_len), bool)
    for m, (lo, flo, fhi, hi) in enumerate(np.asarray(table)):
        rows = slice(m * block, min((m + 1) * block, length))
        for start in range(int(lo), int(hi), inner):
            seen[rows, start : start + inner] = True
        for start in range(int(flo), int(fhi), inner):
            full[rows, start : start + inner] = True
    return seen, full


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(causal=True),
        dict(sliding_window=(5, 2)),
        dict(causal=True, sliding_window=(7, 7)),
        dict(packed=True),
        dict(packed=True, causal=True, sliding_window=(3, 1)),
    ],
)
def test_block_tables_cover_every_visible_pair(kw):
    kw = dict(kw)
    packed = kw.pop("packed", False)
    q_len, kv_len = (41, 37) if packed else (45, 52)
    window = kw.get("sliding_window")
    cu = (jnp.asarray(CU_Q), jnp.asarray(CU_K)) if packed else None
    vis = np.asarray(
        visibility_mask(
            q_len,
            kv_len,
            **kw,
            cu_seqlens_q=None if cu is None else cu[0],
            cu_seqlens_k=None if cu is None else cu[1],
        )
    )[0, 0]
    packing = None if cu is None else _tables.Packing(cu[0], cu[1], q_len, kv_len)
    causal = kw.get("causal", False)
    skipped = 0
    for of_queries, block, inner in ((True, 16, 8), (False, 8, 16)):
        lo, hi = _tables.ranges(q_len, kv_len, causal, window, packing, of_queries=of_queries)
        table = _tables.block_table(lo, hi, block, inner)
        want = vis if of_queries else vis.T
        seen, full = _visited(table, *want.shape[:1], block, inner, want.shape[1])
        assert not np.any(want & ~seen), "a visible pair is skipped"
        assert not np.any(full & ~want), "a block without mask hides a masked pair"
        skipped += int(np.sum(~seen[::block, ::inner]))
    if kw or packed:
        assert skipped > 0, "no block skipped"


def _documents(rng, length, repeat):
    """Sorted runs of ids from 0, some padding (-1) at the end; ``repeat``: an id comes back
    in a later, separate run (so its span holds other documents)."""
    cuts = np.sort(rng.choice(np.arange(1, length - 3), size=4, replace=False))
    ids = np.zeros(length, np.int32)
    for d, cut in enumerate(cuts):
        ids[cut:] = d + 1
    if repeat:
        ids[cuts[2] : cuts[3]] = 0
    ids[length - 3 :] = -1
    return ids


def _tables_with_ids(q_ids, kv_ids, packing=None, *, causal=False, sliding_window=None):
    """The (fwd, dq, dk/dv) tables of segment ids ``q_ids``, ``kv_ids`` ([B, T], [B, S])
    (and ``packing``) under causal / ``sliding_window``: forward tiles of 32 rows by 16
    keys, backward 16 resident keys by 32 query rows (the dq kernel 16 query rows by 32 keys)."""
    q_len, kv_len = q_ids.shape[1], kv_ids.shape[1]
    window = sliding_window
    opts = CallOptions(
        scale=1.0, causal=causal, window=window, soft_cap=0.0, dropout_rate=0.0, has_seg=True,
        varlen=packing is not None, fwd_cfg=FlashConfig(block_q=32, block_k=16),
        bwd_cfg=FlashBackwardConfig(block_keys=16, block_queries=32),
    )  # fmt: skip
    rows = _tables.ranges(q_len, kv_len, causal, window, packing, of_queries=True)
    cols = _tables.ranges(q_len, kv_len, causal, window, packing, of_queries=False)
    ids = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
    *tables, _ = _tables.range_tables(opts, rows, cols, ids, head_dim=64)
    return tables


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(causal=True),
        dict(causal=True, sliding_window=(96, 0)),
        dict(packed=True, causal=True),
    ],
)
@pytest.mark.parametrize("repeat", [False, True])
def test_segment_tables_skip_other_documents_and_cover_every_visible_pair(kw, repeat):
    kw = dict(kw)
    packed = kw.pop("packed", False)
    q_len, kv_len = (41, 37) if packed else (270, 284)
    rng = np.random.default_rng(3)
    batch = 3
    q_ids = np.stack([_documents(rng, q_len, repeat) for _ in range(batch)])
    kv_ids = np.stack([_documents(rng, kv_len, repeat) for _ in range(batch)])
    cu = (jnp.asarray(CU_Q), jnp.asarray(CU_K)) if packed else None
    vis = np.asarray(
        visibility_mask(
            q_len,
            kv_len,
            **kw,
            segment_ids=(jnp.asarray(q_ids), jnp.asarray(kv_ids)),
            cu_seqlens_q=None if cu is None else cu[0],
            cu_seqlens_k=None if cu is None else cu[1],
        )
    )[:, 0]
    packing = None if cu is None else _tables.Packing(cu[0], cu[1], q_len, kv_len)
    fwd, dq, dkdv = _tables_with_ids(q_ids, kv_ids, packing, **kw)
    skipped = full_pairs = 0
    for tables, of_queries, block, inner in ((fwd, True, 32, 16), (dq, True, 16, 32), (dkdv, False, 16, 32)):  # fmt: skip
        assert tables.shape[0] == batch
        for b in range(batch):
            want = vis[b] if of_queries else vis[b].T
            seen, full = _visited(tables[b], want.shape[0], block, inner, want.shape[1])
            assert not np.any(want & ~seen), "a visible pair is skipped"
            assert not np.any(full & ~want), "a block without mask hides a masked pair"
            skipped += int(np.sum(~seen[::block, ::inner]))
            full_pairs += int(np.sum(full))
    assert skipped > 0, "no block of another document skipped"
    if not (repeat or packed):
        assert full_pairs > 0, "no block inside one document runs unmasked"


def test_segment_block_table_of_ids_in_separate_runs():
    # Blocks of 2 rows against inner blocks of 3 keys (the last one short).
    ids = jnp.asarray([[0, 0, 1, 1, 2, -1, 3]], jnp.int32)
    other = jnp.asarray([[1, 1, 1, 0, 0, 0, 2, 2, 2, 0, 3]], jnp.int32)
    table = np.asarray(_tables.segment_block_table(ids, other, 2, 3))[0]
    np.testing.assert_array_equal(
        table,
        [
            [3, 3, 6, 11],  # id 0: keys 3-5 unmasked, then 0 again in the mixed last block
            # Id 1: the first inner block unmasked; the last one's ids span 0-3, so it is
            # visited with the mask (blocks are told apart by their range of ids).
            [0, 0, 3, 11],
            [6, 12, 12, 11],  # 2 and padding: a mixed row block is never unmasked
            [9, 12, 12, 11],  # id 3: only in the short last block (masked)
        ],
    )


@pytest.mark.parametrize("seed", range(6))
def test_segment_block_table_covers_every_meeting_pair(seed):
    rng = np.random.default_rng(seed)
    batch, length, other = 2, int(rng.integers(1, 40)), int(rng.integers(1, 40))
    ids = rng.integers(-2, 5, (batch, length)).astype(np.int32)
    other_ids = rng.integers(-2, 5, (batch, other)).astype(np.int32)
    if seed % 2:  # runs, as documents come
        ids, other_ids = np.sort(ids), np.sort(other_ids)
    block, inner = int(rng.integers(1, 6)), int(rng.integers(1, 6))
    tables = _tables.segment_block_table(jnp.asarray(ids), jnp.asarray(other_ids), block, inner)
    for b in range(batch):
        want = (ids[b][:, None] == other_ids[b][None, :]) & (ids[b][:, None] >= 0)
        seen, full = _visited(tables[b], length, block, inner, other)
        assert not np.any(want & ~seen), "a pair of one document is skipped"
        assert not np.any(full & ~want), "a block without mask hides a pair of two documents"
        for m, (lo, flo, fhi, hi) in enumerate(np.asarray(tables[b])):
            assert lo % inner == 0 and lo <= flo <= fhi and hi <= other, (m, lo, flo, fhi, hi)
            assert fhi <= -(-hi // inner) * inner, (m, hi, fhi)


@pytest.mark.parametrize("window", [None, (20, 0)])
@pytest.mark.parametrize("seed", range(4))
def test_causal_forward_blocks_after_the_unmasked_ones_hold_the_rows_one_id(window, seed):
    # The causal Gluon forward compares positions alone in the blocks after a tile's
    # unmasked range: the table may give a tile such a range only where every key after
    # it holds the one id of all the tile's rows.
    rng = np.random.default_rng(seed)
    length = 96
    lengths = rng.choice([16, 32, 48, 7, 23], size=12)
    ids = np.repeat(np.arange(12, dtype=np.int32), lengths)[:length]
    ids = np.pad(ids, (0, length - ids.shape[0]), constant_values=-1)
    if seed % 2:  # an id back in a later run; padding at the end
        ids[ids == ids[-20]] = ids[0]
        ids[-5:] = -1
    q_ids = np.stack([ids, np.roll(ids, 16)])
    kv_ids = np.stack([ids, np.roll(ids, 16 + 8 * seed)])  # cross ids in row 1
    fwd = np.asarray(_tables_with_ids(q_ids, kv_ids, causal=True, sliding_window=window)[0])
    for b, m in np.ndindex(fwd.shape[:2]):
        _, full_lo, full_hi, hi = fwd[b, m]
        if full_lo < full_hi < hi:
            held = np.concatenate([q_ids[b, m * 32 : (m + 1) * 32], kv_ids[b, full_hi:hi]])
            assert held.min() == held.max() >= 0, (b, m, fwd[b, m], held)


def test_documents_of_whole_tiles_keep_their_unmasked_blocks():
    ids = np.repeat(np.arange(2, dtype=np.int32), 64)[None]
    fwd = np.asarray(_tables_with_ids(ids, ids, causal=True)[0])[0]
    # Each document's second tile: the first 32 keys unmasked, its diagonal masked.
    np.testing.assert_array_equal(fwd[1::2], [[0, 0, 32, 64], [64, 64, 96, 128]])
    # Keys of another document in the diagonal block (cross ids): all masked.
    fwd = np.asarray(_tables_with_ids(ids, np.roll(ids, -8, axis=1), causal=True)[0])[0]
    assert (fwd[:, 1] == fwd[:, 2]).all(), fwd


@pytest.mark.parametrize("seed", range(4))
def test_fused_segment_table_gives_the_jnp_tables(seed, monkeypatch):
    # The one-kernel table (run by Triton's interpreter here) against `_tables`' definition:
    # random, sorted, padded and cross ids, odd block sizes, masks' tables of causal and
    # window calls, and chunks of a few inner blocks so the kernel walks several.
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(_tables, "CHUNK_ELEMENTS", int(rng.choice([4, 16, 4096])))
    batch, length, other = 2, int(rng.integers(1, 70)), int(rng.integers(1, 70))
    ids = rng.integers(-2, 5, (batch, length)).astype(np.int32)
    other_ids = rng.integers(-2, 5, (batch, other)).astype(np.int32)
    if seed % 2:  # runs, as documents come
        ids, other_ids = np.sort(ids), np.sort(other_ids)
    if seed % 4 == 3:
        other_ids[:, : other // 2] = ids[:, :1]  # one long run of the block's id
    block, inner = int(rng.choice([1, 3, 4, 16])), int(rng.choice([1, 5, 8, 16]))
    window = None if seed % 3 else (int(rng.integers(0, 30)), int(rng.integers(0, 5)))
    causal = seed % 3 != 1
    lo, hi = _tables.ranges(length, other, causal, window, None, of_queries=True)
    table = _tables.block_table(lo, hi, block, inner)
    _assert_fused_table(table, table, jnp.asarray(ids), jnp.asarray(other_ids), block, inner)


def _assert_fused_table(masks, table, ids, other_ids, block, inner):
    """`fused_segment_table` of ``masks`` (a masks' table or `PositionRanges`) gives
    `_intersect` of ``table`` (the masks' table in jnp) and `segment_block_table`, with and
    without the causal forward's rule, and writes the counter's zero."""
    for after_full in (False, True):
        want = _tables._intersect(
            table,
            _tables.segment_block_table(ids, other_ids, block, inner),
            inner,
            positions_after_full=after_full,
        )
        got, counter = _tables.fused_segment_table(
            masks, ids, other_ids, block, inner, positions_after_full=after_full
        )
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(after_full))
        np.testing.assert_array_equal(np.asarray(counter), [0])


def _chunk_positions(rng, length, chunks):
    """Positions of ``chunks`` equal chunks of ``length`` indices at random increasing
    offsets (gaps between chunks, or none)."""
    size = length // chunks
    gaps = rng.integers(0, 3 * size + 2, chunks) * rng.integers(0, 2, chunks)
    starts = np.cumsum(gaps) + np.arange(chunks) * size - int(rng.integers(0, 40))
    return jnp.asarray((starts[:, None] + np.arange(size)).reshape(-1), jnp.int32)


@pytest.mark.parametrize("seed", range(8))
def test_position_ranges_in_the_table_kernel_give_the_jnp_tables(seed, monkeypatch):
    # Context parallelism's ranges (positions at offsets, the other axis in chunks: a
    # zigzag device's rows against keys, and keys against those rows), built by the table
    # kernel from the positions, against `PositionRanges.lo_hi` through `block_table`;
    # with one document (the masks' entries as they are) or a few.
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(_tables, "CHUNK_ELEMENTS", int(rng.choice([4, 4096])))
    chunks = int(rng.choice([1, 2, 3]))
    length, other = int(rng.integers(1, 40)), chunks * int(rng.integers(1, 25))
    of_queries = bool(seed % 2)
    pos = _chunk_positions(rng, length, 1)
    other_pos = _chunk_positions(rng, other, chunks)
    causal = seed % 3 != 2
    window = None if seed % 3 == 0 else (int(rng.integers(0, 30)), int(rng.integers(0, 9)))
    ranges = _tables.PositionRanges.of(
        pos, other_pos, chunks, causal, window, of_queries=of_queries
    )
    block, inner = int(rng.choice([1, 3, 16])), int(rng.choice([1, 5, 16]))
    ids = np.sort(rng.integers(-1, 3, (2, length)))
    other_ids = np.sort(rng.integers(-1, 3, (2, other)))
    if seed % 4 < 2:
        ids, other_ids = np.zeros_like(ids), np.zeros_like(other_ids)
    ids, other_ids = jnp.asarray(ids, jnp.int32), jnp.asarray(other_ids, jnp.int32)
    table = _tables.mask_table(ranges, block, inner)
    _assert_fused_table(ranges, table, ids, other_ids, block, inner)


def test_position_ranges_refuse_uneven_chunks_and_negative_bounds():
    pos = jnp.arange(4, dtype=jnp.int32)
    with pytest.raises(ValueError, match="5 indices in 2 chunks"):
        _tables.PositionRanges(pos, jnp.arange(5, dtype=jnp.int32), 2, None, 0)
    with pytest.raises(ValueError, match="upper is >= 0 or None, got -1"):
        _tables.PositionRanges(pos, pos, 1, -1, None)


@pytest.mark.parametrize("seed", range(4))
def test_position_ranges_hold_exactly_the_pairs_that_positions_allow(seed):
    # `PositionRanges.lo_hi` against the definition pair by pair: index i sees index j of
    # the other axis iff their positions pass causal and the window.
    rng = np.random.default_rng(seed)
    chunks = int(rng.choice([1, 2]))
    pos = _chunk_positions(rng, int(rng.integers(1, 30)), 1)
    other_pos = _chunk_positions(rng, chunks * int(rng.integers(1, 20)), chunks)
    window = None if seed % 2 else (int(rng.integers(0, 20)), int(rng.integers(0, 6)))
    for of_queries in (True, False):
        ranges = _tables.PositionRanges.of(
            pos, other_pos, chunks, True, window, of_queries=of_queries
        )
        lo, hi = (np.asarray(x) for x in ranges.lo_hi())
        p, o = np.asarray(pos)[:, None], np.asarray(other_pos)[None, :]
        q_at, k_at = (p, o) if of_queries else (o, p)
        sees = k_at <= q_at
        if window is not None:
            sees &= (k_at >= q_at - window[0]) & (k_at <= q_at + window[1])
        idx = np.arange(o.shape[1])[None, :]
        np.testing.assert_array_equal(sees, (idx >= lo[:, None]) & (idx < hi[:, None]))


@pytest.mark.parametrize("window", [None, (40, 0)])
def test_range_tables_fused_or_not_agree(window):
    # Documents of random lengths (one id back in a later run), documents of whole tiles
    # (the forward's unmasked ranges reach the diagonal), and cross ids.
    rng = np.random.default_rng(5)
    tiles = np.repeat(np.arange(2, dtype=np.int32), 64)
    q_ids = np.stack([_documents(rng, 128, True), tiles, tiles])
    kv_ids = np.stack([_documents(rng, 128, False), tiles, np.roll(tiles, 8)])
    opts = CallOptions(
        scale=1.0, causal=True, window=window, soft_cap=0.0, dropout_rate=0.0, has_seg=True,
        varlen=False, fwd_cfg=FlashConfig(block_q=32, block_k=16),
        bwd_cfg=FlashBackwardConfig(block_keys=16, block_queries=32),
    )  # fmt: skip
    rows = _tables.ranges(128, 128, True, window, None, of_queries=True)
    cols = _tables.ranges(128, 128, True, window, None, of_queries=False)
    ids = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
    *fused, counter = _tables.range_tables(opts, rows, cols, ids, head_dim=64, fused=True)
    *plain, none = _tables.range_tables(opts, rows, cols, ids, head_dim=64, fused=False)
    for got, want in zip(fused, plain, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(counter), [0])
    assert none is None
