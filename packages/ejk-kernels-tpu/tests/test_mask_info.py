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
    check_mask,
    make_causal_mask,
    process_dynamic_mask,
    process_dynamic_mask_dkv,
    process_mask,
    process_mask_dkv,
)
from ejk_kernels_tpu._masks import stored_tiles

T, S = 64, 96
BQ, BKV = 16, 32


def _dense(mask):
    d = mask.dense()
    return d if d.ndim == 3 else d[None]


def _walked_last(info, is_dkv):
    """block_mask, data_next, mask_next with the walked axis last (dkv tables walk q)."""
    arrays = [info.block_mask, info.data_next, info.mask_next]
    arrays = [None if a is None else np.asarray(a) for a in arrays]
    if is_dkv:
        arrays = [None if a is None else np.swapaxes(a, 1, 2) for a in arrays]
    return arrays


def _reconstruct(
    info, heads, q_len, kv_len, block_q, block_kv, is_dkv, q_seq_shards=1, mask_function=None
):
    """The dense mask the tables describe, one head per mask row (tables broadcast).

    The block of step (a, b) is (a, data_next[a, b]) (swapped for dkv, whose tables are
    ``[rows, q_steps, kv_blocks]``), so compacted (``shrink_grid``) and plain tables read
    alike; dkv q indices are shard-relative. A partial block is read from its stored tile,
    or computed with ``mask_function`` on ``q_sequence`` when the tables carry one.
    """
    bm, dn, mn = _walked_last(info, is_dkv)
    if info.q_sequence is not None:
        assert mask_function is not None and mn is None and info.partial_mask_blocks is None
    else:
        tiles = info.partial_mask_blocks
        if tiles is not None:
            tiles = np.asarray(tiles).reshape(-1, *np.shape(tiles)[-2:])
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
                rows = slice(i * block_q, (i + 1) * block_q)
                cols = slice(j * block_kv, (j + 1) * block_kv)
                if bm[row, a, b] == 2:
                    out[h, rows, cols] = True
                elif info.q_sequence is not None:
                    q_ids = np.asarray(info.q_sequence)[rows][:, None]
                    kv_ids = np.arange(j * block_kv, (j + 1) * block_kv)[None, :]
                    out[h, rows, cols] = mask_function(q_ids, kv_ids)
                else:
                    tile = tiles[mn[row, a, b]]
                    out[h, rows, cols] = tile.T if is_dkv else tile
    return out


def _check_data_next(info, is_dkv, q_seq_shards=1):
    """Empty steps repeat the nearest non-empty block before them (else the first after)."""
    bm, dn, _ = _walked_last(info, is_dkv)
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


COMPUTABLE = {"causal", "causal_offset", "local", "chunked", "and_or"}


@pytest.mark.parametrize("is_dkv", [False, True], ids=["fwd", "dkv"])
@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("shrink", [False, True], ids=["plain", "shrunk"])
def test_tables_reconstruct_the_dense_mask(name, is_dkv, shrink):
    mask = MASKS[name]
    dense = _dense(mask)
    proc = process_mask_dkv if is_dkv else process_mask
    info, mask_function = proc(mask, (BQ, BKV), shrink_grid=shrink)
    assert not info.is_dynamic_mask
    nq, nk = T // BQ, S // BKV
    # splash's layout for every kernel: [rows, q_blocks, kv_blocks].
    if not shrink:
        assert info.block_mask.shape[1:] == (nq, nk)
    got = _reconstruct(info, dense.shape[0], T, S, BQ, BKV, is_dkv, mask_function=mask_function)
    np.testing.assert_array_equal(got, dense)
    if not shrink:
        _check_data_next(info, is_dkv)
    if name in COMPUTABLE:
        # Computed in the kernel: no tile is stored, and q_sequence is every query position.
        assert mask_function == mask.mask_function
        assert info.mask_next is None and info.partial_mask_blocks is None
        np.testing.assert_array_equal(info.q_sequence, np.arange(T, dtype=np.int32))
        assert info.q_sequence.dtype == np.int32
        return
    assert mask_function is None and info.q_sequence is None
    tiles = info.partial_mask_blocks
    if name == "full":
        # No partial block: splash gives None for mask_next and the tiles.
        assert tiles is None and info.mask_next is None
        return
    # Every stored tile is partial, and stored once.
    assert tiles.dtype == np.bool_
    assert tiles.shape[1:] == ((BKV, BQ) if is_dkv else (BQ, BKV))
    assert all(t.any() and not t.all() for t in tiles)
    assert len({t.tobytes() for t in tiles}) == len(tiles)


def test_fwd_and_dkv_tables_share_one_layout():
    """The dkv tables are the forward ones with q indices in data_next (splash's layout)."""
    mask = MultiHeadMask([NumpyMask(MASKS["numpy"].array)])
    fwd, _ = process_mask(mask, (BQ, BKV), shrink_grid=False)
    dkv, _ = process_mask_dkv(mask, (BQ, BKV), shrink_grid=False)
    np.testing.assert_array_equal(fwd.block_mask, dkv.block_mask)
    partial = np.asarray(fwd.block_mask) == 1
    np.testing.assert_array_equal(
        np.asarray(fwd.partial_mask_blocks)[np.asarray(fwd.mask_next)[partial]],
        np.swapaxes(np.asarray(dkv.partial_mask_blocks)[np.asarray(dkv.mask_next)[partial]], 1, 2),
    )
    active = np.asarray(fwd.block_mask) != 0
    q_index = np.broadcast_to(np.arange(T // BQ)[None, :, None], active.shape)
    np.testing.assert_array_equal(np.asarray(dkv.data_next)[active], q_index[active])


def test_mask_function_only_for_one_computable_mask():
    causal, local = CausalMask((T, S)), LocalMask((T, S), window_size=(4, 4))
    same = MultiHeadMask([causal, CausalMask((T, S))])
    info, fn = process_mask(same, (BQ, BKV))
    assert fn == causal.mask_function and info.q_sequence is not None
    # Different masks per head, a NumpyMask, a FullMask: tiles (or nothing) are stored.
    for mask in (MultiHeadMask([causal, local]), MASKS["numpy"], FullMask((T, S))):
        info, fn = process_mask(mask, (BQ, BKV))
        assert fn is None and info.q_sequence is None
    # One function for the forward and the dkv tables.
    assert process_mask_dkv(same, (BQ, BKV))[1] == process_mask(same, (BQ, BKV))[1]


def test_classification():
    info, _ = process_mask(CausalMask((T, S)), (BQ, BKV), shrink_grid=False)
    bm = info.block_mask[0]
    for i in range(T // BQ):
        for j in range(S // BKV):
            block = CausalMask((T, S))[i * BQ : (i + 1) * BQ, j * BKV : (j + 1) * BKV]
            assert bm[i, j] == (2 if block.all() else 1 if block.any() else 0)
    assert (info.block_mask == 0).any() and (info.block_mask == 2).any()


def test_identical_partial_blocks_are_stored_once():
    # Square causal blocks: every diagonal block is the same lower triangle.
    causal = NumpyMask(CausalMask((128, 128)).dense())
    info, _ = process_mask(causal, (16, 16))
    assert info.partial_mask_blocks.shape == (1, 16, 16)
    assert (info.mask_next == 0).all()
    # Heads with one mask share one table row; different masks get a row each.
    same, _ = process_mask(MultiHeadMask([CausalMask((T, S))] * 4), (BQ, BKV))
    assert same.block_mask.shape[0] == 1
    mixed = MASKS["multihead"]
    assert process_mask(mixed, (BQ, BKV))[0].block_mask.shape[0] == 3


def test_head_shards():
    masks = [CausalMask((T, S))] * 2 + [LocalMask((T, S), window_size=(3, 3))] * 2
    info, fn = process_mask(MultiHeadMask(masks), (BQ, BKV), head_shards=2)
    # One unique mask per shard: one row per shard; two masks: tiles, no function.
    assert info.block_mask.shape[0] == 2 and fn is None
    got = _reconstruct(info, 4, T, S, BQ, BKV, False)
    np.testing.assert_array_equal(got, np.stack([m.dense() for m in masks]))
    single, _ = process_mask(CausalMask((T, S)), (BQ, BKV), head_shards=4)
    assert single.block_mask.shape[0] == 4
    # Mixed masks within a shard keep one row per head.
    info, _ = process_mask(MultiHeadMask(masks), (BQ, BKV), head_shards=1)
    assert info.block_mask.shape[0] == 4


def test_q_seq_shards_make_dkv_indices_shard_relative():
    mask = NumpyMask(LocalMask((T, S), window_size=(8, 8)).dense())
    info, _ = process_mask_dkv(mask, (BQ, BKV), q_seq_shards=2, shrink_grid=False)
    whole, _ = process_mask_dkv(mask, (BQ, BKV), shrink_grid=False)
    np.testing.assert_array_equal(info.block_mask, whole.block_mask)
    assert info.data_next.max() < (T // BQ) // 2
    _check_data_next(info, True, q_seq_shards=2)
    got = _reconstruct(info, 1, T, S, BQ, BKV, True, q_seq_shards=2)
    np.testing.assert_array_equal(got, _dense(mask))
    # Forward tables index kv blocks: q sharding leaves them alone.
    fwd, _ = process_mask(mask, (BQ, BKV), q_seq_shards=2)
    np.testing.assert_array_equal(fwd.data_next, process_mask(mask, (BQ, BKV))[0].data_next)


def test_shrink_grid_cuts_the_empty_steps():
    mask = LocalMask((256, 256), window_size=(16, 0))
    info, fn = process_mask(mask, (16, 16))  # splash's default: shrink_grid=True
    # Each q block row needs at most two kv blocks (its own and the one before).
    assert info.block_mask.shape == (1, 16, 2)
    np.testing.assert_array_equal(
        _reconstruct(info, 1, 256, 256, 16, 16, False, mask_function=fn), _dense(mask)
    )
    # dkv: each kv block column needs two q blocks; its empty steps come first (splash).
    dkv, fn = process_mask_dkv(mask, (16, 16))
    assert dkv.block_mask.shape == (1, 2, 16)
    assert dkv.block_mask[0, 0, -1] == 0 and (dkv.block_mask[0, 1] != 0).all()
    np.testing.assert_array_equal(
        _reconstruct(dkv, 1, 256, 256, 16, 16, True, mask_function=fn), _dense(mask)
    )


def test_only_one_shared_mask_shrinks():
    """splash's rule: per-head tables of different masks keep their full width."""
    masks = MultiHeadMask([LocalMask((T, S), window_size=(4, 0)), CausalMask((T, S))])
    info, _ = process_mask(masks, (BQ, BKV), shrink_grid=True)
    assert info.block_mask.shape == (2, T // BQ, S // BKV)
    _check_data_next(info, False)


def test_downcasting():
    info, _ = process_mask(NumpyMask(CausalMask((T, S)).dense()), (BQ, BKV))
    assert info.data_next.dtype == np.int8
    assert info.mask_next.dtype == np.int8
    assert info.block_mask.dtype == np.int8
    wide, _ = process_mask(CausalMask((8, 4096)), (8, 16), shrink_grid=False)
    assert wide.data_next.dtype == np.int16  # 256 kv blocks: int16 indices
    assert wide.block_mask.dtype == np.int8
    full, _ = process_mask(
        NumpyMask(CausalMask((T, S)).dense()), (BQ, BKV), downcast_smem_data=False
    )
    assert {full.data_next.dtype, full.mask_next.dtype, full.block_mask.dtype} == {
        np.dtype(np.int32)
    }


def test_check_mask_rejects_a_row_that_sees_nothing():
    dense = np.ones((4, 32, 32), bool)
    dense[2, 14, :] = False
    heads = MultiHeadMask([NumpyMask(d) for d in dense])
    with pytest.raises(ValueError, match=r"row 14 of the mask \(head 2\) sees no key.*softmax"):
        check_mask(heads)
    check_mask(CausalMask((T, S)))
    with pytest.raises(ValueError, match="row 0"):
        check_mask(CausalMask((T, S), offset=-1))


@pytest.mark.parametrize("is_dkv", [False, True], ids=["fwd", "dkv"])
def test_dynamic_mask_matches_static(is_dkv):
    mask = MASKS["multihead"]
    dense = jnp.asarray(mask.dense())
    proc = process_dynamic_mask_dkv if is_dkv else process_dynamic_mask
    info, fn = jax.jit(lambda m: proc(m, (BQ, BKV)))(dense)
    assert info.is_dynamic_mask and fn is None
    nq, nk = T // BQ, S // BKV
    assert info.partial_mask_blocks.shape == (
        (3, nq, nk, BKV, BQ) if is_dkv else (3, nq, nk, BQ, BKV)
    )
    got = _reconstruct(info, 3, T, S, BQ, BKV, is_dkv)
    np.testing.assert_array_equal(got, np.asarray(dense))
    static, _ = (process_mask_dkv if is_dkv else process_mask)(
        stored_tiles(mask), (BQ, BKV), shrink_grid=False
    )
    np.testing.assert_array_equal(info.block_mask, static.block_mask)
    active = np.asarray(info.block_mask) != 0
    np.testing.assert_array_equal(
        np.asarray(info.data_next)[active], np.asarray(static.data_next)[active]
    )
    # An empty block points at block 0 (splash's dynamic tables; they are traced).
    assert (np.asarray(info.data_next)[~active] == 0).all()
    assert info.block_mask.shape == (3, nq, nk)


def test_dynamic_tables_of_a_small_causal_mask():
    """A [1, 8, 8] causal mask in (2, 4) blocks: every table entry, both kernels."""
    mask = jnp.asarray(make_causal_mask((8, 8)))[None]
    info, _ = process_dynamic_mask(mask, (2, 4))
    np.testing.assert_array_equal(info.block_mask[0], [[1, 0], [1, 0], [2, 1], [2, 1]])
    np.testing.assert_array_equal(info.mask_next[0], [[0, 0], [2, 0], [0, 5], [0, 7]])
    np.testing.assert_array_equal(info.data_next[0], [[0, 0], [0, 0], [0, 1], [0, 1]])
    dkv, _ = process_dynamic_mask(mask, (2, 4), is_dkv=True)
    np.testing.assert_array_equal(dkv.data_next[0], [[0, 0], [1, 0], [2, 2], [3, 3]])
    np.testing.assert_array_equal(
        dkv.partial_mask_blocks, np.swapaxes(np.asarray(info.partial_mask_blocks), -1, -2)
    )
    assert {info.data_next.dtype, info.mask_next.dtype, info.block_mask.dtype} == {
        np.dtype(np.int8)
    }


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
    with pytest.raises(ValueError, match=match):
        process_dynamic_mask(jnp.asarray(mask.dense()), **kwargs)


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


def _check_compacted(info, is_dkv, q_seq_shards):
    """Per shard row: the non-empty steps together (first; last in dkv, then the shard's
    padding), in increasing block order; the empty steps repeat a neighbour's block."""
    bm, dn, _ = _walked_last(info, is_dkv)
    steps = bm.shape[2] // q_seq_shards
    for r, a, sh in np.ndindex(bm.shape[0], bm.shape[1], q_seq_shards):
        kinds = bm[r, a, sh * steps : (sh + 1) * steps]
        nxt = dn[r, a, sh * steps : (sh + 1) * steps]
        active = np.flatnonzero(kinds != 0)
        if not active.size:
            continue
        assert (np.diff(active) == 1).all()
        if not is_dkv:
            assert active[0] == 0
        assert (np.diff(nxt[active]) > 0).all()
        assert set(nxt[kinds == 0]) <= set(nxt[active])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_spec(), st.booleans(), st.booleans())
def test_property_tables_describe_the_mask(spec, is_dkv, shrink):
    kinds, block, (t, s), head_shards, q_seq_shards = spec
    mask = MultiHeadMask([_build(kind, seed, t, s) for kind, seed in kinds])
    heads = len(kinds)
    proc = process_mask_dkv if is_dkv else process_mask
    info, fn = proc(
        mask, block, head_shards=head_shards, q_seq_shards=q_seq_shards, shrink_grid=shrink
    )
    shards = q_seq_shards if is_dkv else 1
    got = _reconstruct(info, heads, t, s, *block, is_dkv, q_seq_shards=shards, mask_function=fn)
    np.testing.assert_array_equal(got, mask.dense())
    if shrink and len(set(mask.masks)) == 1:  # splash shrinks one shared mask only
        _check_compacted(info, is_dkv, shards)
    else:
        _check_data_next(info, is_dkv, shards)
    assert info.block_mask.shape[0] in (head_shards, heads)
    tiles = info.partial_mask_blocks
    if tiles is not None:
        assert len({tile.tobytes() for tile in tiles}) == len(tiles)
