"""`create_block_mask` decides ejk's own mods from their definitions: the same tables as
evaluating every element, with only the undecided blocks evaluated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import (
    and_masks,
    causal_mask,
    create_block_mask,
    document_mask,
    or_masks,
    prefix_lm_mask,
    sliding_window_mask,
)
from ejk_attention.flex._block_kinds import UNKNOWN, Blocks, analytic_kinds


def _every_element(mask_mod):
    """The same mod as a plain function: `create_block_mask` evaluates all of its elements."""
    return lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx, kv_idx)


def _sorted_ids(rng, batch, length, padding):
    """Non-decreasing document ids of random lengths, ``padding`` ids -1 at the end."""
    cuts = np.sort(rng.choice(np.arange(1, length), size=min(6, length - 1), replace=False))
    ids = np.searchsorted(cuts, np.arange(length), side="right")[None].repeat(batch, 0)
    for row in range(1, batch):  # other documents in the other rows
        ids[row] = np.roll(ids[row], rng.integers(length)) % 5
        ids[row].sort()
    ids[:, length - padding :] = -1
    return ids.astype(np.int32)


def _mods(rng, batch, t, s):
    """ejk's mods and combinations of them, with captures of every kind."""
    ids = jnp.asarray(_sorted_ids(rng, batch, t, padding=3))
    holes = np.asarray(ids).copy()
    holes[:, t // 3 : t // 3 + 5] = -1  # padding in the middle (still sorted apart from it)
    shuffled = jnp.asarray(rng.integers(-1, 4, (batch, t)), jnp.int32)  # not sorted
    cross = (jnp.asarray(rng.integers(0, 3, (batch, t)).cumsum(1) // 4, jnp.int32),
             jnp.asarray(rng.integers(0, 3, (batch, s)).cumsum(1) // 4, jnp.int32))  # fmt: skip
    lengths = jnp.asarray(rng.integers(0, s + 3, (batch,)), jnp.int32)
    # Ranges that meet without a shared id: chunks of 16 ids {0, 2} and of 16 ids {1}.
    chunks = np.arange(t) // 16
    interleaved = jnp.asarray(np.where(chunks % 2, 1, 2 * (np.arange(t) % 2))[None], jnp.int32)
    # Two partitions whose padding halves one block: each alone partial there, both empty.
    first, second = (np.zeros((1, t), np.int32) for _ in range(2))
    first[:, :4], second[:, 4:8] = -1, -1

    def user(b, h, q_idx, kv_idx):
        return (q_idx + 2 * h + b) % 5 != kv_idx % 3

    self_only = t == s
    mods = {
        "causal": causal_mask,
        "window": sliding_window_mask((5, 2)),
        "window left": sliding_window_mask((9, 0)),
        "window huge": sliding_window_mask((1 << 30, 0)),
        "prefix": prefix_lm_mask(lengths),
        "prefix scalar": prefix_lm_mask(jnp.int32(7)),
        "cross documents": document_mask(cross),
        "causal prefix or window": or_masks(prefix_lm_mask(lengths), sliding_window_mask((3, 3))),
        "causal or the rest": or_masks(causal_mask, sliding_window_mask((0, 1 << 30))),
        "and user": and_masks(causal_mask, user),
        "or user": or_masks(sliding_window_mask((4, 0)), user),
        "nothing": and_masks(),
        "none of": or_masks(),
    }
    if self_only:
        mods |= {
            "documents": document_mask(ids),
            "causal documents": and_masks(causal_mask, document_mask(ids)),
            "documents window": and_masks(document_mask(ids), sliding_window_mask((6, 0))),
            "documents with holes": and_masks(causal_mask, document_mask(jnp.asarray(holes))),
            "unsorted documents": and_masks(causal_mask, document_mask(shuffled)),
            "interleaved documents": document_mask(interleaved),
            "two paddings": and_masks(document_mask(first), document_mask(second)),
            "documents or prefix": or_masks(document_mask(ids[:1]), prefix_lm_mask(lengths)),
            "nested": or_masks(and_masks(causal_mask, document_mask(ids)), sliding_window_mask(2)),
        }
    return mods


@pytest.mark.parametrize(
    ("t", "s", "block", "sizes"),
    [
        pytest.param(64, 64, (8, 8), (3, None), marks=pytest.mark.slow),
        (61, 61, (8, 16), (2, 3)),
        (45, 70, (16, 8), (2, None)),
        pytest.param(70, 45, (8, 8), (2, 2), marks=pytest.mark.slow),
    ],
)
def test_same_tables_as_every_element(t, s, block, sizes):
    rng = np.random.default_rng(t * 100 + s)
    seen = set()
    for name, mod in _mods(rng, sizes[0] or 1, t, s).items():
        if sizes[0] is None and name.startswith(("prefix", "documents or")):
            continue
        got = create_block_mask(mod, *sizes, t, s, block_size=block).kinds
        want = create_block_mask(_every_element(mod), *sizes, t, s, block_size=block).kinds
        np.testing.assert_array_equal(got, want, err_msg=name)
        seen |= set(np.unique(np.asarray(want)).tolist())
    assert seen == {0, 1, 2}


def test_under_jit_with_new_ids_and_chunked_evaluation(monkeypatch):
    """Traced ids, sorted or not: one compiled builder; a few blocks per evaluation step."""
    from ejk_attention.flex import _block_mask

    monkeypatch.setattr(_block_mask, "_MAX_ELEMENTS", 3 * 8 * 8)
    t = 64
    build = jax.jit(lambda ids: create_block_mask(
        and_masks(causal_mask, document_mask(ids)), 2, None, t, t, block_size=8).kinds)  # fmt: skip
    rng = np.random.default_rng(1)
    for ids in (_sorted_ids(rng, 2, t, padding=5), rng.integers(-1, 3, (2, t)).astype(np.int32)):
        mod = and_masks(causal_mask, document_mask(jnp.asarray(ids)))
        want = create_block_mask(_every_element(mod), 2, None, t, t, block_size=8).kinds
        np.testing.assert_array_equal(build(jnp.asarray(ids)), want)
    assert build._cache_size() == 1


def test_only_undecided_blocks_are_left_to_evaluate():
    """Causal documents at T = 128k: the diagonal blocks where a document starts are the only
    ones the definitions leave open (of a million)."""
    t, docs = 1 << 17, 64
    starts = np.sort(np.random.default_rng(0).choice(np.arange(1, t), docs - 1, replace=False))
    ids = jnp.asarray(np.searchsorted(starts, np.arange(t), side="right")[None], jnp.int32)
    grid = Blocks.of(t, t, 128, 128)
    kinds = analytic_kinds(and_masks(causal_mask, document_mask(ids)), grid, opaque=(1, 1))
    unknown = int(jnp.sum(kinds == UNKNOWN))
    assert 0 < unknown <= docs - 1
    for mod in (causal_mask, sliding_window_mask((1000, 0)), prefix_lm_mask(jnp.int32(5000))):
        assert int(jnp.sum(analytic_kinds(mod, grid, opaque=(1, 1)) == UNKNOWN)) == 0
    assert analytic_kinds(_every_element(causal_mask), grid, opaque=(1, 1)) is None
