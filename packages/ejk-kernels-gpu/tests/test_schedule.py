"""The Gluon kernels' program order (`flash._schedule.tile_order`): a permutation of the grid's
tiles, heaviest first within blocks of (batch, head) groups, and a shorter schedule than
the grid's own order where programs' work is uneven; the steps it weighs, from block
tables and from causal alone, are the blocks the kernels walk. Also the persistent
forward's own order with its last groups rows-major (`flash._constexprs.rows_major`)."""

from __future__ import annotations

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_gpu.flash._schedule import (
    Walk,
    causal_steps,
    forward_order,
    launch_order,
    table_steps,
    tile_order,
)


def _documents_table(key_blocks, busy_documents, doc_blocks=16, rows=64):
    """A dk/dv table ``[key blocks, 4]`` of causal documents of ``doc_blocks`` key blocks:
    key block j of a document sees the query rows from its own to the document's end;
    documents not in ``busy_documents`` have no rows (another device's, as in context
    parallelism's all-gather call). Query rows in steps of ``rows``; 128 keys a block."""
    table = np.zeros((key_blocks, 4), np.int32)
    for j in range(key_blocks):
        doc = j // doc_blocks
        if doc in busy_documents:
            end = (doc + 1) * doc_blocks * 128
            table[j] = (j * 128, j * 128, j * 128, end)
    return table


def _makespan(order, steps, sms=132):
    """When the last program ends if programs start in ``order`` on ``sms`` processors
    (each takes its steps plus half a step)."""
    free = [0.0] * sms
    for tile in order:
        heapq.heappush(free, heapq.heappop(free) + steps[tile] + 0.5)
    return max(free)


@pytest.mark.parametrize("batch_rows", [False, True])
def test_the_order_is_a_permutation_heaviest_first_within_blocks(batch_rows):
    rng = np.random.default_rng(0)
    groups, key_blocks = 8, 40
    if batch_rows:  # per batch row (segment ids): two rows of four kv heads
        table = np.stack([_documents_table(key_blocks, set(rng.choice(3, 2))) for _ in range(2)])
    else:
        table = _documents_table(key_blocks, {0, 2})
    order = tile_order(table_steps(table, 64), groups, multiprocessors=16)
    assert isinstance(order, np.ndarray) and order.dtype == np.int32
    np.testing.assert_array_equal(np.sort(order), np.arange(groups * key_blocks))
    steps = np.broadcast_to(
        np.ceil((table[..., 3] - table[..., 0]) / 64).reshape(-1, 1, key_blocks),
        (table.shape[0] if batch_rows else 1, groups // (2 if batch_rows else 1), key_blocks),
    ).reshape(-1)
    position = np.arange(steps.size)
    # Some power-of-two block of groups; within a block heaviest first, ties in grid order.
    candidates = [
        np.lexsort((position, -steps, position // key_blocks // block)) for block in (1, 2, 4, 8)
    ]
    assert any(np.array_equal(order, c) for c in candidates), order


def test_the_order_ends_with_light_programs_where_the_grid_order_does_not():
    # One device's all-gather call at n = 4 (T = 32768, 16 documents of 2048; its rows in
    # documents 0, 1, 14, 15), eight kv heads: in the grid's order the last head's heaviest
    # programs start last.
    table = _documents_table(256, {0, 1, 14, 15})
    groups = 8
    steps = np.tile(np.ceil((table[:, 3] - table[:, 0]) / 64) * 4, groups)  # four q heads
    ideal = (steps + 0.5).sum() / 132
    grid = _makespan(np.arange(steps.size), steps) / ideal
    ordered = _makespan(tile_order(table_steps(table, 64), groups, 132), steps) / ideal
    assert grid > 1.2 and ordered < 1.05, (grid, ordered)


def test_a_context_forward_ends_with_light_tiles():
    # One device's all-gather forward at n = 4, T = 32768, causal (zigzag: its query chunks
    # 0 and 7 of 4096 rows against the whole sequence), 32 heads: in the grid's order each
    # head's tiles run heaviest first but the heads in order, so the last head's heaviest
    # start late.
    rows = np.concatenate([np.arange(4096), 7 * 4096 + np.arange(4096)])
    table = np.zeros((64, 4), np.int32)
    table[:, 3] = rows[127::128] + 1  # keys [0, last row]
    steps = table_steps(table, 128)
    heads = 32
    work = np.tile(steps, heads)
    ideal = (work + 0.5).sum() / 132
    per_head = np.arange(64)[::-1]  # the earlier order: each head's tiles heaviest first
    before = (np.arange(heads)[:, None] * 64 + per_head[None, :]).reshape(-1)
    assert _makespan(before, work) / ideal > 1.03
    assert _makespan(tile_order(steps, heads, 132), work) / ideal < 1.01


def test_traced_tables_give_the_same_order():
    rng = np.random.default_rng(1)
    table = np.stack([_documents_table(24, set(rng.choice(2, 1)), doc_blocks=8) for _ in range(3)])
    want = tile_order(table_steps(table, 64), 6, 4)
    got = jax.jit(lambda t: tile_order(table_steps(t, 64), 6, 4))(jnp.asarray(table))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_steps_are_the_blocks_the_kernels_walk():
    # Table entries [lo, full_lo, full_hi, hi): blocks lo // b to cdiv(hi, b); none if empty.
    table = np.array([[0, 0, 0, 128], [100, 128, 256, 300], [64, 64, 64, 64], [5, 0, 0, 0]])
    np.testing.assert_array_equal(table_steps(table, 128), [1, 3, 0, 0])
    # Without a table: a query block walks the keys up to its last row (causal on indices),
    # a key block the query blocks from the one holding its first key; else all of them.
    rows = causal_steps(Walk(4, 128, 448, 64, rows_own=True), causal=True)
    np.testing.assert_array_equal(rows, [2, 4, 6, 7])
    keys = causal_steps(Walk(3, 128, 384, 64, rows_own=False), causal=True)
    np.testing.assert_array_equal(keys, [6, 4, 2])
    plain = causal_steps(Walk(3, 128, 384, 64, rows_own=False), causal=False)
    np.testing.assert_array_equal(plain, [6, 6, 6])


def test_equal_work_keeps_the_grid_order():
    steps = causal_steps(Walk(16, 128, 2048, 128, rows_own=True), causal=False)
    np.testing.assert_array_equal(tile_order(steps, 12, 132), np.arange(12 * 16))


def test_a_launch_passes_an_order_only_where_its_kernel_reads_one():
    walk = Walk(8, 128, 1024, 128, rows_own=True)
    common = dict(causal=True, groups=3)
    placeholder = launch_order(None, walk, ordered=False, tabled=False, **common)
    assert placeholder.shape == (1,)
    # Without a table: the order of causal steps, a constant of the call.
    plain = launch_order(None, walk, ordered=True, tabled=False, **common)
    steps = causal_steps(walk, causal=True)
    np.testing.assert_array_equal(np.asarray(plain), tile_order(steps, 3, 132))
    # With a table (traced, as segment ids make it): the order of its steps.
    table = np.zeros((8, 4), np.int32)
    table[:, 3] = np.arange(8)[::-1] * 128  # the first block the heaviest
    got = jax.jit(lambda t: launch_order(t, walk, ordered=True, tabled=True, **common))(
        jnp.asarray(table)
    )
    np.testing.assert_array_equal(np.asarray(got), tile_order(table_steps(table, 128), 3, 132))
    assert not np.array_equal(np.asarray(got), np.asarray(plain))


def test_grouped_causal_dkdv_programs_end_with_light_ones():
    # B4 T4096 K8 (four query heads a kv head): a dk/dv program of 128 keys walks four
    # heads' query blocks from its own on; in the grid's order (each group's heaviest
    # first, the groups in turn) the last group's heaviest programs start late.
    steps = causal_steps(Walk(32, 128, 4096, 64, rows_own=False), causal=True)
    work = np.tile(steps * 4, 32)
    ideal = (work + 0.5).sum() / 132
    assert _makespan(np.arange(work.size), work) / ideal > 1.1
    assert _makespan(tile_order(steps, 32, 132), work) / ideal < 1.01


@pytest.mark.parametrize("shape", [(4, 4096, 32), (1, 8192, 32), (8, 2048, 16)])
def test_short_causal_forwards_end_with_light_tiles(shape):
    # Causal calls without a table: in the grid's order the last groups' heaviest tiles
    # start late; `flash._constexprs.rows_major` takes the last groups one query block at a time.
    from ejk_kernels_gpu import FlashBackwardConfig, FlashConfig
    from ejk_kernels_gpu.flash._constexprs import rows_major
    from ejk_kernels_gpu.flash._select import CallOptions

    batch, q_len, heads = shape
    opts = CallOptions(
        scale=0.1, causal=True, window=None, soft_cap=0.0, dropout_rate=0.0, has_seg=False,
        varlen=False, fwd_cfg=FlashConfig(), bwd_cfg=FlashBackwardConfig(),
    )  # fmt: skip
    cfg = FlashConfig(block_q=128, block_k=128, num_stages=2, gluon=True)
    last = rows_major(opts, (batch, q_len, heads, 128), cfg, persistent=True)
    groups, n_m = batch * heads, q_len // 128
    steps = np.tile(np.arange(1, n_m + 1), groups)  # query block p walks p + 1 key blocks
    ideal = (steps + 0.5).sum() / 132
    order = forward_order(groups, n_m, last)
    grid = _makespan(forward_order(groups, n_m, 0), steps) / ideal
    taken = _makespan(order, steps) / ideal
    assert 0 < last < groups
    np.testing.assert_array_equal(np.sort(order), np.arange(steps.size))
    assert grid > 1.03 and taken < 1.015, (last, grid, taken)
