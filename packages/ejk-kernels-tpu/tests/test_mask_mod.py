"""`ModMask` (a mask_mod split into features and a tile part) and the block tables of a kinds
table (`rescale_kinds`, `block_kind_info`), against the mask evaluated densely."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_tpu import ModMask
from ejk_kernels_tpu._block_kinds import block_kind_info, rescale_kinds
from ejk_kernels_tpu._mask_info import EMPTY, FULL, PARTIAL

B, N, T, S = 2, 3, 37, 29
IDS = jnp.asarray(np.random.default_rng(0).integers(-1, 3, (B, T)), jnp.int32)
LENGTHS = jnp.asarray([4, 9], jnp.int32)


def _documents(b, h, q_idx, kv_idx):
    return (IDS[b, q_idx] == IDS[b, kv_idx % T]) & (IDS[b, q_idx] >= 0)


def _prefix_per_head(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx + h) | (kv_idx - q_idx < LENGTHS[b] - 8)


def _query_only(b, h, q_idx, kv_idx):  # ignores kv_idx: the result itself is a feature
    return IDS[b, q_idx] >= 0


def _dense(mask_mod, t=T, s=S):
    grid = jnp.meshgrid(*(jnp.arange(x, dtype=jnp.int32) for x in (B, N, t, s)), indexing="ij")
    return np.asarray(jnp.vectorize(mask_mod)(*grid))


@pytest.mark.parametrize(
    ("mask_mod", "axes"),
    [
        (_documents, {("q", True, False), ("kv", True, False)}),
        (_prefix_per_head, {("q", False, True), ("scalar", True, False)}),
        (_query_only, {("q", True, False)}),
    ],
)
def test_split_evaluates_like_the_mod(mask_mod, axes):
    """Features per query / key / (b, h), each with the batch and head it depends on; the
    tile part with them equals the mod evaluated everywhere."""
    mod, consts = ModMask.trace(mask_mod)
    assert {(f.axis, f.batch, f.head) for f in mod.features} >= axes
    features = mod.feature_arrays(consts, B, N, T, S, 40, 32)
    want = _dense(mask_mod)
    q_ids = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[:, None], (T, S))
    kv_ids = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None, :], (T, S))
    for b in range(B):
        for h in range(N):
            values = []
            for f, x in zip(mod.features, features, strict=True):
                at = (b if f.batch else 0, h if f.head else 0)
                if f.axis == "scalar":
                    values.append(x[at[0] * (N if f.head else 1) + at[1]])
                elif f.axis == "q":
                    assert x.shape[2] == 40  # padded; the padding repeats the last position
                    values.append(jnp.broadcast_to(x[at][:T, None], (T, S)))
                else:
                    values.append(jnp.broadcast_to(x[at][None, :S], (T, S)))
            got = mod.evaluate(jnp.int32(b), jnp.int32(h), q_ids, kv_ids, values)
            np.testing.assert_array_equal(got, want[b, h], err_msg=f"{b=} {h=}")


def test_a_capture_read_at_both_positions_is_refused():
    table = jnp.arange(T + S, dtype=jnp.int32)

    def relative(b, h, q_idx, kv_idx):
        return table[q_idx - kv_idx + S] > 3

    with pytest.raises(NotImplementedError, match=r"'relative'.*depends on both q_idx and kv_idx"):
        ModMask.trace(relative)


def _kinds(visible, block, lengths):
    """Kinds of ``visible [B, N, T, S]`` per block, classified on in-range positions."""
    t, s = lengths
    bq, bk = block
    tb, sb = -(-t // bq), -(-s // bk)
    pad = np.zeros((*visible.shape[:2], tb * bq, sb * bk), bool)
    inside = np.zeros_like(pad)
    pad[:, :, :t, :s] = visible
    inside[:, :, :t, :s] = True
    cut = lambda x: x.reshape(*x.shape[:2], tb, bq, sb, bk)
    anyv = (cut(pad) & cut(inside)).any(axis=(3, 5))
    allv = (cut(pad) | ~cut(inside)).all(axis=(3, 5))
    return np.where(allv, FULL, np.where(anyv, PARTIAL, EMPTY)).astype(np.int8)


@pytest.mark.parametrize(
    ("block", "new_block"),
    [((8, 4), (8, 4)), ((4, 4), (16, 8)), ((16, 8), (8, 32)), ((6, 10), (16, 8))],
)
def test_rescaled_kinds_are_exact_or_conservative(block, new_block):
    """Re-cut kinds never call a block empty that has a visible entry, nor full one that has a
    hidden entry or padding; where one block size divides the other they are exact."""
    visible = _dense(_prefix_per_head)
    padded = (48, 32)
    got = np.asarray(
        rescale_kinds(jnp.asarray(_kinds(visible, block, (T, S))), block, new_block, (T, S), padded)
    )
    tb, sb = padded[0] // new_block[0], padded[1] // new_block[1]
    assert got.shape == (B, N, tb, sb)
    truth = _kinds(visible, new_block, (T, S))
    truth = np.pad(truth, ((0, 0), (0, 0), (0, tb - truth.shape[2]), (0, sb - truth.shape[3])))
    whole = np.zeros((tb, sb), bool)  # kernel blocks holding no padding
    whole[: T // new_block[0], : S // new_block[1]] = True
    truth = np.where((truth == FULL) & ~whole, PARTIAL, truth)  # padding is never full
    assert not ((got == EMPTY) & (truth != EMPTY)).any()
    assert not ((got == FULL) & (truth != FULL)).any()
    divides = all(max(a, b) % min(a, b) == 0 for a, b in zip(block, new_block, strict=True))
    if divides:
        np.testing.assert_array_equal(got, truth)


def test_block_kind_info_fetches_no_new_block_on_empty_steps():
    kinds = jnp.asarray([[[0, 2, 0, 1, 0], [0, 0, 0, 0, 0]]], jnp.int8)  # [rows, q, kv]
    info = block_kind_info(kinds, is_dkv=False)
    np.testing.assert_array_equal(info.block_mask, kinds)
    np.testing.assert_array_equal(info.data_next, [[[1, 1, 1, 3, 3], [0, 0, 0, 0, 0]]])
    dkv = block_kind_info(jnp.swapaxes(kinds, 1, 2), is_dkv=True)  # walked axis: q
    np.testing.assert_array_equal(jnp.swapaxes(dkv.data_next, 1, 2), info.data_next)
    jitted = jax.jit(lambda k: block_kind_info(k, is_dkv=False).data_next)(kinds)
    np.testing.assert_array_equal(jitted, info.data_next)
