"""The Gluon dk/dv kernel's program order (`_schedule.dkdv_order`): a permutation of the
grid's tiles, heaviest first within blocks of (batch, kv head) groups, and a shorter
schedule than the grid's own order where programs' work is uneven."""

from __future__ import annotations

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_gpu._schedule import dkdv_order


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
    order = dkdv_order(table, groups, 64, multiprocessors=16)
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
    ordered = _makespan(dkdv_order(table, groups, 64, 132), steps) / ideal
    assert grid > 1.2 and ordered < 1.05, (grid, ordered)


def test_traced_tables_give_the_same_order():
    rng = np.random.default_rng(1)
    table = np.stack([_documents_table(24, set(rng.choice(2, 1)), doc_blocks=8) for _ in range(3)])
    want = dkdv_order(table, 6, 64, 4)
    got = jax.jit(lambda t: dkdv_order(t, 6, 64, 4))(jnp.asarray(table))
    np.testing.assert_array_equal(np.asarray(got), want)
