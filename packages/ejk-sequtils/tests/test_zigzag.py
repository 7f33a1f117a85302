"""The zigzag layout: shard i holds chunks i and 2n-1-i; the round trip is the identity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_sequtils import (
    causal_shard_work,
    from_zigzag,
    to_zigzag,
    zigzag_chunks,
    zigzag_positions,
)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_each_shard_holds_an_early_and_a_late_chunk(n):
    c = 3
    length = 2 * n * c
    pos = zigzag_positions(length, n)
    assert pos.dtype == np.int32 and sorted(pos.tolist()) == list(range(length))
    for i, shard in enumerate(pos.reshape(n, 2 * c)):
        np.testing.assert_array_equal(shard[:c], np.arange(i * c, (i + 1) * c))
        late = 2 * n - 1 - i
        np.testing.assert_array_equal(shard[c:], np.arange(late * c, (late + 1) * c))
    assert zigzag_chunks(n) == tuple(int(x) for x in pos[::c] // c)


def test_causal_work_is_balanced():
    n, c = 4, 5
    pos = zigzag_positions(2 * n * c, n).reshape(n, -1)
    # Visible causal pairs (query sees every key at or before it) of each shard's queries.
    work = [int(np.sum(p + 1)) for p in pos]
    assert len(set(work)) == 1


@pytest.mark.parametrize("axis", [1, -1, 0])
def test_round_trip_numpy_jax_and_jit(axis):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 12, 8))
    n = 2
    got = to_zigzag(x, n, axis=axis)
    assert isinstance(got, np.ndarray) and got.shape == x.shape
    np.testing.assert_array_equal(from_zigzag(got, n, axis=axis), x)
    xj = jnp.asarray(x, jnp.float32)
    fwd = jax.jit(lambda a: to_zigzag(a, n, axis=axis))
    back = jax.jit(lambda a: from_zigzag(a, n, axis=axis))
    np.testing.assert_array_equal(back(fwd(xj)), xj)
    np.testing.assert_array_equal(fwd(xj), got.astype(np.float32))


def test_tokens_segment_ids_and_positions_move_together():
    n, length = 2, 8
    seg = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, -1]], jnp.int32)
    tokens = jnp.arange(length)[None] * 10
    zt, zs = to_zigzag(tokens, n), to_zigzag(seg, n)
    order = zigzag_positions(length, n)
    np.testing.assert_array_equal(zt[0], order * 10)
    np.testing.assert_array_equal(zs[0], np.asarray(seg[0])[order])


def test_gradient_flows_back_through_the_layout():
    x = jnp.arange(8.0)[None]
    w = jnp.arange(8.0)[None] + 1.0
    g = jax.grad(lambda a: jnp.sum(to_zigzag(a, 2) * w))(x)
    np.testing.assert_array_equal(g, from_zigzag(w, 2))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="not a multiple of 8"):
        to_zigzag(np.zeros((1, 12)), 4)
    with pytest.raises(ValueError, match="num_shards must be positive"):
        zigzag_positions(8, 0)
    with pytest.raises(TypeError, match="num_shards"):
        zigzag_chunks(2.0)
    with pytest.raises(ValueError, match="axis=3 is out of range"):
        to_zigzag(np.zeros((2, 4)), 2, axis=3)


@pytest.mark.parametrize("layout", [to_zigzag, from_zigzag])
def test_the_layout_moves_whole_chunks(layout):
    """The zigzag order is a static permutation of 2n chunks: slices and one concatenate,
    no token-by-token gather (those of the gathered keys and values took 0.43 ms of a
    forward+backward on two H200s, `docs/performance-history.md`)."""
    x = jnp.zeros((1, 64, 2, 8), jnp.bfloat16)
    hlo = jax.jit(lambda a: layout(a, 2)).lower(x).as_text()
    assert "gather" not in hlo and "concatenate" in hlo


def _pairs_by_mask(ids: np.ndarray, n: int, zigzag: bool) -> np.ndarray:
    """Each shard's visible (query, key) pairs counted on the mask itself: causal, equal
    non-negative ids."""
    t = ids.shape[1]
    causal = np.tril(np.ones((t, t), bool))
    seen = causal & (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
    per_row = seen.sum(-1).astype(np.float64)
    if zigzag:
        per_row = to_zigzag(per_row, n)
    return per_row.reshape(ids.shape[0], n, -1).sum((0, 2))


@pytest.mark.parametrize("zigzag", [False, True])
def test_shard_work_counts_the_visible_pairs_of_packed_documents(zigzag):
    """Documents as runs of ids (any lengths, across shard edges, padding at the end): each
    shard's work is the count of visible pairs, in either layout, jitted."""
    rng = np.random.default_rng(0)
    n, t = 4, 64
    lengths = rng.integers(1, 20, 12)
    ids = np.repeat(np.arange(12), lengths)[:t]
    ids = np.stack([np.pad(ids, (0, t - len(ids)), constant_values=-1), np.zeros(t, int)])
    ids[1, 50:] = -1
    got = jax.jit(lambda x: causal_shard_work(x, n, zigzag=zigzag))(jnp.asarray(ids, jnp.int32))
    assert got.dtype == jnp.float32 and got.shape == (n,)
    np.testing.assert_allclose(got, _pairs_by_mask(ids, n, zigzag))


def test_shard_work_tells_the_layouts_apart():
    """One document: the contiguous split's last shard has about 2n - 1 times the first's work,
    zigzag's are equal; 16 short documents are balanced either way."""
    n, t = 2, 256
    one = causal_shard_work(np.zeros((1, t), np.int32), n, zigzag=False)
    np.testing.assert_allclose(one / one[0], [1, 3], rtol=0.01)  # 24640 / 8256
    np.testing.assert_allclose(
        np.ptp(causal_shard_work(np.zeros((1, t), np.int32), n, zigzag=True)), 0
    )
    docs = np.repeat(np.arange(16), t // 16)[None]
    for zigzag in (False, True):
        np.testing.assert_allclose(np.ptp(causal_shard_work(docs, n, zigzag=zigzag)), 0)
    with pytest.raises(ValueError, match="does not split into num_shards=3"):
        causal_shard_work(np.zeros((1, 8), np.int32), 3, zigzag=False)
