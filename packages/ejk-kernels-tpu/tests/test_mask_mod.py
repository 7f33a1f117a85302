"""`ModMask` and `ModScore` (a mask_mod / score_mod split into features and a tile part), the
block tables of a kinds table (`rescale_kinds`, `block_kind_info`), against the mods evaluated
densely; `mask_mod_attention` under a score_mod against a dense definition written here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_tpu import ModMask, ModScore, mask_mod_attention, unsupported_mask_mod_reason
from ejk_kernels_tpu._block_kinds import block_kind_info, rescale_kinds
from ejk_kernels_tpu._mask_info import EMPTY, FULL, PARTIAL
from ejk_sequtils import attention_tolerance, validate_attention

B, N, T, S = 2, 3, 37, 29
IDS = jnp.asarray(np.random.default_rng(0).integers(-1, 3, (B, T)), jnp.int32)
LENGTHS = jnp.asarray([4, 9], jnp.int32)


def _documents(b, h, q_idx, kv_idx):
    return (IDS[b, q_idx] == IDS[b, kv_idx % T]) & (IDS[b, q_idx] >= 0)


def _prefix_per_head(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx + h) | (kv_idx - q_idx < LENGTHS[b] - 8)


def _relative(b, h, q_idx, kv_idx):  # a captured table read at q_idx - kv_idx, per head
    return RELATIVE[h, q_idx - kv_idx + S] > 3


RELATIVE = jnp.asarray(np.random.default_rng(4).integers(0, 8, (N, T + S)), jnp.int32)


def _query_only(b, h, q_idx, kv_idx):  # ignores kv_idx: the result itself is a feature
    return IDS[b, q_idx] >= 0


def _dense(mask_mod, t=T, s=S):
    grid = jnp.meshgrid(*(jnp.arange(x, dtype=jnp.int32) for x in (B, N, t, s)), indexing="ij")
    return np.asarray(jnp.vectorize(mask_mod)(*grid))


# Query and key positions of every element of a [T, S] tile.
TILE_IDS = (
    jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[:, None], (T, S)),
    jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None, :], (T, S)),
)


def _tile_values(mod, features, b, h):
    """The features of a split mod as the kernels read them on the ``(b, h)`` tile of [T, S]."""
    values = []
    for f, x in zip(mod.features, features, strict=True):
        at = (b if f.batch else 0, h if f.head else 0)
        if f.axis == "table":
            values.append(x)
        elif f.axis == "scalar":
            values.append(x[at[0] * (N if f.head else 1) + at[1]])
        elif f.axis == "q":
            assert x.shape[2] == 40  # padded; the padding repeats the last position
            values.append(jnp.broadcast_to(x[at][:T, None], (T, S)))
        else:
            values.append(jnp.broadcast_to(x[at][None, :S], (T, S)))
    return values


@pytest.mark.parametrize(
    ("mask_mod", "axes"),
    [
        (_documents, {("q", True, False), ("kv", True, False)}),
        (_prefix_per_head, {("q", False, True), ("scalar", True, False)}),
        (_query_only, {("q", True, False)}),
        # A table the same for every (b, h), read at q_idx - kv_idx: whole, looked up.
        (_relative, {("table", False, False), ("scalar", False, True)}),
    ],
)
def test_split_evaluates_like_the_mod(mask_mod, axes):
    """Features per query / key / (b, h), each with the batch and head it depends on; the
    tile part with them equals the mod evaluated everywhere."""
    mod, consts = ModMask.trace(mask_mod)
    assert {(f.axis, f.batch, f.head) for f in mod.features} >= axes
    features = mod.feature_arrays(consts, B, N, T, S, 40, 32)
    want = _dense(mask_mod)
    for b in range(B):
        for h in range(N):
            values = _tile_values(mod, features, b, h)
            got = mod.evaluate(jnp.int32(b), jnp.int32(h), *TILE_IDS, values)
            np.testing.assert_array_equal(got, want[b, h], err_msg=f"{b=} {h=}")


def test_reads_the_tile_cannot_look_up_are_refused():
    """A table read along two tile-varying axes, one that differs per batch row, a slice
    used as more than its one element: refused, naming the mod and the read."""
    dense_bias = jnp.ones((T, S), jnp.int32)
    per_batch = jnp.ones((B, T + S), jnp.int32)

    def two_axes(b, h, q_idx, kv_idx):
        return dense_bias[q_idx, kv_idx] > 0

    def batch_rows(b, h, q_idx, kv_idx):
        return per_batch[b][q_idx - kv_idx + S] > 0

    def summed_slice(b, h, q_idx, kv_idx):
        return jax.lax.dynamic_slice(per_batch[0], (q_idx - kv_idx + S,), (2,)).sum() > 0

    for mod, why in (
        (two_axes, r"shape \(37, 29\).*along two axes"),
        (batch_rows, r"shape \(66,\).*the array itself depends on b"),
        (summed_slice, r"shape \(66,\).*a slice of more than one element"),
    ):
        with pytest.raises(NotImplementedError, match=rf"mask_mod '{mod.__name__}'.*{why}"):
            ModMask.trace(mod)


SLOPES = jnp.linspace(0.1, 0.8, N)
BIAS = jnp.asarray(np.random.default_rng(1).standard_normal((B, S)), jnp.float32)


def _alibi_bias_cap(s, b, h, q_idx, kv_idx):
    s = s - SLOPES[h] * jnp.abs(q_idx - kv_idx).astype(jnp.float32) + BIAS[b, kv_idx]
    return 3.0 * jnp.tanh(s / 3.0)


def test_score_mod_split_evaluates_like_the_mod():
    """A score_mod's features (slopes per head, a bias per key) and its tile part (the score,
    both positions) give the mod's value at every element."""
    mod, consts = ModScore.trace(_alibi_bias_cap)
    assert {(f.axis, f.batch, f.head) for f in mod.features} == {
        ("scalar", False, True),
        ("kv", True, False),
    }
    features = mod.feature_arrays(consts, B, N, T, S, 40, 32)
    scores = jnp.asarray(np.random.default_rng(2).standard_normal((T, S)), jnp.float32)
    for b in range(B):
        for h in range(N):
            values = _tile_values(mod, features, b, h)
            got = mod.evaluate(scores, jnp.int32(b), jnp.int32(h), *TILE_IDS, values)
            want = jnp.vectorize(_alibi_bias_cap)(scores, b, h, *TILE_IDS)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"{b=} {h=}")


def test_a_score_mod_reading_a_dense_bias_is_refused():
    bias = jnp.ones((T, S), jnp.float32)

    def dense_bias(s, b, h, q_idx, kv_idx):
        return s + bias[q_idx, kv_idx]

    match = r"score_mod 'dense_bias'.*shape \(37, 29\).*depends on both q_idx and kv_idx"
    with pytest.raises(NotImplementedError, match=match):
        ModScore.trace(dense_bias)
    q = jnp.zeros((B, T, N, 8))
    k = jnp.zeros((B, S, N, 8))
    request = validate_attention(q, k, k)
    assert "dense_bias" in unsupported_mask_mod_reason(request, None, score_mod=dense_bias)


def _flex_definition(q, k, v, score_mod, mask_mod):
    """``(out, lse)`` of flex attention from its definition (GQA: query head n reads kv head
    n // (N // K)); a row that sees nothing gives zeros."""
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    s = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest") * q.shape[3] ** -0.5
    grid = jnp.meshgrid(*(jnp.arange(x, dtype=jnp.int32) for x in s.shape), indexing="ij")
    s = jnp.where(jnp.vectorize(mask_mod)(*grid), jnp.vectorize(score_mod)(s, *grid), -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    safe = jnp.where(total > 0, total, 1.0)
    out = jnp.einsum("bnts,bsnd->btnd", e / safe, v, precision="highest")
    return out, jnp.where(total > 0, m + jnp.log(safe), -jnp.inf)[..., 0]


def test_score_mod_attention_matches_the_definition():
    """ALiBi + a per-key bias + tanh under causal documents, GQA 3 on 1, T and S not multiples
    of the blocks: out, lse and the gradients of q, k, v and both float captures."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((B, T, N, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, S, 1, 8)), jnp.float32) for _ in range(2))

    def mods(slopes, bias):
        def score_mod(s, b, h, q_idx, kv_idx):
            s = s - slopes[h] * jnp.abs(q_idx - kv_idx).astype(jnp.float32) + bias[b, kv_idx]
            return 3.0 * jnp.tanh(s / 3.0)

        def mask_mod(b, h, q_idx, kv_idx):
            return _documents(b, h, q_idx, kv_idx) & (kv_idx <= q_idx)

        return score_mod, mask_mod

    kinds = jnp.full((1, 1, 1, 1), PARTIAL, jnp.int8)

    def kernel(q, k, v, slopes, bias):
        request = validate_attention(q, k, v, return_lse=True)
        score_mod, mask_mod = mods(slopes, bias)
        return mask_mod_attention(request, mask_mod, kinds, (T, S), score_mod=score_mod)

    args = (q, k, v, SLOPES, BIAS)
    (out, lse), kernel_vjp = jax.vjp(kernel, *args)
    (want, want_lse), dense_vjp = jax.vjp(lambda *a: _flex_definition(*a[:3], *mods(*a[3:])), *args)
    tol = attention_tolerance(jnp.float32)
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = lambda x: jnp.where(jnp.isinf(x), 0.0, x)
    np.testing.assert_allclose(finite(lse), finite(want_lse), rtol=tol, atol=tol)
    cts = (jnp.asarray(rng.standard_normal(out.shape), jnp.float32), jnp.ones_like(lse))
    grad_tol = attention_tolerance(jnp.float32, "grad")
    names = ("dq", "dk", "dv", "dslopes", "dbias")
    for name, got, expected in zip(names, kernel_vjp(cts), dense_vjp(cts), strict=True):
        assert np.abs(expected).max() > 0, name
        np.testing.assert_allclose(got, expected, rtol=grad_tol, atol=grad_tol, err_msg=name)


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
