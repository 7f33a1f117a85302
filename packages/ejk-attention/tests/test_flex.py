"""`flex_attention` and `create_block_mask`: against a dense float32 reference written here,
values and gradients (q, k, v and float captures), block tables, jit, errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import (
    BlockMask,
    and_masks,
    causal_mask,
    create_block_mask,
    document_mask,
    flash_attention,
    flex_attention,
    or_masks,
    prefix_lm_mask,
    sliding_window_mask,
)
from ejk_attention._flex import FLEX_IMPLEMENTATIONS
from ejk_attention.flex._request import validate_flex
from ejk_attention.flex._xla import xla_flex_attention
from ejk_sequtils import attention_tolerance, random_document_ids

# Pairwise-distinct sizes, so a swapped axis fails loudly; T and S are not multiples of
# the blocks below.
B, T, S, N, K, H, HV = 2, 19, 23, 6, 2, 8, 5
BLOCK = (8, 4)
HIGHEST = jax.lax.Precision.HIGHEST


def _qkv(dtype=jnp.float32, t=T, s=S, seed=0, hv=HV):
    rng = np.random.default_rng(seed)
    shapes = ((B, t, N, H), (B, s, K, H), (B, s, K, hv))
    return tuple(jnp.asarray(rng.standard_normal(x), dtype) for x in shapes)


def dense_reference(q, k, v, score_mod=None, mask_mod=None, softmax_scale=None):
    """Flex attention from its definition: the full ``[B, N, T, S]`` scores, the mods applied
    elementwise with `jnp.vectorize` over index grids, a softmax that empties rows to 0."""
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    b, t, n, h = q.shape
    s_len, kv_heads = k.shape[1:3]
    k = jnp.repeat(k, n // kv_heads, axis=2)  # query head i reads kv head i // (N // K)
    v = jnp.repeat(v, n // kv_heads, axis=2)
    scale = h**-0.5 if softmax_scale is None else softmax_scale
    scores = jnp.einsum("btnh,bsnh->bnts", q, k, precision=HIGHEST) * scale
    grid = jnp.meshgrid(*(jnp.arange(x, dtype=jnp.int32) for x in (b, n, t, s_len)), indexing="ij")
    if score_mod is not None:
        scores = jnp.vectorize(score_mod)(scores, *grid)
    visible = jnp.ones(scores.shape, bool) if mask_mod is None else jnp.vectorize(mask_mod)(*grid)
    scores = jnp.where(visible, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    e = jnp.exp(scores - row_max)
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(total > 0, total, 1.0)
    out = jnp.einsum("bnts,bsnd->btnd", p, v, precision=HIGHEST)
    lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + row_max, -jnp.inf)
    return out, lse[..., 0]


def _ids(rng, length):
    """Random document ids ``[B, length]``: documents of 4 to 10 tokens, 2 padding (-1) at the end."""
    return jnp.asarray(random_document_ids(rng, B, length, min_len=4, max_len=10, padding=2))


# Documents of the cases below: q_ids [B, T], kv_ids [B, S]; blocks of each kind occur.
Q_IDS = jnp.asarray([[0] * 16 + [-1] * 3, [0] * 5 + [1] * 11 + [2] * 3], jnp.int32)
KV_IDS = jnp.asarray([[0] * 12 + [1] * 8 + [-1] * 3, [0] * 5 + [1] * 13 + [2] * 5], jnp.int32)


def _case(name):
    """``(params, mods, block-mask B and N)``: ``mods(params)`` gives ``(score_mod, mask_mod)``,
    ``params`` holds the float arrays the score_mod captures (they get gradients)."""
    rng = np.random.default_rng(3)
    lengths = jnp.asarray([5, 11], jnp.int32)
    docs = and_masks(causal_mask, document_mask((Q_IDS, KV_IDS)))

    def alibi(p):
        def score_mod(s, b, h, q_idx, kv_idx):
            return s - p["slopes"][h] * jnp.abs(q_idx - kv_idx).astype(jnp.float32)

        return score_mod, causal_mask

    def soft_cap(p):
        def score_mod(s, b, h, q_idx, kv_idx):
            return 2.0 * jnp.tanh(s / 2.0)

        return score_mod, docs

    def relative_table(p):
        def score_mod(s, b, h, q_idx, kv_idx):
            return s + p["table"][h, kv_idx - q_idx + T - 1]

        return score_mod, sliding_window_mask((4, 2))

    def global_tokens(b, h, q_idx, kv_idx):  # a plain closure, not an ejk mod
        return kv_idx < 2

    def per_head(b, h, q_idx, kv_idx):
        return (q_idx + h) % 3 != kv_idx % 3

    cases = {
        "none": ({}, lambda p: (None, None), (None, None)),
        "causal": ({}, lambda p: (None, causal_mask), (None, None)),
        "documents": ({}, lambda p: (None, docs), (B, None)),
        "prefix_lm": ({}, lambda p: (None, prefix_lm_mask(lengths)), (B, None)),
        "window": ({}, lambda p: (None, sliding_window_mask((4, 2))), (None, None)),
        "alibi": ({"slopes": jnp.linspace(0.1, 0.8, N)}, alibi, (None, None)),
        "soft_cap": ({}, soft_cap, (B, None)),
        "relative_table": (
            {"table": jnp.asarray(rng.standard_normal((N, T + S - 1)), jnp.float32)},
            relative_table,
            (None, None),
        ),
        "and_or": (
            {},
            lambda p: (
                None,
                or_masks(and_masks(causal_mask, sliding_window_mask((3, 0))), global_tokens),
            ),
            (None, None),
        ),
        "per_head": ({}, lambda p: (None, and_masks(per_head, causal_mask)), (None, N)),
    }
    return cases[name]


CASES = [
    "none",
    "causal",
    "documents",
    "prefix_lm",
    "window",
    "alibi",
    "soft_cap",
    "relative_table",
    "and_or",
    "per_head",
]


def _block_mask(mask_mod, sizes, t=T, s=S, block_size=BLOCK):
    if mask_mod is None:
        return None
    return create_block_mask(mask_mod, *sizes, t, s, block_size=block_size)


def _loss_and_grads(fn, q, k, v, params):
    """``fn``'s output and the gradients of ``sum(out * w)`` w.r.t. q, k, v and ``params``."""
    w = jnp.asarray(np.random.default_rng(9).standard_normal((*q.shape[:3], HV)), jnp.float32)

    def loss(q, k, v, params):
        out = fn(q, k, v, params)
        return jnp.sum(out.astype(jnp.float32) * w), out

    # Under jit: one compiled function instead of many eager ops (flex runs eagerly elsewhere).
    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, out), grads = grad_fn(q, k, v, params)
    return out, grads


def _assert_close(actual, expected, tol, what):
    np.testing.assert_allclose(
        np.asarray(actual, np.float32),
        np.asarray(expected, np.float32),
        rtol=tol,
        atol=tol,
        err_msg=what,
    )


@pytest.mark.parametrize("case", CASES)
def test_matches_dense_reference(case):
    params, mods, sizes = _case(case)
    q, k, v = _qkv()

    def flex(q, k, v, params):
        score_mod, mask_mod = mods(params)
        return flex_attention(q, k, v, score_mod, _block_mask(mask_mod, sizes))

    def dense(q, k, v, params):
        return dense_reference(q, k, v, *mods(params))[0]

    out, grads = _loss_and_grads(flex, q, k, v, params)
    want, want_grads = _loss_and_grads(dense, q, k, v, params)
    assert out.shape == (B, T, N, HV) and out.dtype == q.dtype
    _assert_close(out, want, attention_tolerance(q.dtype), "out")
    grad_tol = attention_tolerance(q.dtype, "grad")
    for name, got, expected in zip(("dq", "dk", "dv"), grads[:3], want_grads[:3], strict=True):
        assert got.shape == expected.shape
        _assert_close(got, expected, grad_tol, name)
    for name in params:  # a float capture of the score_mod: its gradient too
        assert np.abs(want_grads[3][name]).max() > 0
        _assert_close(grads[3][name], want_grads[3][name], grad_tol, f"d{name}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtypes_gqa_alibi_documents(dtype):
    params, mods, _ = _case("alibi")
    rng = np.random.default_rng(4)
    mask_mod = and_masks(causal_mask, document_mask((_ids(rng, T), _ids(rng, S))))
    q, k, v = _qkv(dtype)
    score_mod = mods(params)[0]
    block_mask = create_block_mask(mask_mod, B, None, T, S, block_size=BLOCK)

    out, grads = _loss_and_grads(
        lambda q, k, v, p: flex_attention(q, k, v, score_mod, block_mask), q, k, v, {}
    )
    # The reference on the same (rounded) inputs, upcast.
    up = tuple(x.astype(jnp.float32) for x in (q, k, v))
    want, want_grads = _loss_and_grads(
        lambda q, k, v, p: dense_reference(q, k, v, score_mod, mask_mod)[0], *up, {}
    )
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads[:3])
    _assert_close(out, want, attention_tolerance(dtype), "out")
    for name, got, expected in zip(("dq", "dk", "dv"), grads[:3], want_grads[:3], strict=True):
        _assert_close(got, expected, attention_tolerance(dtype, "grad"), name)


def test_lse_and_scale_with_gradients_through_lse():
    q, k, v = _qkv()
    mask_mod = prefix_lm_mask(jnp.asarray([5, 11]))
    block_mask = _block_mask(mask_mod, (B, None))

    def flex(q, k, v):
        return flex_attention(q, k, v, block_mask=block_mask, softmax_scale=0.3, return_lse=True)

    def dense(q, k, v):
        return dense_reference(q, k, v, mask_mod=mask_mod, softmax_scale=0.3)

    (out, lse), flex_vjp = jax.vjp(flex, q, k, v)
    (want, want_lse), dense_vjp = jax.vjp(dense, q, k, v)
    assert lse.shape == (B, N, T) and lse.dtype == jnp.float32
    tol = attention_tolerance(jnp.float32, "lse")
    _assert_close(out, want, tol, "out")
    _assert_close(lse, want_lse, tol, "lse")
    d_lse = jnp.asarray(np.random.default_rng(2).standard_normal(lse.shape), jnp.float32)
    cotangents = (jnp.zeros_like(out), d_lse)  # the gradient through lse alone
    for name, got, expected in zip(
        ("dq", "dk", "dv"), flex_vjp(cotangents), dense_vjp(cotangents), strict=True
    ):
        _assert_close(got, expected, attention_tolerance(jnp.float32, "grad"), name)


def test_fully_masked_rows_give_zeros_and_zero_gradients():
    """Rows 0..2 see no key (the mask empties them), padding rows (-1 ids) neither: zeros,
    lse -inf, zero gradients, no NaN anywhere; with a score_mod and under GQA."""
    rng = np.random.default_rng(5)
    q_ids = _ids(rng, T).at[:, -3:].set(-1)
    documents = document_mask((q_ids, _ids(rng, S)))

    def late_rows(b, h, q_idx, kv_idx):
        return q_idx >= 3

    mask_mod = and_masks(late_rows, documents)
    block_mask = create_block_mask(mask_mod, B, None, T, S, block_size=BLOCK)

    def score_mod(s, b, h, q_idx, kv_idx):
        return s * 0.5 - 0.1 * kv_idx

    q, k, v = _qkv()
    (out, lse), vjp = jax.vjp(
        lambda q, k, v: flex_attention(q, k, v, score_mod, block_mask, return_lse=True), q, k, v
    )
    dq, dk, dv = vjp((jnp.ones_like(out), jnp.ones_like(lse)))
    empty = ~np.asarray(
        jnp.vectorize(mask_mod)(
            *jnp.meshgrid(*(jnp.arange(x) for x in (B, N, T, S)), indexing="ij")
        )
    ).any(axis=-1)  # [B, N, T]
    assert empty[:, :, :3].all() and empty[:, :, -3:].all()
    empty_btn = np.moveaxis(empty, 1, 2)
    assert np.all(np.asarray(out)[empty_btn] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[empty]))
    assert np.all(np.asarray(dq)[empty_btn] == 0)
    for g in (out, dq, dk, dv):
        assert np.isfinite(np.asarray(g)).all()
    want, _ = dense_reference(q, k, v, score_mod, mask_mod)
    _assert_close(out, want, attention_tolerance(jnp.float32), "out")


def test_chunked_path_matches_one_chunk():
    """Query chunks of 4 rows (4 full chunks and a remainder of 3): same values and gradients."""
    params, mods, sizes = _case("relative_table")
    q, k, v = _qkv()

    def flex(q, k, v, params, max_scores):
        score_mod, mask_mod = mods(params)
        request = validate_flex(
            q, k, v, score_mod, _block_mask(mask_mod, sizes), softmax_scale=None, return_lse=False
        )
        return xla_flex_attention(request, max_scores=max_scores)

    small = 4 * B * N * S  # four query rows per chunk
    out, grads = _loss_and_grads(lambda *a: flex(*a, small), q, k, v, params)
    want, want_grads = _loss_and_grads(lambda *a: flex(*a, 1 << 30), q, k, v, params)
    tol = attention_tolerance(jnp.float32)
    _assert_close(out, want, tol, "out")
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        _assert_close(got, expected, attention_tolerance(jnp.float32, "grad"), "grads")


def test_under_jit_with_traced_ids_and_one_trace_for_new_ids():
    q, k, v = _qkv()
    rng = np.random.default_rng(6)

    @jax.jit
    def built_inside(q, k, v, q_ids, kv_ids):
        mask_mod = and_masks(causal_mask, document_mask((q_ids, kv_ids)))
        block_mask = create_block_mask(mask_mod, B, None, T, S, block_size=BLOCK)
        return flex_attention(q, k, v, block_mask=block_mask)

    traces = []

    @jax.jit
    def passed_in(q, k, v, block_mask):
        traces.append(1)
        return flex_attention(q, k, v, block_mask=block_mask)

    for _ in range(2):  # new ids every batch
        q_ids, kv_ids = _ids(rng, T), _ids(rng, S)
        mask_mod = and_masks(causal_mask, document_mask((q_ids, kv_ids)))
        want, _ = dense_reference(q, k, v, mask_mod=mask_mod)
        tol = attention_tolerance(jnp.float32)
        _assert_close(built_inside(q, k, v, q_ids, kv_ids), want, tol, "built inside jit")
        block_mask = create_block_mask(mask_mod, B, None, T, S, block_size=BLOCK)
        _assert_close(passed_in(q, k, v, block_mask), want, tol, "passed into jit")
    assert len(traces) == 1  # the ids are leaves of the BlockMask, not part of its static key


def test_block_mask_is_a_pytree_built_and_returned_by_jit():
    rng = np.random.default_rng(7)
    ids = _ids(rng, T)
    made = jax.jit(
        lambda ids: create_block_mask(document_mask(ids), B, None, T, T, block_size=BLOCK)
    )
    block_mask = made(ids)
    eager = create_block_mask(document_mask(ids), B, None, T, T, block_size=BLOCK)
    assert isinstance(block_mask, BlockMask)
    np.testing.assert_array_equal(block_mask.kinds, eager.kinds)
    leaves, treedef = jax.tree.flatten(block_mask)
    assert any(leaf is ids or np.array_equal(leaf, ids) for leaf in leaves)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt.shape == (B, None, T, T) and rebuilt.block_size == BLOCK

    def closure(b, h, q_idx, kv_idx):  # a user's closure: static in the pytree
        return (ids[b, q_idx] == ids[b, kv_idx]) & (ids[b, q_idx] >= 0)

    static = create_block_mask(closure, B, None, T, T, block_size=BLOCK)
    np.testing.assert_array_equal(static.kinds, eager.kinds)
    q, k, v = _qkv(s=T)
    out = jax.jit(lambda bm: flex_attention(q, k, v, block_mask=bm))(static)
    want, _ = dense_reference(q, k, v, mask_mod=closure)
    _assert_close(out, want, attention_tolerance(jnp.float32), "out")


def test_long_sequences_are_never_held_whole():
    """Compiled, not run: the tables at T = S = 128k and a forward+backward at 16k hold a small
    part of the ``T x S`` mask or ``[B, N, T, S]`` scores."""
    long = 1 << 17
    ids = jax.ShapeDtypeStruct((1, long), jnp.int32)

    def tables(ids):
        mask_mod = and_masks(causal_mask, document_mask(ids))
        return create_block_mask(mask_mod, 1, None, long, long).kinds

    memory = jax.jit(tables).lower(ids).compile().memory_analysis()
    assert memory.temp_size_in_bytes < (long * long) // 64  # the bool mask: 16 GiB

    t, heads = 1 << 14, 4
    q = jax.ShapeDtypeStruct((1, t, heads, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, t, 2, 64), jnp.bfloat16)

    def loss(q, k, v, ids):
        block_mask = create_block_mask(document_mask(ids), 1, None, t, t)
        return jnp.sum(flex_attention(q, k, v, block_mask=block_mask).astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    ids = jax.ShapeDtypeStruct((1, t), jnp.int32)
    memory = grad.lower(q, k, k, ids).compile().memory_analysis()
    assert memory.temp_size_in_bytes < (heads * t * t * 4) // 4  # float32 scores: 4 GiB


def _dense_kinds(mask_mod, batch, heads, t, s, block_size):
    """Block kinds from the dense mask, reduced block by block in NumPy."""
    grid = np.meshgrid(*(np.arange(x) for x in (batch, heads, t, s)), indexing="ij")
    dense = np.asarray(jnp.vectorize(mask_mod)(*(jnp.asarray(g, jnp.int32) for g in grid)))
    qb, kb = block_size
    kinds = np.zeros((batch, heads, -(-t // qb), -(-s // kb)), np.int8)
    for i in range(kinds.shape[2]):
        for j in range(kinds.shape[3]):
            block = dense[:, :, i * qb : (i + 1) * qb, j * kb : (j + 1) * kb]
            kinds[:, :, i, j] = np.where(block.all((2, 3)), 2, np.where(block.any((2, 3)), 1, 0))
    return kinds


@pytest.mark.parametrize(
    ("case", "sizes"),
    [("documents", (B, None)), ("per_head", (None, N)), ("and_or", (None, None))],
)
def test_block_tables_match_the_dense_mask(case, sizes, monkeypatch):
    params, mods, _ = _case(case)
    mask_mod = mods(params)[1]
    block_mask = create_block_mask(mask_mod, *sizes, T, S, block_size=BLOCK)
    want = _dense_kinds(mask_mod, sizes[0] or 1, sizes[1] or 1, T, S, BLOCK)
    assert block_mask.kinds.dtype == jnp.int8
    np.testing.assert_array_equal(block_mask.kinds, want)
    assert {0, 1, 2} <= set(np.unique(want)) or case != "documents"
    # Built a few elements at a time (several map steps and a remainder): the same tables.
    from ejk_attention.flex import _block_mask

    monkeypatch.setattr(_block_mask, "_MAX_ELEMENTS", 3 * BLOCK[0] * 24)
    small_steps = create_block_mask(mask_mod, *sizes, T, S, block_size=BLOCK)
    np.testing.assert_array_equal(small_steps.kinds, want)
    # The index tables list each row's partial and full blocks, ascending.
    for indices, kinds in (
        (block_mask.kv_blocks(), want),
        (block_mask.q_blocks(), want.swapaxes(2, 3)),
    ):
        for kind, num, idx in (
            (1, indices.partial_num, indices.partial_indices),
            (2, indices.full_num, indices.full_indices),
        ):
            num, idx = np.asarray(num), np.asarray(idx)
            for pos in np.ndindex(kinds.shape[:3]):
                hits = np.flatnonzero(kinds[pos] == kind)
                assert num[pos] == len(hits)
                np.testing.assert_array_equal(idx[pos][: num[pos]], hits)


def test_sparsity_counts_visited_blocks():
    block_mask = create_block_mask(causal_mask, None, None, 32, 32, block_size=8)
    # 4 x 4 blocks: 4 on the diagonal partial, 6 below full, 6 above empty.
    np.testing.assert_array_equal(
        block_mask.kinds[0, 0], np.tril(np.full((4, 4), 2)) - np.eye(4, dtype=int)
    )
    assert float(block_mask.density()) == pytest.approx(10 / 16)
    assert float(block_mask.sparsity()) == pytest.approx(6 / 16)
    assert float(create_block_mask(causal_mask, None, None, 32, 32).sparsity()) == 0.0


@pytest.mark.parametrize("case", ["causal", "window", "segments", "soft_cap"])
def test_equals_flash_attention(case):
    """The same mask given as a mask_mod and as flash_attention's built-in option."""
    rng = np.random.default_rng(8)
    q_ids, kv_ids = _ids(rng, T), _ids(rng, S)
    score_mod = None
    if case == "causal":
        mask_mod, kw = causal_mask, {"causal": True}
    elif case == "window":
        mask_mod, kw = sliding_window_mask((4, 2)), {"sliding_window": (4, 2)}
    elif case == "segments":
        mask_mod, kw = document_mask((q_ids, kv_ids)), {"segment_ids": (q_ids, kv_ids)}
    else:
        mask_mod, kw = causal_mask, {"causal": True, "logits_soft_cap": 2.0}

        def score_mod(s, b, h, q_idx, kv_idx):
            return 2.0 * jnp.tanh(s / 2.0)

    q, k, v = _qkv()
    block_mask = create_block_mask(mask_mod, B, None, T, S, block_size=BLOCK)
    out, lse = flex_attention(q, k, v, score_mod, block_mask, return_lse=True)
    want, want_lse = flash_attention(q, k, v, return_lse=True, implementation="xla", **kw)
    tol = attention_tolerance(jnp.float32)
    _assert_close(out, want, tol, "out")
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    _assert_close(np.asarray(lse)[finite], np.asarray(want_lse)[finite], tol, "lse")


def test_empty_key_axis_gives_zeros():
    q, k, v = _qkv(s=0)
    block_mask = create_block_mask(causal_mask, None, None, T, 0, block_size=BLOCK)
    assert block_mask.kinds.shape == (1, 1, 3, 0)
    out = flex_attention(q, k, v, block_mask=block_mask)
    assert out.shape == (B, T, N, HV) and not np.asarray(out).any()


def test_implementations():
    q, k, v = _qkv()
    assert FLEX_IMPLEMENTATIONS == ("xla", "triton", "pallas", "cudnn")
    want = flex_attention(q, k, v)
    np.testing.assert_array_equal(flex_attention(q, k, v, implementation="xla"), want)
    # A kernel that refuses hands the call on to the next name (triton's flex kernels:
    # blocks of (8, 4); ejk's own masks alone would run on its built-in kernels).
    mask = create_block_mask(prefix_lm_mask(3), None, None, T, S, block_size=BLOCK)
    want = flex_attention(q, k, v, block_mask=mask, implementation="xla")
    got = flex_attention(q, k, v, block_mask=mask, implementation=("triton", "xla"))
    np.testing.assert_array_equal(got, want)
    with pytest.raises(NotImplementedError, match="powers of two in \\[16, 256\\]"):
        flex_attention(q, k, v, block_mask=mask, implementation="triton")
    with pytest.raises(NotImplementedError, match="head_dim 5 == q's 8"):
        flex_attention(q, k, v, implementation="pallas")  # the kernels need Hv == H
    with pytest.raises(ValueError, match="implementation must be one of"):
        flex_attention(q, k, v, implementation="bogus")


@pytest.mark.parametrize(
    ("platform", "order"),
    [("gpu", ("triton", "xla")), ("tpu", ("pallas", "xla")), ("cpu", ("xla",))],
)
def test_dispatch_through_the_backends_flex_parts(monkeypatch, platform, order):
    """``implementation=None`` tries each `BACKENDS` object's flex part in the platform's
    order (cudnn has none: ``absent`` says why), each refusal handing the call on."""
    from ejk_attention import _backends, _flex

    tried = []

    class Refuses(_backends.Backend):
        def __init__(self, name):
            self.name = name

        def supported(self, request, platform):
            tried.append(self.name)
            return f"{self.name} refuses in this test"

    xla = _backends.BACKENDS["xla"].flex
    real_supported = type(xla).supported
    monkeypatch.setattr(_flex, "platform_of", lambda request: platform)
    for name in ("triton", "pallas"):
        monkeypatch.setattr(_backends.BACKENDS[name], "flex", Refuses(name))
    monkeypatch.setattr(
        xla, "supported", lambda r, p: tried.append("xla") or real_supported(xla, r, p)
    )
    q, k, v = _qkv()
    np.testing.assert_array_equal(
        flex_attention(q, k, v), flex_attention(q, k, v, implementation="xla")
    )
    assert tuple(tried[: len(order)]) == order
    assert _backends.flex_order(platform) == order
    assert _backends.BACKENDS["cudnn"].flex is None
    with pytest.raises(NotImplementedError, match="pallas refuses in this test; xla: boom"):
        monkeypatch.setattr(xla, "supported", lambda r, p: "boom")
        flex_attention(q, k, v, implementation=("pallas", "xla"))


def test_implementation_names_follow_the_backends():
    from ejk_attention import IMPLEMENTATIONS

    q, k, v = _qkv()
    assert FLEX_IMPLEMENTATIONS == IMPLEMENTATIONS
    with pytest.raises(NotImplementedError, match=r"cudnn.*takes no mask_mod or score_mod"):
        flex_attention(q, k, v, implementation="cudnn")
    want = flex_attention(q, k, v, implementation="xla")
    np.testing.assert_array_equal(flex_attention(q, k, v, implementation=("cudnn", "xla")), want)


def test_pallas_takes_one_config():
    """The Pallas kernels' config holds the forward and backward blocks: two different
    ones are refused, naming both arguments."""
    from ejk_kernels_tpu import BlockSparseConfig

    q, k, v = _qkv(hv=H)
    with pytest.raises(ValueError, match=r"pass one config, got config=.* and bwd_config="):
        flex_attention(q, k, v, implementation="pallas", config=BlockSparseConfig(),
                       bwd_config=BlockSparseConfig(block_q=256))  # fmt: skip


# The Pallas backend (ejk_kernels_tpu's block-sparse kernels, in Pallas' TPU interpreter
# here): mask_mods evaluated in the kernel, the BlockMask tables as its block tables.
MASK_CASES = ["none", "causal", "documents", "prefix_lm", "window", "and_or", "per_head"]


def _pallas_vs_dense(mask_mod, sizes, *, t=T, s=S, block_size=BLOCK, config=None, seed=0):
    """Values, lse and gradients (through both) of the pallas backend against the dense
    reference; the kernels need Hv == H."""
    q, k, v = _qkv(t=t, s=s, seed=seed, hv=H)
    block_mask = _block_mask(mask_mod, sizes, t, s, block_size)

    def pallas(q, k, v):
        return flex_attention(
            q, k, v, block_mask=block_mask, return_lse=True, implementation="pallas", config=config
        )

    (out, lse), pallas_vjp = jax.vjp(pallas, q, k, v)
    (want, want_lse), dense_vjp = jax.vjp(
        lambda *a: dense_reference(*a, mask_mod=mask_mod), q, k, v
    )
    assert out.shape == (B, t, N, H) and out.dtype == q.dtype and lse.shape == (B, N, t)
    tol = attention_tolerance(jnp.float32)
    _assert_close(out, want, tol, "out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    _assert_close(
        jnp.where(jnp.isinf(lse), 0, lse), jnp.where(jnp.isinf(want_lse), 0, want_lse), tol, "lse"
    )
    rng = np.random.default_rng(seed + 1)
    cotangents = tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (out, lse))
    grad_tol = attention_tolerance(jnp.float32, "grad")
    for name, got, expected in zip(
        ("dq", "dk", "dv"), pallas_vjp(cotangents), dense_vjp(cotangents), strict=True
    ):
        _assert_close(got, expected, grad_tol, name)
    return out, lse


@pytest.mark.parametrize("case", MASK_CASES)
def test_pallas_matches_dense_reference(case):
    """GQA (6 query heads on 2), T = 19 and S = 23 in one padded kernel block per axis,
    tables per batch row (documents, prefix-LM), per head (per_head) or shared."""
    _, mods, sizes = _case(case)
    _pallas_vs_dense(mods({})[1], sizes)


@pytest.mark.slow
def test_pallas_skips_empty_blocks_across_many_blocks():
    """T = 300 and S = 280 (not multiples of the kernels' 128 blocks): empty, partial and
    full blocks all occur; mask blocks of 32 and of (256, 32) are re-cut to the kernels'."""
    rng = np.random.default_rng(11)
    t, s = 300, 280
    ids = jnp.asarray(random_document_ids(rng, B, t, min_len=60, max_len=150, padding=20))
    documents = and_masks(causal_mask, document_mask(ids))
    block_mask = create_block_mask(documents, B, None, t, t, block_size=32)
    assert set(np.unique(np.asarray(block_mask.kinds))) == {0, 1, 2}  # every kind occurs
    _pallas_vs_dense(documents, (B, None), t=t, s=t, block_size=32)
    window = and_masks(causal_mask, sliding_window_mask((100, 0)))
    _pallas_vs_dense(window, (None, None), t=t, s=s, block_size=(256, 32))


def test_pallas_fully_masked_rows_give_zeros_and_zero_gradients():
    rng = np.random.default_rng(5)
    q_ids = _ids(rng, T).at[:, -3:].set(-1)

    def late_rows(b, h, q_idx, kv_idx):
        return q_idx >= 3

    mask_mod = and_masks(late_rows, document_mask((q_ids, _ids(rng, S))))
    block_mask = create_block_mask(mask_mod, B, None, T, S, block_size=BLOCK)
    q, k, v = _qkv(hv=H)
    (out, lse), vjp = jax.vjp(
        lambda q, k, v: flex_attention(
            q, k, v, block_mask=block_mask, return_lse=True, implementation="pallas"
        ),
        q,
        k,
        v,
    )
    dq, dk, dv = vjp((jnp.ones_like(out), jnp.ones_like(lse)))
    for rows in (slice(0, 3), slice(T - 3, T)):
        assert not np.asarray(out)[:, rows].any() and not np.asarray(dq)[:, rows].any()
        assert np.isneginf(np.asarray(lse)[:, :, rows]).all()
    for g in (out, dq, dk, dv):
        assert np.isfinite(np.asarray(g)).all()


def test_pallas_under_jit_with_traced_ids():
    q, k, v = _qkv(hv=H)
    rng = np.random.default_rng(6)

    @jax.jit
    def built_inside(q, k, v, q_ids, kv_ids):
        mask_mod = and_masks(causal_mask, document_mask((q_ids, kv_ids)))
        block_mask = create_block_mask(mask_mod, B, None, T, S, block_size=BLOCK)
        return flex_attention(q, k, v, block_mask=block_mask, implementation="pallas")

    q_ids, kv_ids = _ids(rng, T), _ids(rng, S)
    want, _ = dense_reference(
        q, k, v, mask_mod=and_masks(causal_mask, document_mask((q_ids, kv_ids)))
    )
    _assert_close(
        built_inside(q, k, v, q_ids, kv_ids), want, attention_tolerance(jnp.float32), "out"
    )


# Score_mods on the Pallas backend: applied in the forward, dq and dk/dv kernels; the float
# captures' gradients from the XLA pass every flex backend shares.
SCORE_CASES = ["alibi", "soft_cap", "relative_table"]


def _pallas_mods_vs_dense(params, mods, sizes, dtype=jnp.float32, *, t=T, s=S, seed=0):
    """Values, lse and gradients (q, k, v and the score_mod's float captures ``params``, through
    out and lse) of the pallas backend against the dense reference on the same (rounded)
    inputs, upcast; the kernels need Hv == H."""
    q, k, v = _qkv(dtype, t=t, s=s, seed=seed, hv=H)
    block_mask = _block_mask(mods(params)[1], sizes, t, s)

    def pallas(q, k, v, params):
        score_mod, _ = mods(params)
        return flex_attention(
            q, k, v, score_mod, block_mask, return_lse=True, implementation="pallas"
        )

    def dense(q, k, v, params):
        return dense_reference(q, k, v, *mods(params))

    (out, lse), pallas_vjp = jax.vjp(pallas, q, k, v, params)
    up = tuple(x.astype(jnp.float32) for x in (q, k, v))
    (want, want_lse), dense_vjp = jax.vjp(dense, *up, params)
    assert out.shape == (B, t, N, H) and out.dtype == dtype and lse.shape == (B, N, t)
    _assert_close(out, want, attention_tolerance(dtype), "out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = lambda x: jnp.where(jnp.isinf(x), 0, x)
    _assert_close(finite(lse), finite(want_lse), attention_tolerance(dtype, "lse"), "lse")
    rng = np.random.default_rng(seed + 1)
    cotangents = (
        jnp.asarray(rng.standard_normal(out.shape), dtype),
        jnp.asarray(rng.standard_normal(lse.shape), jnp.float32),
    )
    got, expected = (
        pallas_vjp(cotangents),
        dense_vjp((cotangents[0].astype(jnp.float32), cotangents[1])),
    )
    grad_tol = attention_tolerance(dtype, "grad")
    for name, g, e in zip(("dq", "dk", "dv"), got[:3], expected[:3], strict=True):
        assert g.dtype == dtype, name
        _assert_close(g, e, grad_tol, name)
    for name in params:  # a float capture of the score_mod: its gradient too
        assert np.abs(expected[3][name]).max() > 0
        _assert_close(got[3][name], expected[3][name], grad_tol, f"d{name}")
    return out, lse


@pytest.mark.parametrize("case", SCORE_CASES)
def test_pallas_score_mods_match_dense_reference(case):
    """ALiBi (captured per-head slopes, causal), a tanh soft cap (causal documents, block
    tables per batch row) and a learned relative-position table (``table[h, kv_idx - q_idx +
    T - 1]``, looked up on the tile; sliding window): GQA 6 on 2, T = 19 and S = 23 padded
    to the kernels' blocks."""
    params, mods, sizes = _case(case)
    _pallas_mods_vs_dense(params, mods, sizes)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_alibi_soft_cap_and_documents_in_dtypes(dtype):
    """A score_mod with a capture per head and one per key, and a tanh, under causal
    documents; in float32 and bfloat16."""
    rng = np.random.default_rng(4)
    docs = and_masks(causal_mask, document_mask((_ids(rng, T), _ids(rng, S))))
    params = {
        "slopes": jnp.linspace(0.1, 0.8, N),
        "bias": jnp.asarray(rng.standard_normal((B, S)), jnp.float32),
    }

    def mods(p):
        def score_mod(s, b, h, q_idx, kv_idx):
            s = s - p["slopes"][h] * jnp.abs(q_idx - kv_idx).astype(jnp.float32)
            return 5.0 * jnp.tanh((s + p["bias"][b, kv_idx]) / 5.0)

        return score_mod, docs

    _pallas_mods_vs_dense(params, mods, (B, None), dtype, seed=2)


def test_pallas_score_mod_without_a_block_mask():
    """No mask: the padding of T = 19 and S = 23 is still hidden from the score_mod's rows."""
    params = {"slopes": jnp.linspace(0.2, 0.9, N)}

    def mods(p):
        def score_mod(s, b, h, q_idx, kv_idx):
            return s + p["slopes"][h] * jnp.cos(q_idx * 0.3 + kv_idx).astype(jnp.float32)

        return score_mod, None

    _pallas_mods_vs_dense(params, mods, (None, None), seed=3)


@pytest.mark.slow
def test_pallas_score_mod_across_many_blocks():
    """T = 300, S = 280 (not multiples of the kernels' 128 blocks), ALiBi under causal
    documents whose blocks are empty, partial and full, re-cut from mask blocks of 32."""
    rng = np.random.default_rng(12)
    t = 300
    ids = jnp.asarray(random_document_ids(rng, B, t, min_len=60, max_len=150, padding=20))
    documents = and_masks(causal_mask, document_mask(ids))
    params, alibi, _ = _case("alibi")
    mods = lambda p: (alibi(p)[0], documents)
    block_mask = create_block_mask(documents, B, None, t, t, block_size=32)
    assert set(np.unique(np.asarray(block_mask.kinds))) == {0, 1, 2}
    _pallas_mods_vs_dense(params, mods, (B, None), t=t, s=t)


def test_pallas_score_mod_fully_masked_rows_give_zeros_and_zero_gradients():
    """Rows the mask empties, under a score_mod whose slope is infinite at some hidden scores
    (log of a score made 0): zeros, lse -inf and finite, zero gradients there."""
    rng = np.random.default_rng(5)
    q_ids = _ids(rng, T).at[:, -3:].set(-1)

    def late_rows(b, h, q_idx, kv_idx):
        return (q_idx >= 3) & (kv_idx != 1)

    mask_mod = and_masks(late_rows, document_mask((q_ids, _ids(rng, S))))
    block_mask = create_block_mask(mask_mod, B, None, T, S, block_size=BLOCK)
    slopes = jnp.linspace(0.1, 0.6, N)

    def pallas(q, k, v, slopes):
        def score_mod(s, b, h, q_idx, kv_idx):
            # At the hidden key 1 the score is 0 and log's slope infinite.
            s = jnp.where(kv_idx == 1, 0.0, jnp.abs(s) + 1.0)
            return jnp.log(s) - slopes[h] * kv_idx.astype(jnp.float32)

        return flex_attention(
            q, k, v, score_mod, block_mask, return_lse=True, implementation="pallas"
        )

    q, k, v = _qkv(hv=H)
    (out, lse), vjp = jax.vjp(pallas, q, k, v, slopes)
    dq, dk, dv, dslopes = vjp((jnp.ones_like(out), jnp.ones_like(lse)))
    for rows in (slice(0, 3), slice(T - 3, T)):
        assert not np.asarray(out)[:, rows].any() and not np.asarray(dq)[:, rows].any()
        assert np.isneginf(np.asarray(lse)[:, :, rows]).all()
    for g in (out, dq, dk, dv, dslopes):
        assert np.isfinite(np.asarray(g)).all()
    assert not np.asarray(dk)[:, 1].any() and not np.asarray(dv)[:, 1].any()


def test_pallas_score_mod_under_jit_with_traced_captures():
    """Slopes and a relative table traced by ``jit`` (and differentiated): one compiled
    gradient, equal to the xla backend's."""
    q, k, v = _qkv(hv=H)
    params = {
        "slopes": jnp.linspace(0.1, 0.8, N),
        "table": jnp.asarray(np.random.default_rng(8).standard_normal((N, 9)), jnp.float32),
    }
    block_mask = _block_mask(causal_mask, (None, None))

    def loss(implementation, q, params):
        def score_mod(s, b, h, q_idx, kv_idx):
            rel = jnp.clip(q_idx - kv_idx, 0, 8)
            s = s - params["slopes"][h] * rel.astype(jnp.float32)
            return s + params["table"][h, rel]

        out = flex_attention(q, k, v, score_mod, block_mask, implementation=implementation)
        return jnp.sum(out * out)

    got = jax.jit(jax.grad(functools.partial(loss, "pallas"), (0, 1)))(q, params)
    want = jax.grad(functools.partial(loss, "xla"), (0, 1))(q, params)
    grad_tol = attention_tolerance(jnp.float32, "grad")
    _assert_close(got[0], want[0], grad_tol, "dq")
    for name in params:
        _assert_close(got[1][name], want[1][name], grad_tol, f"d{name}")


def test_pallas_refusals_fall_through_to_xla():
    """A score_mod reading a captured [T, S] bias at (q_idx, kv_idx) (a table read along two
    tile axes) is refused naming the mod and the read; ("pallas", "xla") then serves it,
    gradients too."""
    q, k, v = _qkv(hv=H)
    params = {"bias": jnp.asarray(np.random.default_rng(7).standard_normal((T, S)), jnp.float32)}

    def mods(p):
        def dense_bias(s, b, h, q_idx, kv_idx):
            return s + p["bias"][q_idx, kv_idx]

        return dense_bias, causal_mask

    block_mask = _block_mask(causal_mask, (None, None))
    with pytest.raises(
        NotImplementedError,
        match=r"score_mod 'dense_bias'.*dynamic_slice reads an array of shape \(19, 23\).*"
        r"depends on both q_idx and kv_idx along two axes",
    ):
        flex_attention(q, k, v, mods(params)[0], block_mask, implementation="pallas")

    def flex(implementation, q, params):
        return flex_attention(
            q, k, v, mods(params)[0], block_mask, implementation=implementation
        ).sum()

    want = jax.grad(functools.partial(flex, "xla"), (0, 1))(q, params)
    got = jax.grad(functools.partial(flex, ("pallas", "xla")), (0, 1))(q, params)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1]["bias"], want[1]["bias"])
    ids = jnp.zeros((B, T), jnp.int32)

    def per_batch_relative(b, h, q_idx, kv_idx):  # a per-batch row read at q_idx - kv_idx
        return ids[b][q_idx - kv_idx + T - 1] == 0

    block_mask = _block_mask(per_batch_relative, (B, None))
    with pytest.raises(
        NotImplementedError, match=r"mask_mod 'per_batch_relative'.*itself depends on b"
    ):
        flex_attention(q, k, v, block_mask=block_mask, implementation="pallas")


# Errors: each names the function, the argument or mod, and the value.


def _mask_int(b, h, q_idx, kv_idx):
    return q_idx - kv_idx


def _mask_vector(b, h, q_idx, kv_idx):
    return jnp.stack([q_idx >= kv_idx, q_idx < kv_idx])


def _score_vector(s, b, h, q_idx, kv_idx):
    return jnp.stack([s, s])


def _score_bool(s, b, h, q_idx, kv_idx):
    return s > 0


def _score_one_arg(s):
    return s


@pytest.mark.parametrize(
    ("mask_mod", "error", "match"),
    [
        (
            _mask_int,
            TypeError,
            r"create_block_mask: mask_mod '_mask_int' must return bool, got int32",
        ),
        (
            _mask_vector,
            ValueError,
            r"mask_mod '_mask_vector' must return one bool per element.*\(2,\)",
        ),
        (
            lambda b, h, q_idx, kv_idx: jnp.arange(4)[b, q_idx] > 0,
            ValueError,
            r"mask_mod '<lambda>' failed when called on int32 scalars \(b, h, q_idx, kv_idx\) \(a captured array of the wrong rank\?\)",
        ),
    ],
)
def test_bad_mask_mod(mask_mod, error, match):
    with pytest.raises(error, match=match):
        create_block_mask(mask_mod, None, None, T, S)


@pytest.mark.usefixtures("no_shape_checks")
def test_mods_must_be_callable():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"create_block_mask: mask_mod must be callable, got 'no'"):
        create_block_mask("no", None, None, T, S)
    with pytest.raises(TypeError, match=r"flex_attention: score_mod must be callable, got 2.0"):
        flex_attention(q, k, v, 2.0)
    with pytest.raises(
        TypeError, match=r"and_masks: every argument must be a mask_mod, got argument 1: 3"
    ):
        and_masks(causal_mask, 3)


@pytest.mark.parametrize(
    ("score_mod", "error", "match"),
    [
        (
            _score_vector,
            ValueError,
            r"flex_attention: score_mod '_score_vector' must return one float score per element",
        ),
        (
            _score_bool,
            TypeError,
            r"flex_attention: score_mod '_score_bool' must return a floating score, got bool",
        ),
        (
            _score_one_arg,
            ValueError,
            r"flex_attention: score_mod '_score_one_arg' failed when called",
        ),
    ],
)
def test_bad_score_mod(score_mod, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        flex_attention(q, k, v, score_mod)


def test_bad_captured_arrays():
    ids = _ids(np.random.default_rng(0), T)
    with pytest.raises(
        ValueError,
        match=r"document_mask: ids must have shape \[B, T\] or \[T\], got ids.shape=\(2, 19, 1\)",
    ):
        document_mask(ids[..., None])
    with pytest.raises(
        TypeError, match=r"document_mask: ids must be an integer array, got ids.dtype=float32"
    ):
        document_mask(ids.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"prefix_lm_mask: lengths must have shape \[B\] or \[\]"):
        prefix_lm_mask(jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(
        ValueError,
        match=r"create_block_mask: document_mask ids must have S=23 positions, got ids.shape=\(2, 19\)",
    ):
        create_block_mask(document_mask(ids), B, None, T, S)
    with pytest.raises(
        ValueError, match=r"document_mask ids vary over 2 batch rows, but B=None .* pass B=2"
    ):
        create_block_mask(document_mask(ids), None, None, T, T)
    with pytest.raises(
        ValueError, match=r"prefix_lm_mask lengths have 3 batch rows, the call has B=2"
    ):
        create_block_mask(prefix_lm_mask(jnp.ones(3, jnp.int32)), B, None, T, T)


@pytest.mark.usefixtures("no_shape_checks")
def test_bad_block_mask_arguments():
    with pytest.raises(
        ValueError,
        match=r"block_size must be a positive int or \(q_block, kv_block\), got block_size=0",
    ):
        create_block_mask(causal_mask, None, None, T, S, block_size=0)
    with pytest.raises(ValueError, match=r"create_block_mask: T must be an int >= 0, got T=-1"):
        create_block_mask(causal_mask, None, None, -1, S)
    with pytest.raises(
        ValueError, match=r"create_block_mask: B must be an int >= 0 or None, got B=2.5"
    ):
        create_block_mask(causal_mask, 2.5, None, T, S)


@pytest.mark.usefixtures("no_shape_checks")
def test_bad_call():
    q, k, v = _qkv()
    for sizes, name, built, call in (
        ((B, N, T + 1, S), "T", T + 1, T),
        ((B, N, T, S - 1), "S", S - 1, S),
        ((B + 1, None, T, S), "B", B + 1, B),
        ((None, N - 1, T, S), "N", N - 1, N),
    ):
        block_mask = create_block_mask(causal_mask, *sizes, block_size=BLOCK)
        with pytest.raises(
            ValueError,
            match=rf"flex_attention: block_mask was built for {name}={built}, the call has {name}={call}",
        ):
            flex_attention(q, k, v, block_mask=block_mask)
    with pytest.raises(
        TypeError,
        match=r"flex_attention: block_mask must be a BlockMask \(build one with create_block_mask",
    ):
        flex_attention(q, k, v, block_mask=causal_mask)
    with pytest.raises(ValueError, match=r"q heads=6 must be a multiple of k/v heads=4"):
        flex_attention(q, jnp.concatenate([k, k], axis=2), jnp.concatenate([v, v], axis=2))
    with pytest.raises(ValueError, match=r"k must have q's head_dim 8"):
        flex_attention(q, k[..., :7], v)
    with pytest.raises(ValueError, match=r"flex_attention: document_mask ids must have T=19"):
        ids = _ids(np.random.default_rng(0), T + 1)
        mask = create_block_mask(document_mask(ids), B, None, T + 1, T + 1)
        flex_attention(
            q,
            k,
            v,
            block_mask=BlockMask(mask.kinds, mask.mask_mod, (B, None, T, S), mask.block_size),
        )
