"""Block calls of context parallelism: masks on global positions, global-statistics backward.

A query block of a global sequence against the key blocks the sequence is cut into:
the block outputs merged by their lse equal the reference's rows, and the sums of the
blocks' dq (and the blocks' dk/dv side by side) equal the reference's gradients.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_gpu.context._blocks import BlockMasks, block_backward, block_forward
from ejk_sequtils import reference_attention

B, T, N, K, H = 2, 48, 4, 2, 16
Q_ROWS = (16, 40)  # the query block: global rows [16, 40)
K_CUTS = (0, 24, 48)  # two key blocks

CASES = {
    # name: (reference kwargs, BlockMasks kwargs without scale, with segment ids)
    "causal": ({"causal": True}, {"causal": True, "relative": True}, False),
    "window_softcap": (
        {"sliding_window": (5, 3), "logits_soft_cap": 3.0},
        {"window": (5, 3), "soft_cap": 3.0, "relative": True},
        False,
    ),
    "causal_documents": ({"causal": True}, {"causal": True, "relative": True}, True),
    "full_documents": ({}, {}, True),
}


def _merge(parts):
    """Outputs and lse of blocks merged by their lse (FlashAttention-2's rescaling)."""
    lse = jax.nn.logsumexp(jnp.stack([p[1] for p in parts]), axis=0)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    out = sum(
        o.astype(jnp.float32) * jnp.exp(lse_p - safe).transpose(0, 2, 1)[..., None]
        for o, lse_p in parts
    )
    return out, lse


@pytest.mark.parametrize("case", list(CASES))
def test_blocks_merge_to_the_reference(rng, make_inputs, close, case):
    ref_kw, mask_kw, with_seg = CASES[case]
    q, k, v = make_inputs(rng, B, T, T, N, K, H, jnp.float32)
    seg = None
    if with_seg:  # documents that cross the block boundaries, and padding at the end
        ids = np.repeat(np.arange(4), [10, 20, 12, 6])
        ids[-3:] = -1
        seg = jnp.asarray(np.stack([ids, np.sort(rng.integers(0, 3, T))]), jnp.int32)
    a, b = Q_ROWS
    masks = BlockMasks(scale=H**-0.5, **mask_kw)

    def blocks(x, lo, hi):
        return x[:, lo:hi]

    parts = []
    for lo, hi in itertools.pairwise(K_CUTS):
        parts.append(
            block_forward(
                masks,
                q[:, a:b],
                blocks(k, lo, hi),
                blocks(v, lo, hi),
                q_offset=a,
                k_offset=lo,
                segment_ids=None if seg is None else (seg[:, a:b], seg[:, lo:hi]),
            )
        )
    out, lse = _merge(parts)
    ref = lambda q, k, v: reference_attention(q, k, v, segment_ids=seg, return_lse=True, **ref_kw)
    want, want_lse = ref(q, k, v)
    close(out, want[:, a:b], jnp.float32, "out")
    close(lse, want_lse[:, :, a:b], jnp.float32, "lse")

    w = jnp.asarray(rng.standard_normal(want.shape), jnp.float32).at[:, :a].set(0).at[:, b:].set(0)

    def loss(q, k, v):
        o, rows = ref(q, k, v)
        rows = jnp.where(jnp.isfinite(rows), rows, 0.0)[:, :, a:b]
        return jnp.sum(o * w) + 0.1 * jnp.sum(rows)

    dq_want, dk_want, dv_want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    d_lse = jnp.full(lse.shape, 0.1, jnp.float32)
    global_out = want[:, a:b]
    dq = 0.0
    dks, dvs = [], []
    for lo, hi in itertools.pairwise(K_CUTS):
        gq, gk, gv = block_backward(
            masks,
            q[:, a:b],
            k[:, lo:hi],
            v[:, lo:hi],
            global_out,
            want_lse[:, :, a:b],
            w[:, a:b],
            d_lse,
            q_offset=a,
            k_offset=lo,
            segment_ids=None if seg is None else (seg[:, a:b], seg[:, lo:hi]),
        )
        dq = dq + gq
        dks.append(gk)
        dvs.append(gv)
    close(dq, dq_want[:, a:b], jnp.float32, "grad", "dq")
    close(jnp.concatenate(dks, 1), dk_want, jnp.float32, "grad", "dk")
    close(jnp.concatenate(dvs, 1), dv_want, jnp.float32, "grad", "dv")


def test_joint_gradients_hold_dk_then_dv_in_each_head(rng, make_inputs):
    """``joint_dkdv`` (all-gather's one reduce-scatter) gives ``(dq, dkv)``: per head, dk's
    columns then dv's, equal to the separate call's."""
    q, k, v = make_inputs(rng, B, T, T, N, K, H, jnp.float32)
    masks = BlockMasks(scale=H**-0.5, causal=True, relative=True)
    out, lse = block_forward(masks, q, k, v, q_offset=0, k_offset=0)
    d_out = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    args = (masks, q, k, v, out, lse, d_out)
    dq, dk, dv = block_backward(*args, q_offset=0, k_offset=0)
    dq_joint, dkv = block_backward(*args, q_offset=0, k_offset=0, joint_dkdv=True)
    assert dkv.shape == (B, T, K, 2 * H)
    np.testing.assert_array_equal(dq_joint, dq)
    np.testing.assert_array_equal(dkv[..., :H], dk)
    np.testing.assert_array_equal(dkv[..., H:], dv)


def test_local_diagonal_equals_relative_positions(rng, make_inputs):
    """With equal offsets, local causal (the plain build) and relative positions agree."""
    q, k, v = make_inputs(rng, 1, 32, 32, 2, 1, 16, jnp.float32)
    local = block_forward(BlockMasks(scale=0.25, causal=True), q, k, v)
    rel = BlockMasks(scale=0.25, causal=True, relative=True)
    shifted = block_forward(rel, q, k, v, q_offset=jnp.int32(64), k_offset=jnp.int32(64))
    for x, y in zip(local, shifted, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


def test_hidden_block_gives_empty_rows(rng, make_inputs):
    q, k, v = make_inputs(rng, 1, 16, 16, 2, 2, 16, jnp.float32)
    masks = BlockMasks(scale=0.25, causal=True, relative=True)
    out, lse = jax.jit(lambda q, k, v: block_forward(masks, q, k, v, q_offset=0, k_offset=16))(
        q, k, v
    )
    np.testing.assert_array_equal(out, 0.0)
    assert np.all(np.isneginf(lse))


def test_relative_without_a_position_mask_is_refused():
    with pytest.raises(ValueError, match="relative positions matter only"):
        BlockMasks(scale=1.0, relative=True)


# Device 0 of a 2-way zigzag layout over 256 tokens: global rows [0, 64) and [192, 256)
# (longer than the kernels' blocks, so that the tables decide which blocks run).
CHUNKS = ((0, 64), (192, 256))
LONG = 256


@pytest.mark.parametrize("case", list(CASES))
def test_query_chunks_against_the_whole_sequence(rng, make_inputs, close, case):
    """One call of two query chunks (``q_offset`` a tuple) against every key: the
    reference's rows, and the rows' whole share of dq, dk and dv."""
    ref_kw, mask_kw, with_seg = CASES[case]
    b, t, n = 1, LONG, 2
    q, k, v = make_inputs(rng, b, t, t, n, 1, H, jnp.float32)
    seg = None
    if with_seg:  # documents crossing the chunks' edges, and padding at the end
        ids = np.repeat(np.arange(4), [50, 100, 90, 16])
        ids[-5:] = -1
        seg = jnp.asarray(ids[None], jnp.int32)
    rows = np.concatenate([np.arange(a, b) for a, b in CHUNKS])
    masks = BlockMasks(scale=H**-0.5, **mask_kw)
    offsets = tuple(jnp.int32(a) for a, _ in CHUNKS)
    ids = None if seg is None else (seg[:, rows], seg)
    call = jax.jit(lambda q, k, v: block_forward(masks, q, k, v, q_offset=offsets, segment_ids=ids))
    out, lse = call(q[:, rows], k, v)
    ref = lambda q, k, v: reference_attention(q, k, v, segment_ids=seg, return_lse=True, **ref_kw)
    want, want_lse = ref(q, k, v)
    close(out, want[:, rows], jnp.float32, "out")
    close(lse, want_lse[:, :, rows], jnp.float32, "lse")

    w = (
        jnp.zeros(want.shape, jnp.float32)
        .at[:, rows]
        .set(jnp.asarray(rng.standard_normal((b, len(rows), n, H)), jnp.float32))
    )
    seen = jnp.zeros((t,), bool).at[rows].set(True)

    def loss(q, k, v):
        o, lse = ref(q, k, v)
        lse = jnp.where(jnp.isfinite(lse) & seen, lse, 0.0)
        return jnp.sum(o * w) + 0.1 * jnp.sum(lse)

    dq_want, dk_want, dv_want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    dq, dk, dv = block_backward(
        masks,
        q[:, rows],
        k,
        v,
        want[:, rows],
        want_lse[:, :, rows],
        w[:, rows],
        jnp.full(lse.shape, 0.1, jnp.float32),
        q_offset=offsets,
        segment_ids=ids,
    )
    close(dq, dq_want[:, rows], jnp.float32, "grad", "dq")
    close(dk, dk_want, jnp.float32, "grad", "dk")
    close(dv, dv_want, jnp.float32, "grad", "dv")


def test_query_chunks_are_checked():
    q = jnp.zeros((1, 10, 2, 16))
    masks = BlockMasks(scale=0.25, causal=True, relative=True)
    with pytest.raises(ValueError, match="equal chunks of the 10 query rows; got 3"):
        block_forward(masks, q, q, q, q_offset=(0, 4, 8))


def test_relative_calls_compare_positions_without_sequence_ids(rng, make_inputs):
    """Global positions are the packed path without its sequence ids (one sequence): the
    kernels get no id tables and build without ``SEQ_IDS`` (its loads spilled registers in
    the Gluon builds: `aot.flash`'s "relative" variant)."""
    from ejk_kernels_gpu.context._blocks import block_options, block_tables
    from ejk_kernels_gpu.flash._constexprs import gluon_constexprs, kernel_constexprs

    q, k, v = make_inputs(rng, 1, 32, 32, 2, 1, 16, jnp.float32)
    masks = BlockMasks(scale=0.25, causal=True, relative=True)
    opts = block_options(masks, q, k, v, has_segments=False)
    assert opts.varlen and not opts.seq_ids
    assert not kernel_constexprs(opts, q, k, None, False)["SEQ_IDS"]
    assert not gluon_constexprs(opts, q, k, False, opts.fwd_cfg)["SEQ_IDS"]
    tables = block_tables(opts, masks, 32, 32, 8, 0, None, head_dim=16)
    assert tables.q_sid.shape == tables.k_sid.shape == (1,)  # stand-ins
    np.testing.assert_array_equal(tables.q_pos, 8 + np.arange(32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("first_keys", [(0, 128), (128, 256)])
def test_resumed_rows_equal_one_call_over_both_key_blocks(
    rng, make_inputs, close, dtype, first_keys
):
    """``resume``: a call over the other key block continues the first call's rows in the
    kernel (all-gather's own block first, `_context_gathered`). Rows [64, 192) hold a
    document across the blocks' edge (rows that see keys in both) and one within the
    second block: the calls leave rows without mass (lse -inf), and the second block's
    call has whole tiles of rows that see no key (they keep the first call's output)."""
    t, n = LONG, 2
    q, k, v = make_inputs(rng, 1, t, t, n, 1, H, dtype)
    ids = np.repeat(np.arange(4), [50, 100, 78, 28])
    ids[-5:] = -1
    seg = jnp.asarray(ids[None], jnp.int32)
    a, b = 64, 192
    masks = BlockMasks(scale=H**-0.5, causal=True, relative=True)

    def part(keys, resume=None):
        lo, hi = keys
        return block_forward(
            masks, q[:, a:b], k[:, lo:hi], v[:, lo:hi], q_offset=a, k_offset=lo,
            segment_ids=(seg[:, a:b], seg[:, lo:hi]), resume=resume,
        )  # fmt: skip

    second = (128, 256) if first_keys == (0, 128) else (0, 128)
    first = part(first_keys)
    assert np.isneginf(np.asarray(first[1])).any()
    out, lse = jax.jit(lambda first: part(second, resume=first))(first)
    f32 = lambda x: x.astype(jnp.float32)
    want, want_lse = reference_attention(
        f32(q), f32(k), f32(v), causal=True, segment_ids=seg, return_lse=True
    )
    assert out.dtype == dtype
    close(f32(out), want[:, a:b], dtype, "out")
    close(lse, want_lse[:, :, a:b], dtype, "lse")


def test_resume_refuses_rows_of_another_shape(rng, make_inputs):
    q, k, v = make_inputs(rng, 1, 32, 32, 2, 1, 16, jnp.float32)
    masks = BlockMasks(scale=0.25, causal=True)
    out, lse = block_forward(masks, q, k, v)
    with pytest.raises(ValueError, match=r"resume=.*must have shapes"):
        block_forward(masks, q, k, v, resume=(out[:, :16], lse))


def test_keys_and_values_as_one_array_give_the_same_results(rng, make_inputs):
    """``kv``: k and v as one ``[B, S, K, 2H]`` array (all-gather's one collective), read
    in place by the forward and both backward kernels: the same outputs and gradients as
    k and v apart, bit for bit, documents and global positions included."""
    t = 96
    q, k, v = make_inputs(rng, 1, t, t, 4, 2, H, jnp.float32)
    ids = jnp.asarray(np.repeat(np.arange(3), [30, 40, 26])[None], jnp.int32)
    masks = BlockMasks(scale=H**-0.5, causal=True, relative=True)
    kw = dict(q_offset=jnp.int32(32), k_offset=jnp.int32(32), segment_ids=(ids, ids))
    pair = jnp.concatenate([k, v], axis=-1)
    apart = block_forward(masks, q, k, v, **kw)
    joint = block_forward(masks, q, None, None, kv=pair, **kw)
    for x, y in zip(apart, joint, strict=True):
        np.testing.assert_array_equal(x, y)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    grads = block_backward(masks, q, k, v, *apart, d_out, **kw)
    grads_pair = block_backward(masks, q, None, None, *apart, d_out, kv=pair, **kw)
    for x, y in zip(grads, grads_pair, strict=True):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="kv takes the place of k and v"):
        block_forward(masks, q, k, None, kv=pair, **kw)
    with pytest.raises(ValueError, match="kv takes the place of k and v"):
        block_forward(masks, q, None, None, kv=k, **kw)


@pytest.mark.parametrize(
    "bwd, match",
    [
        (
            dict(block_q=128, block_k=128, gluon=True),
            r"FlashBackwardConfig\.gluon .*block_queries=64",
        ),
        (dict(block_q=192, block_k=64, gluon=True), r"FlashBackwardConfig\.gluon .*block_keys 64"),
    ],
)
def test_block_calls_refuse_backward_configs_no_kernel_runs(rng, make_inputs, bwd, match):
    """Context parallelism's block calls convert a deprecated `FlashConfig` backward config
    as `flash_attention` does (`flash._config.as_backward_config`), not only its own entry
    point: one no backward kernel runs (the Gluon dk/dv kernel steps over 64 query rows;
    192 rows are the Gluon forward's three-consumer tile) is no `FlashBackwardConfig`."""
    from ejk_kernels_gpu import FlashConfig
    from ejk_kernels_gpu.context._blocks import block_options

    q, k, v = make_inputs(rng, 1, 32, 32, 2, 1, 16, jnp.float32)
    masks = BlockMasks(scale=0.25, causal=True)
    cfg = FlashConfig(num_warps=4, num_stages=2, **bwd)
    with pytest.raises(ValueError, match=match):
        block_options(masks, q, k, v, has_segments=False, bwd_config=cfg)
