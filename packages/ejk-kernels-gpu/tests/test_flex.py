"""The flex kernels (Triton's interpreter here) and the translation of mods into Triton.

Kernel cases compare with a dense float32 definition written here; the block lists are
built from the dense mask in NumPy, and then falsified on purpose: a kernel that ran the
mask_mod on full blocks, skipped it on partial ones, or visited blocks the lists leave out
fails them. The translation cases check what is generated, cached and refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_gpu.flex import FlexConfig, flex_attention, unsupported_flex_reason
from ejk_kernels_gpu.flex._plan import Unsupported, plan_mods

B, T, S, N, K, H = 2, 37, 45, 4, 2, 16
BLOCK = 16
TB, SB = -(-T // BLOCK), -(-S // BLOCK)


def _inputs(seed=0, hv=H):
    rng = np.random.default_rng(seed)
    shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, hv))
    return tuple(jnp.asarray(rng.standard_normal(x), jnp.float32) for x in shapes)


def _grid():
    """int32 index grids ``b, h, q_idx, kv_idx`` broadcasting to ``[B, N, T, S]``."""
    return (
        jnp.arange(B, dtype=jnp.int32)[:, None, None, None],
        jnp.arange(N, dtype=jnp.int32)[None, :, None, None],
        jnp.arange(T, dtype=jnp.int32)[None, None, :, None],
        jnp.arange(S, dtype=jnp.int32)[None, None, None, :],
    )


def dense(q, k, v, score_mod=None, visible=None):
    """Flex attention by its definition over the whole ``[B, N, T, S]`` score matrix."""
    group = N // K
    kk, vv = (jnp.repeat(x, group, axis=2) for x in (k, v))
    s = jnp.einsum("btnh,bsnh->bnts", q, kk, precision="highest") * H**-0.5
    if score_mod is not None:
        s = jnp.vectorize(score_mod)(s, *_grid())
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    total = jnp.sum(e, axis=-1, keepdims=True)
    return jnp.einsum("bnts,bsnh->btnh", e / jnp.where(total > 0, total, 1.0), vv,
                      precision="highest")  # fmt: skip


def block_lists(kinds):
    """FlexAttention's lists of ``kinds`` ``[MB, MN, R, C]`` (0 empty, 1 partial, 2 full)."""
    out = []
    for kind in (1, 2):
        hit = kinds == kind
        out += [hit.sum(-1).astype(np.int32), np.argsort(~hit, -1, kind="stable").astype(np.int32)]
    return tuple(jnp.asarray(x) for x in out)


def kinds_of(visible, block=BLOCK):
    """Block kinds ``[B, N, T / block, S / block]`` of a dense bool mask."""
    tb, sb = -(-T // block), -(-S // block)
    padded = np.ones((B, N, tb * block, sb * block), bool)
    inside = np.zeros_like(padded)
    padded[:, :, :T, :S] = np.broadcast_to(np.asarray(visible), (B, N, T, S))
    inside[:, :, :T, :S] = True
    blocks = lambda x: x.reshape(B, N, tb, block, sb, block)
    any_ = (blocks(padded & inside)).any(axis=(3, 5))
    all_ = blocks(padded).all(axis=(3, 5))
    return np.where(all_, 2, np.where(any_, 1, 0)).astype(np.int8)


def run(q, k, v, kinds, score_mod=None, mask_mod=None, block=BLOCK, **kw):
    return flex_attention(
        q, k, v, score_mod=score_mod, mask_mod=mask_mod, kv_blocks=block_lists(kinds),
        q_blocks=block_lists(np.swapaxes(kinds, -1, -2)), block_size=(block, block),
        softmax_scale=H**-0.5, **kw,
    )  # fmt: skip


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _close(got, want, tol=2e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)


def test_partial_blocks_apply_the_mask_mod_and_full_ones_do_not():
    q, k, v = _inputs()
    visible = _causal(*_grid())
    kinds = kinds_of(visible)
    assert {0, 1, 2} <= set(np.unique(kinds))
    _close(run(q, k, v, kinds, mask_mod=_causal), dense(q, k, v, visible=visible))
    # Every non-empty block called full: the mask_mod never runs, empty blocks stay skipped.
    full = np.where(kinds > 0, 2, 0).astype(np.int8)
    block_visible = np.repeat(np.repeat(full > 0, BLOCK, 2), BLOCK, 3)[:, :, :T, :S]
    _close(run(q, k, v, full, mask_mod=_causal), dense(q, k, v, visible=block_visible))


def _grads(fn, q, k, v, **kw):
    return jax.grad(lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, **kw))), argnums=(0, 1, 2))(q, k, v)


def test_tiles_smaller_than_the_blocks():
    """32 x 32 blocks walked by 16-row tiles (forward and both backward kernels)."""
    q, k, v = _inputs(5)
    visible = _causal(*_grid())
    tiles = FlexConfig(block_q=16, block_k=16)
    kw = dict(kinds=kinds_of(visible, 32), mask_mod=_causal, block=32, config=tiles,
              bwd_config=tiles)  # fmt: skip
    _close(run(q, k, v, **kw), dense(q, k, v, visible=visible))
    for g, w in zip(_grads(run, q, k, v, **kw), _grads(dense, q, k, v, visible=visible),
                    strict=True):  # fmt: skip
        _close(g, w, 1e-4)
    with pytest.raises(ValueError, match="block_q=64 must divide the block mask's blocks"):
        run(q, k, v, **dict(kw, config=FlexConfig(block_q=64, block_k=16)))


def test_blocks_left_out_of_the_lists_are_never_visited():
    q, k, v = _inputs(1)
    kinds = np.full((1, 1, TB, SB), 2, np.int8)
    kinds[0, 0, 1, 0] = 0  # query block 1 skips key block 0
    kinds[0, 0, 2, 2] = 0
    visible = np.ones((B, N, T, S), bool)
    visible[:, :, 16:32, :16] = False
    visible[:, :, 32:, 32:] = False
    _close(run(q, k, v, kinds), dense(q, k, v, visible=visible))

    got = _grads(run, q, k, v, kinds=kinds)
    want = _grads(dense, q, k, v, visible=visible)
    for g, w in zip(got, want, strict=True):
        _close(g, w, 1e-4)


def test_translated_arithmetic_matches_jax():
    """Integer division and remainder of negative numbers (rounding towards zero, as lax),
    floor division, where, powers, exp / sqrt / logistic, a 2-D gather of a capture."""
    table = jnp.asarray(np.random.default_rng(2).standard_normal((N, 9)), jnp.float32)
    flags = jnp.asarray([True, False, True, True])

    def score_mod(score, b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        x = jax.lax.div(d, 3).astype(jnp.float32) + jax.lax.rem(d, 4).astype(jnp.float32)
        x = x + (d // 5).astype(jnp.float32) + (d % 7).astype(jnp.float32) * 0.5
        x = x + table[h, jnp.clip(d, -4, 4) + 4] + jnp.where(flags[h], 0.3, -0.2)
        x = x + jnp.sqrt(jnp.abs(score) + 1.0) + jax.nn.sigmoid(score) - score**2 * 0.1
        return score + 0.1 * x + jnp.exp(-jnp.maximum(jnp.float32(b), 0.5))

    q, k, v = _inputs(3)
    kinds = np.full((1, 1, TB, SB), 2, np.int8)
    _close(run(q, k, v, kinds, score_mod=score_mod), dense(q, k, v, score_mod), 1e-4)


def test_translated_elementwise_functions_match_jax():
    def score_mod(score, b, h, q_idx, kv_idx):
        d = (q_idx - kv_idx).astype(jnp.float32)
        x = jax.lax.erf(score) + jnp.sin(d) * jnp.cos(score) + jnp.floor(d / 3) + jnp.ceil(d / 5)
        x = x + jnp.log1p(jnp.abs(score)) + jax.lax.rsqrt(d * d + 1.0) + jnp.exp2(-jnp.abs(d))
        x = x + jnp.sign(d) + jnp.clip(score, -0.5, 0.5) + 1.0 / (d * d + 2.0) ** 2
        odd = (q_idx % 2 == 1) ^ (kv_idx % 3 != 0)
        x = x + jnp.where(~odd & jnp.isfinite(score), jnp.minimum(score, d), jnp.square(d) * 0.01)
        return score + 0.1 * x

    q, k, v = _inputs(6)
    kinds = np.full((1, 1, TB, SB), 2, np.int8)
    _close(run(q, k, v, kinds, score_mod=score_mod), dense(q, k, v, score_mod), 1e-4)


def test_equal_mods_share_a_plan_and_different_ones_do_not():
    ids = jnp.arange(8, dtype=jnp.int32)

    def doc(ids):
        return lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx]

    plan, consts = plan_mods(None, doc(ids))
    again, other_consts = plan_mods(None, doc(ids[::-1]))  # new values, same function
    assert again is plan and len(consts) == len(other_consts) == 1
    assert "tl.load(ints +" in plan.source  # ids at a row or column: a pipelined load
    window, _ = plan_mods(None, lambda b, h, q_idx, kv_idx: q_idx - kv_idx < 3)
    shifted, _ = plan_mods(None, lambda b, h, q_idx, kv_idx: q_idx - kv_idx < 4)
    assert len({plan.key, window.key, shifted.key}) == 3
    score, _ = plan_mods(lambda s, b, h, q_idx, kv_idx: s * 2.0, None)
    assert "def dscore_fn" in score.source and "return 2.0" in score.source


def test_tile_gathers_read_outside_the_pipeline_and_rows_inside():
    """A captured array read at indices of both q_idx and kv_idx (a whole tile) goes through
    `flex_load`; one read at a row, a column or a head (ids, slopes) is a plain load."""
    table = jnp.zeros((2, 9), jnp.float32)
    slopes = jnp.ones((2,), jnp.float32)
    ids = jnp.arange(8, dtype=jnp.int32)

    def relative(s, b, h, q_idx, kv_idx):
        return s + table[h, jnp.clip(kv_idx - q_idx, -4, 4) + 4]

    def alibi(s, b, h, q_idx, kv_idx):
        return s - slopes[h] * jnp.abs(q_idx - kv_idx).astype(s.dtype)

    plan, _ = plan_mods(relative, lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx])
    score = plan.source.split("def dscore_fn")[0]
    mask = plan.source.split("def mask_fn")[1]
    assert "flex_load(floats +" in score and "tl.load(floats" not in score
    assert "tl.load(ints +" in mask and "flex_load(ints" not in mask
    plan, _ = plan_mods(alibi, None)
    assert "tl.load(floats +" in plan.source and "= flex_load(" not in plan.source


def test_unsupported_primitives_are_named():
    def popcount(b, h, q_idx, kv_idx):
        return jax.lax.population_count(q_idx) > 1

    with pytest.raises(Unsupported, match="primitive 'population_count'"):
        plan_mods(None, popcount)
    small = jnp.arange(4, dtype=jnp.int8)
    with pytest.raises(Unsupported, match="captured array of dtype int8"):
        plan_mods(None, lambda b, h, q_idx, kv_idx: small[h] > 1)
    with pytest.raises(Unsupported, match="array made inside the mod"):
        plan_mods(lambda s, b, h, q_idx, kv_idx: s + jnp.arange(4.0)[h], None)
    q, k, v = _inputs()
    reason = unsupported_flex_reason(q, k, v, None, popcount, (BLOCK, BLOCK))
    assert "population_count" in reason
    with pytest.raises(NotImplementedError, match="population_count"):
        run(q, k, v, np.full((1, 1, TB, SB), 1, np.int8), mask_mod=popcount)
    assert "q_block=8" in unsupported_flex_reason(q, k, v, None, None, (8, 16))
    ints = [x.astype(jnp.int32) for x in (q, k, v)]
    assert "int32" in unsupported_flex_reason(*ints, None, None, (16, 16))


def test_value_dims_and_empty_keys():
    q, k, v = _inputs(4, hv=8)
    kinds = np.full((1, 1, TB, SB), 2, np.int8)
    out, lse = run(q, k, v, kinds, return_lse=True)
    assert out.shape == (B, T, N, 8) and lse.shape == (B, N, T)
    _close(out, dense(q, k, v))
    empty = flex_attention(
        q, k[:, :0], v[:, :0], score_mod=None, mask_mod=None, kv_blocks=None, q_blocks=None,
        block_size=(16, 16), softmax_scale=1.0, return_lse=True,
    )  # fmt: skip
    assert not np.asarray(empty[0]).any() and np.isneginf(np.asarray(empty[1])).all()


@pytest.mark.parametrize("block_size", [(16, 16), (32, 16), (128, 64), (256, 256)])
@pytest.mark.parametrize(("head_dim", "itemsize"), [(16, 4), (128, 2), (256, 4)])
def test_search_spaces_divide_the_blocks_and_fit(block_size, head_dim, itemsize):
    """The autotuner's candidates: the heuristic first, every tile dividing the blocks it walks
    (the backward's both sides), the pipelined streamed tiles within shared memory."""
    from ejk_kernels_gpu.build._limits import SHARED_MEMORY_LIMIT, head_block
    from ejk_kernels_gpu.flex import bwd_heuristic, fwd_heuristic
    from ejk_kernels_gpu.flex._config import bwd_search_space, check_tiles, fwd_search_space

    for space, heuristic, role in (
        (fwd_search_space, fwd_heuristic, "forward"),
        (bwd_search_space, bwd_heuristic, "backward"),
    ):
        configs = space(block_size, head_dim, itemsize)
        assert configs[0] == heuristic(block_size, head_dim, itemsize)
        assert len(set(configs)) == len(configs) > 1
        for cfg in configs[1:]:
            check_tiles(cfg, block_size, role)
            width = 2 * head_block(head_dim) * itemsize
            assert cfg.num_stages * cfg.block_k * width <= SHARED_MEMORY_LIMIT
