"""MaskInfo tables against dense masks: classification, reconstruction, dedup, shards, dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ejk_kernels_tpu import (
    CausalMask,
    ChunkedCausalMask,
    FullMask,
    LocalMask,
    MultiHeadMask,
    NumpyMask,
    process_dynamic_mask,
    process_dynamic_mask_dkv,
    process_mask,
    process_mask_dkv,
)

T, S = 64, 96
BQ, BKV = 16, 32


def _dense(mask):
    d = mask.dense()
    return d if d.ndim == 3 else d[None]


def _reconstruct(info, heads, q_len, kv_len, block_q, block_kv, is_dkv, q_seq_shards=1):
    """The dense mask the tables describe, one head per mask row (tables broadcast).

    The block of step (a, b) is (a, data_next[a, b]) (swapped for dkv), so compacted
    (``shrink_grid``) and plain tables read alike; dkv q indices are shard-relative.
    """
    bm = np.asarray(info.block_mask)
    mn = np.asarray(info.mask_next)
    dn = np.asarray(info.data_next)
    tiles = np.asarray(info.partial_mask_blocks)
    if info.is_dynamic_mask:
        tiles = tiles.reshape(-1, *tiles.shape[-2:])
    shards = q_seq_shards if is_dkv else 1
    inner_total = (q_len // block_q) if is_dkv else (kv_len // block_kv)
    steps_per_shard = bm.shape[2] // shards
    out = np.zeros((heads, q_len, kv_len), bool)
    seen = set()
    for h in range(heads):
        row = h // (heads // bm.shape[0])
        for a in range(bm.shape[1]):
            for b in range(bm.shape[2]):
                if bm[row, a, b] == 0:
                    continue
                inner = (b // steps_per_shard) * (inner_total // shards) + int(dn[row, a, b])
                assert (h, a, inner) not in seen, "a block is visited twice"
                seen.add((h, a, inner))
                i, j = (inner, a) if is_dkv else (a, inner)
                sl = (
                    h,
                    slice(i * block_q, (i + 1) * block_q),
                    slice(j * block_kv, (j + 1) * block_kv),
                )
                if bm[row, a, b] == 2:
                    out[sl] = True
                else:
                    tile = tiles[mn[row, a, b]]
                    out[sl] = tile.T if is_dkv else tile
    return out


def _check_data_next(info, q_seq_shards=1):
    bm = np.asarray(info.block_mask)
    dn = np.asarray(info.data_next)
    inner = bm.shape[2] // q_seq_shards
    for r in range(bm.shape[0]):
        for a in range(bm.shape[1]):
            for s in range(q_seq_shards):
                act = np.flatnonzero(bm[r, a, s * inner : (s + 1) * inner] != 0)
                for b in range(inner):
                    got = dn[r, a, s * inner + b]
                    if b in act:
                        assert got == b
                    elif act.size:
                        before = act[act <= b]
                        assert got == (before[-1] if before.size else act[0])


MASKS = {
    "causal": CausalMask((T, S)),
    "causal_offset": CausalMask((T, S), offset=20),
    "local": LocalMask((T, S), window_size=(10, 5)),
    "chunked": ChunkedCausalMask((T, S), chunk_size=24),
    "full": FullMask((T, S)),
    "numpy": NumpyMask(np.random.default_rng(1).random((T, S)) < 0.3),
    "and_or": (CausalMask((T, S)) & LocalMask((T, S), window_size=(20, 0)))
    | ChunkedCausalMask((T, S), chunk_size=8),
    "multihead": MultiHeadMask(
        [CausalMask((T, S)), LocalMask((T, S), window_size=(4, 4)), CausalMask((T, S))]
    ),
}


@pytest.mark.parametrize("is_dkv", [False, True], ids=["fwd", "dkv"])
@pytest.mark.parametrize("name", list(MASKS))
def test_tables_reconstruct_the_dense_mask(name, is_dkv):
    mask = MASKS[name]
    dense = _dense(mask)
    proc = process_mask_dkv if is_dkv else process_mask
    info = proc(mask, (BQ, BKV))
    assert not info.is_dynamic_mask
    nq, nk = T // BQ, S // BKV
    assert info.block_mask.shape[1:] == ((nk, nq) if is_dkv else (nq, nk))
    got = _reconstruct(info, dense.shape[0], T, S, BQ, BKV, is_dkv)
    np.testing.assert_array_equal(got, dense)
    _check_data_next(info)
    # Every stored tile is partial, and stored once.
    tiles = info.partial_mask_blocks
    assert tiles.dtype == np.bool_
    assert tiles.shape[1:] == ((BKV, BQ) if is_dkv else (BQ, BKV))
    assert all(t.any() and not t.all() for t in tiles)
    assert len({t.tobytes() for t in tiles}) == len(tiles)


def test_classification():
    info = process_mask(CausalMask((T, S)), (BQ, BKV))
    bm = info.block_mask[0]
    for i in range(T // BQ):
        for j in range(S // BKV):
            block = CausalMask((T, S))[i * BQ : (i + 1) * BQ, j * BKV : (j + 1) * BKV]
            assert bm[i, j] == (2 if block.all() else 1 if block.any() else 0)
    assert (info.block_mask == 0).any() and (info.block_mask == 2).any()


def test_identical_partial_blocks_are_stored_once():
    # Square causal blocks: every diagonal block is the same lower triangle.
    info = process_mask(CausalMask((128, 128)), (16, 16))
    assert info.partial_mask_blocks.shape == (1, 16, 16)
    assert (info.mask_next == 0).all()
    # Heads with one mask share one table row; different masks get a row each.
    same = process_mask(MultiHeadMask([CausalMask((T, S))] * 4), (BQ, BKV))
    assert same.block_mask.shape[0] == 1
    mixed = MASKS["multihead"]
    assert process_mask(mixed, (BQ, BKV)).block_mask.shape[0] == 3


def test_head_shards():
    masks = [CausalMask((T, S))] * 2 + [LocalMask((T, S), window_size=(3, 3))] * 2
    info = process_mask(MultiHeadMask(masks), (BQ, BKV), head_shards=2)
    # One unique mask per shard: one row per shard.
    assert info.block_mask.shape[0] == 2
    got = _reconstruct(info, 4, T, S, BQ, BKV, False)
    np.testing.assert_array_equal(got, np.stack([m.dense() for m in masks]))
    single = process_mask(CausalMask((T, S)), (BQ, BKV), head_shards=4)
    assert single.block_mask.shape[0] == 4
    # Mixed masks within a shard keep one row per head.
    info = process_mask(MultiHeadMask(masks), (BQ, BKV), head_shards=1)
    assert info.block_mask.shape[0] == 4


def test_q_seq_shards_make_dkv_indices_shard_relative():
    mask = LocalMask((T, S), window_size=(8, 8))
    info = process_mask_dkv(mask, (BQ, BKV), q_seq_shards=2)
    whole = process_mask_dkv(mask, (BQ, BKV))
    np.testing.assert_array_equal(info.block_mask, whole.block_mask)
    assert info.data_next.max() < (T // BQ) // 2
    _check_data_next(info, q_seq_shards=2)
    # Forward tables index kv blocks: q sharding leaves them alone.
    fwd = process_mask(mask, (BQ, BKV), q_seq_shards=2)
    np.testing.assert_array_equal(fwd.data_next, process_mask(mask, (BQ, BKV)).data_next)


def test_shrink_grid_cuts_the_empty_tail():
    mask = LocalMask((256, 256), window_size=(16, 0))
    info = process_mask(mask, (16, 16), shrink_grid=True)
    # Each q block row needs at most two kv blocks (its own and the one before).
    assert info.block_mask.shape == (1, 16, 2)
    np.testing.assert_array_equal(_reconstruct(info, 1, 256, 256, 16, 16, False), _dense(mask))
    dkv = process_mask_dkv(mask, (16, 16), shrink_grid=True)
    assert dkv.block_mask.shape == (1, 16, 2)
    np.testing.assert_array_equal(_reconstruct(dkv, 1, 256, 256, 16, 16, True), _dense(mask))


def test_downcasting():
    info = process_mask(CausalMask((T, S)), (BQ, BKV))
    assert info.data_next.dtype == np.int8
    assert info.mask_next.dtype == np.int8
    assert info.block_mask.dtype == np.int8
    wide = process_mask(CausalMask((8, 4096)), (8, 16))  # 256 kv blocks: int16 indices
    assert wide.data_next.dtype == np.int16
    assert wide.block_mask.dtype == np.int8
    full = process_mask(CausalMask((T, S)), (BQ, BKV), downcast_smem_data=False)
    assert {full.data_next.dtype, full.mask_next.dtype, full.block_mask.dtype} == {
        np.dtype(np.int32)
    }


@pytest.mark.parametrize("is_dkv", [False, True], ids=["fwd", "dkv"])
def test_dynamic_mask_matches_static(is_dkv):
    mask = MASKS["multihead"]
    dense = jnp.asarray(mask.dense())
    proc = process_dynamic_mask_dkv if is_dkv else process_dynamic_mask
    info = jax.jit(lambda m: proc(m, (BQ, BKV)))(dense)
    assert info.is_dynamic_mask
    nq, nk = T // BQ, S // BKV
    outer, inner = (nk, nq) if is_dkv else (nq, nk)
    assert info.partial_mask_blocks.shape == (
        (3, nk, nq, BKV, BQ) if is_dkv else (3, nq, nk, BQ, BKV)
    )
    got = _reconstruct(info, 3, T, S, BQ, BKV, is_dkv)
    np.testing.assert_array_equal(got, np.asarray(dense))
    static = (process_mask_dkv if is_dkv else process_mask)(mask, (BQ, BKV))
    np.testing.assert_array_equal(info.block_mask, static.block_mask)
    np.testing.assert_array_equal(info.data_next, static.data_next)
    assert info.block_mask.shape == (3, outer, inner)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_shape": (24, BKV)}, "block_q=24 must divide"),
        ({"block_shape": (BQ, 40)}, "block_kv=40 must divide"),
        ({"block_shape": (0, BKV)}, "block_q must be a positive int"),
        ({"block_shape": (BQ, BKV), "head_shards": 2}, "head_shards=2"),
        ({"block_shape": (BQ, BKV), "q_seq_shards": 3}, "q_seq_shards=3"),
    ],
)
def test_errors_name_the_block_size_or_shape(kwargs, match):
    mask = MultiHeadMask([CausalMask((T, S))] * 3)
    with pytest.raises(ValueError, match=match):
        process_mask(mask, **kwargs)


def test_dynamic_errors():
    with pytest.raises(ValueError, match=r"\[heads, T, S\]"):
        process_dynamic_mask(jnp.ones((T, S), bool), (BQ, BKV))
    with pytest.raises(ValueError, match="block_kv=40"):
        process_dynamic_mask(jnp.ones((1, T, S), bool), (BQ, 40))
    with pytest.raises(TypeError, match="Mask"):
        process_mask(np.ones((T, S), bool), (BQ, BKV))


@st.composite
def _spec(draw):
    """Plain data of a mask + blocks; the masks are built in the test, not in the strategy."""
    heads = draw(st.sampled_from([1, 2, 4]))
    bq, bkv = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8]))
    nq, nk = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    kinds = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["causal", "local", "chunk", "rand", "full"]),
                st.integers(0, 2**16),
            ),
            min_size=heads,
            max_size=heads,
        )
    )
    head_shards = draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0]))
    q_seq_shards = draw(st.sampled_from([d for d in (1, 2, 3, 4, 5) if nq % d == 0]))
    return kinds, (bq, bkv), (bq * nq, bkv * nk), head_shards, q_seq_shards


def _build(kind, seed, t, s):
    rng = np.random.default_rng(seed)
    if kind == "causal":
        return CausalMask((t, s), offset=int(rng.integers(-3, 4)))
    if kind == "local":
        return LocalMask((t, s), window_size=(int(rng.integers(0, 5)), int(rng.integers(0, 5))))
    if kind == "chunk":
        return ChunkedCausalMask((t, s), chunk_size=int(rng.integers(1, 6)))
    if kind == "rand":
        return NumpyMask(rng.random((t, s)) < rng.random())
    return FullMask((t, s))


def _check_compacted(info, q_seq_shards):
    """Per shard row: non-empty steps first, in increasing block order; then repeats."""
    bm, dn = np.asarray(info.block_mask), np.asarray(info.data_next)
    steps = bm.shape[2] // q_seq_shards
    for r, a, sh in np.ndindex(bm.shape[0], bm.shape[1], q_seq_shards):
        kinds = bm[r, a, sh * steps : (sh + 1) * steps]
        nxt = dn[r, a, sh * steps : (sh + 1) * steps]
        n = int((kinds != 0).sum())
        assert (kinds[:n] != 0).all() and (kinds[n:] == 0).all()
        assert (np.diff(nxt[:n]) > 0).all()
        if n:
            assert (nxt[n:] == nxt[n - 1]).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_spec(), st.booleans(), st.booleans())
def test_property_tables_describe_the_mask(spec, is_dkv, shrink):
    kinds, block, (t, s), head_shards, q_seq_shards = spec
    mask = MultiHeadMask([_build(kind, seed, t, s) for kind, seed in kinds])
    heads = len(kinds)
    proc = process_mask_dkv if is_dkv else process_mask
    info = proc(mask, block, head_shards=head_shards, q_seq_shards=q_seq_shards, shrink_grid=shrink)
    shards = q_seq_shards if is_dkv else 1
    got = _reconstruct(info, heads, t, s, *block, is_dkv, q_seq_shards=shards)
    np.testing.assert_array_equal(got, mask.dense())
    if shrink:
        _check_compacted(info, shards)
    else:
        _check_data_next(info, shards)
    assert info.block_mask.shape[0] in (head_shards, heads)
    tiles = info.partial_mask_blocks
    assert len({tile.tobytes() for tile in tiles}) == len(tiles)
