"""Context parallelism on 8 host CPU devices: ring and all-gather, contiguous and zigzag,
Triton kernels per step (interpreter) and XLA, against the unsharded float32 reference.

Values, lse and every gradient (q, k, v) of the sharded call, with the global arrays laid
out (`to_zigzag`) and back inside the differentiated function, as a model would.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ejk_attention import reference_attention, ring_attention
from ejk_attention._shard_map import shard_map_compat
from ejk_sequtils import attention_tolerance, from_zigzag, to_zigzag

B, N, K, H = 1, 4, 2, 16
CHUNK = 4  # tokens per zigzag chunk: T = 2 * n * CHUNK


def _mesh(n):
    if jax.device_count() < n:
        pytest.skip("needs 8 devices (tests/conftest.py sets the host device count)")
    return Mesh(np.array(jax.devices()[:n]), ("sp",))


def _documents(length, rng):
    """Sorted ids of a few documents whose boundaries fall inside shards, padding at the end."""
    cuts = np.sort(rng.choice(np.arange(1, length - 2), size=3, replace=False))
    ids = np.searchsorted(cuts, np.arange(length), side="right")
    ids[-2:] = -1
    return jnp.asarray(np.stack([ids] * B), jnp.int32)


def _run(n, kw, *, strategy, layout, implementation, dtype, with_seg, seed=0, kv_layout=None):
    rng = np.random.default_rng(seed)
    t = 2 * n * CHUNK
    q, k, v = (
        jnp.asarray(rng.standard_normal(s), dtype)
        for s in ((B, t, N, H), (B, t, K, H), (B, t, K, H))
    )
    seg = _documents(t, rng) if with_seg else None
    w = jnp.asarray(rng.standard_normal((B, t, N, H)), jnp.float32)
    kv_layout = kv_layout or layout
    keep = lambda x, axis=1: x
    laid = lambda lay_out: (lambda x, axis=1: to_zigzag(x, n, axis=axis)) if lay_out else keep
    lay, lay_kv = laid(layout == "zigzag"), laid(kv_layout == "zigzag")
    unlay = (lambda x, axis=1: from_zigzag(x, n, axis=axis)) if layout == "zigzag" else keep
    seq = P(None, "sp")

    def local(q, k, v, seg):
        return ring_attention(
            q,
            k,
            v,
            axis_name="sp",
            segment_ids=seg,
            return_lse=True,
            strategy=strategy,
            layout=layout,
            kv_layout=kv_layout,
            implementation=implementation,
            **kw,
        )

    sharded = shard_map_compat(
        local,
        mesh=_mesh(n),
        in_specs=(seq, seq, seq, None if seg is None else (seq, seq)),
        out_specs=(seq, P(None, None, "sp")),
    )

    def ring(q, k, v):
        ids = None if seg is None else (lay(seg), lay_kv(seg))
        out, lse = sharded(lay(q), lay_kv(k), lay_kv(v), ids)
        return unlay(out), unlay(lse, axis=2)

    def ref(q, k, v):
        f32 = lambda x: x.astype(jnp.float32)
        return reference_attention(f32(q), f32(k), f32(v), segment_ids=seg, return_lse=True, **kw)

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
            return jnp.sum(out.astype(jnp.float32) * w) + 0.1 * jnp.sum(finite)

        return f

    got = jax.jit(ring)(q, k, v)
    want = ref(q, k, v)
    got_g = jax.jit(jax.grad(loss(ring), argnums=(0, 1, 2)))(q, k, v)
    want_g = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    return got, want, got_g, want_g


def _check(got, want, got_g, want_g, dtype):
    (out, lse), (want_out, want_lse) = got, want
    assert out.shape == want_out.shape and out.dtype == jnp.dtype(dtype)
    tol, gtol = attention_tolerance(dtype, "out"), attention_tolerance(dtype, "grad")
    np.testing.assert_allclose(out.astype(np.float32), want_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=attention_tolerance(dtype, "lse"), atol=tol)
    for name, g, wg in zip("qkv", got_g, want_g, strict=True):
        np.testing.assert_allclose(g.astype(np.float32), wg, rtol=gtol, atol=gtol, err_msg=name)


CAUSAL = {"causal": True}
WINDOW = {"causal": True, "sliding_window": (5, 0)}
DROPOUT = {"dropout_rate": 0.3, "dropout_seed": 2**31 + 77}
# (ring size, strategy, layout, implementation, masks, documents, dtype)
CASES = {
    "triton-ring2-zigzag-causal-docs": (2, "ring", "zigzag", "triton", CAUSAL, True, "float32"),
    "triton-allgather4-zigzag-window": (
        4,
        "all_gather",
        "zigzag",
        "triton",
        WINDOW,
        False,
        "float16",
    ),
    "triton-ring8-zigzag-causal": (8, "ring", "zigzag", "triton", CAUSAL, False, "float32"),
    # All-gather on the kernels: one call per device; dk/dv reduce-scattered in float16.
    "triton-allgather8-zigzag-causal-docs": (
        8,
        "all_gather",
        "zigzag",
        "triton",
        CAUSAL,
        True,
        "float16",
    ),
    # Documents in the contiguous split: the own block's call first, then the gathered
    # rest with the own block's ids made padding, merged (`own_block_first`).
    "triton-allgather4-contiguous-causal-docs": (
        4,
        "all_gather",
        "contiguous",
        "triton",
        CAUSAL,
        True,
        "float16",
    ),
    "triton-allgather2-contiguous-window-docs": (
        2,
        "all_gather",
        "contiguous",
        "triton",
        WINDOW,
        True,
        "float32",
    ),
    # float16 through the ring (partial outputs merged by lse, dk/dv passed along in
    # float16) with a two-sided window and a soft cap: the slow grid's
    # "window-softcap" family, kept in the default run at two devices.
    "triton-ring2-zigzag-window-softcap-float16": (
        2,
        "ring",
        "zigzag",
        "triton",
        {"sliding_window": (6, 2), "logits_soft_cap": 2.0},
        False,
        "float16",
    ),
    # No mask: no branch marks the kernels' results varying (the custom calls must).
    "triton-ring2-contiguous-full": (2, "ring", "contiguous", "triton", {}, False, "float32"),
    "xla-ring8-zigzag-causal-docs-bf16": (8, "ring", "zigzag", "xla", CAUSAL, True, "bfloat16"),
    # Dropout hashes global positions: each call one chunk against one chunk.
    "triton-ring2-zigzag-causal-dropout": (
        2,
        "ring",
        "zigzag",
        "triton",
        {**CAUSAL, **DROPOUT},
        False,
        "float32",
    ),
    "xla-allgather2-zigzag-full-dropout-docs": (
        2,
        "all_gather",
        "zigzag",
        "xla",
        DROPOUT,
        True,
        "float32",
    ),
    "xla-allgather2-contiguous-window": (
        2,
        "all_gather",
        "contiguous",
        "xla",
        WINDOW,
        True,
        "float32",
    ),
}
SLOW_CASES = {
    f"{impl}-{strategy}{n}-{layout}-{name}-{dtype}": (n, strategy, layout, impl, kw, docs, dtype)
    for impl, dtype in (("triton", "float32"), ("triton", "float16"), ("xla", "bfloat16"))
    for n in (2, 4, 8)
    for strategy in ("ring", "all_gather")
    for layout in ("contiguous", "zigzag")
    for name, kw, docs in (
        ("causal", CAUSAL, False),
        ("causal-docs", CAUSAL, True),
        ("window-softcap", {"sliding_window": (6, 2), "logits_soft_cap": 2.0}, True),
        ("full", {}, False),
        ("window-dropout", {"sliding_window": (6, 2), **DROPOUT}, True),
    )
}


def _run_and_check(n, strategy, layout, impl, kw, docs, dtype):
    res = _run(
        n, kw, strategy=strategy, layout=layout, implementation=impl, dtype=dtype, with_seg=docs
    )
    _check(*res, dtype)


# Eight Triton (interpreter) shards take 90 s on one CPU core: the slow grid runs them, and
# the XLA steps' eight-way ring with documents and all-gather with dropout (20-25 s each;
# the default keeps the Triton ring's documents and dropout cases).
_SLOW_CASES_BY_DEFAULT = {
    "triton-ring8-zigzag-causal",
    "xla-ring8-zigzag-causal-docs-bf16",
    "xla-allgather2-zigzag-full-dropout-docs",
}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.slow) if c in _SLOW_CASES_BY_DEFAULT else c for c in CASES],
)
def test_context_parallel_matches_reference(case):
    _run_and_check(*CASES[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_CASES))
def test_context_parallel_grid(case):
    _run_and_check(*SLOW_CASES[case])


def test_queries_in_zigzag_against_contiguous_keys():
    """All-gather's one call: the keys keep the contiguous split (as the facade passes
    them), the queries the zigzag; values and every gradient against the reference."""
    res = _run(
        4,
        WINDOW,
        strategy="all_gather",
        layout="zigzag",
        kv_layout="contiguous",
        implementation="triton",
        dtype="float32",
        with_seg=True,
    )
    _check(*res, "float32")


def test_keys_in_their_own_layout_only_for_the_one_call():
    q = jnp.zeros((1, 8, 2, 8))
    for kw in ({"strategy": "ring"}, {"strategy": "all_gather", "implementation": "xla"}):
        with pytest.raises(ValueError, match="only all-gather's one call reads keys"):
            ring_attention(q, q, q, axis_name="sp", layout="zigzag", kv_layout="contiguous", **kw)
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        ring_attention(q, q, q, axis_name="sp", kv_layout="striped")


def test_strategies_and_layouts_are_checked():
    q = jnp.zeros((1, 6, 2, 8))
    with pytest.raises(ValueError, match="strategy must be one of"):
        ring_attention(q, q, q, axis_name="sp", strategy="tree")
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_attention(q, q, q, axis_name="sp", layout="striped")
    with pytest.raises(ValueError, match="must be even"):
        ring_attention(q[:, :5], q[:, :5], q[:, :5], axis_name="sp", layout="zigzag")
    with pytest.raises(ValueError, match="implementation must be one of"):
        ring_attention(q, q, q, axis_name="sp", implementation="cuda")
    with pytest.raises(NotImplementedError, match="Triton steps cannot serve"):
        ring_attention(q, q, q[..., :4], axis_name="sp", implementation="triton")


def test_blocks_of_other_documents_are_skipped():
    """A call whose blocks share no document is skipped (its ids' ranges are apart)."""
    from ejk_attention._ring import _documents_meet

    ids = lambda *x: jnp.asarray([x], jnp.int32)
    assert not _documents_meet((ids(0, 0, 1), ids(2, 2, 3)))
    assert not _documents_meet((ids(4, 5, -1), ids(-1, 2, 3)))  # padding is no document
    assert _documents_meet((ids(0, 1, 1), ids(1, 2, 2)))
    assert not _documents_meet((ids(-1, -1), ids(-1, -1)))


def _gradient_equations(jaxpr_equations, n, **kw):
    """Every equation of the jaxpr of `_gradient`'s function."""
    grad, args = _gradient(n, **kw)
    return list(jaxpr_equations(jax.make_jaxpr(grad)(*args).jaxpr))


def _gradient(n, *, dtype=jnp.float32, documents=False, **ring):
    """``(f, args)``: the (q, k, v) gradient of causal `ring_attention` (options ``ring``)
    on ``n`` devices, T = 2 n CHUNK, with all-zero segment ids where ``documents``."""
    t = 2 * n * CHUNK
    q = jnp.zeros((B, t, N, H), dtype)
    kv = jnp.zeros((B, t, K, H), dtype)
    ids = (jnp.zeros((B, t), jnp.int32),) if documents else ()
    seq = P(None, "sp")

    def local(q, k, v, *ids):
        segment_ids = (ids[0], ids[0]) if ids else None
        out = ring_attention(q, k, v, axis_name="sp", causal=True, segment_ids=segment_ids, **ring)
        return jnp.sum(out.astype(jnp.float32))

    sharded = shard_map_compat(
        local, mesh=_mesh(n), in_specs=(seq,) * (3 + len(ids)), out_specs=P(), check=False
    )
    grad = jax.grad(lambda q, k, v: sharded(q, k, v, *ids), argnums=(0, 1, 2))
    return grad, (q, kv, kv)


@pytest.mark.parametrize("implementation", ["triton", "xla"])
def test_all_gather_gathers_once_for_forward_and_backward(implementation, jaxpr_equations):
    """The backward reads the blocks the forward gathered (kept as residuals): one
    all-gather each of k, v and their ids in the whole gradient, none gathered again
    (a backward in a branch of its own, as under the facade's `lax.cond`, could not
    share the forward's). The kernels' one call sends dk and dv home in one
    reduce-scatter (XLA keeps one collective of a kind in flight: of two, one ran
    exposed); the steps' float32 sums in two."""
    eqns = _gradient_equations(
        jaxpr_equations, 2, documents=True, strategy="all_gather", layout="zigzag",
        implementation=implementation,
    )  # fmt: skip
    eqns = [e.primitive.name for e in eqns]
    # k, v and the kv ids; the kernels' one call with documents takes k and v as one array
    assert eqns.count("all_gather") == (2 if implementation == "triton" else 3)
    assert eqns.count("reduce_scatter") == (1 if implementation == "triton" else 2)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_all_gather_moves_keys_and_values_as_one_array_with_documents(layout, jaxpr_equations):
    """With documents k and v go in one all-gather, as one array the kernels read in place
    (`gathers_kv_pair`): XLA keeps one collective in flight, so two gathers ran one after
    the other and only one hid behind the own block's call (contiguous split). The zigzag
    layout gathers the same array, so that the facade's ``lax.cond`` between the two keeps
    one residual for both branches (see the next test)."""
    eqns = _gradient_equations(
        jaxpr_equations, 2, documents=True, strategy="all_gather", layout=layout,
        implementation="triton",
    )  # fmt: skip
    gathers = [e for e in eqns if e.primitive.name == "all_gather"]
    assert len(gathers) == 2  # k and v as one array, and the kv ids
    assert sorted(e.invars[0].aval.shape[-1] for e in gathers)[-1] == 2 * H


def test_the_facade_layout_branches_share_the_gathered_keys(jaxpr_equations):
    """The facade's ``lax.cond`` between the contiguous and the zigzag layout (packed
    documents) returns each branch's backward residuals; residuals of different shapes
    each take a slot, which the other branch fills with zeros (two H200s: a 0.08 ms
    broadcast and a copy, at 12f2d4a). Both branches gather k and v as one array: one
    slot."""
    from ejk_attention import flash_attention

    n, t = 2, 32
    mesh = _mesh(n)
    q = jnp.zeros((B, t, N, H), jnp.bfloat16)
    kv = jnp.zeros((B, t, K, H), jnp.bfloat16)
    ids = jnp.asarray(np.repeat(np.arange(4), t // 4)[None], jnp.int32)

    def loss(q, k, v):
        out = flash_attention(
            q,
            k,
            v,
            causal=True,
            segment_ids=(ids, ids),
            mesh=mesh,
            in_specs=P(None, "sp"),
            implementation="triton",
        )  # fmt: skip  (grouped heads: the facade picks all-gather)
        return jnp.sum(out.astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv)
    conds = [e for e in jaxpr_equations(jaxpr.jaxpr) if e.primitive.name == "cond"]
    gathered = [
        v.aval.shape for e in conds for v in e.outvars if len(v.aval.shape) == 5
    ]  # [n, B, S, K, ...]: the gathered blocks kept for the backward
    assert gathered == [(n, B, t // n, K, 2 * H)], gathered


def test_all_gather_joins_dk_and_dv_for_free():
    """The one reduce-scatter takes the array the kernel call wrote dk and dv into (side by
    side, `block_backward`'s ``joint_dkdv``): in the compiled gradient the only
    concatenation along the heads' columns is that call's (the ordinary kernels' outputs
    joined; the Gluon kernel writes them so), none in front of the collective. (float32:
    on the CPU, XLA computes bfloat16 collectives in float32, and the converts it puts
    between the halves and the join would hide what a GPU does.)"""
    grad, args = _gradient(
        2, documents=True, strategy="all_gather", layout="zigzag", implementation="triton"
    )
    hlo = jax.jit(grad).lower(*args).compile().as_text()
    joins = []
    for line in hlo.splitlines():
        found = re.search(r"= f32\[([\d,]+)\]\S* concatenate\(.*dimensions=\{(\d+)\}", line)
        if found:
            shape = [int(x) for x in found.group(1).split(",")]
            if int(found.group(2)) == len(shape) - 1 and shape[-1] == 2 * H:
                joins.append(shape)
    # the call's [B, T, K, 2H], and the device's k and v joined for the one all-gather
    # (`gathers_kv_pair`, [B, T / n, K, 2H]); none of the gathered [n, ...] blocks
    assert sorted(joins) == [[B, 2 * CHUNK, K, 2 * H], [B, 2 * 2 * CHUNK, K, 2 * H]], joins
    assert "reduce-scatter(" in hlo


def test_ring_sends_each_gradient_share_home_once(jaxpr_equations):
    """The ring's backward sends a step's dk/dv of another device's block straight to
    that device, in the inputs' dtype: ``n - 1`` transfers of each, none in float32 (not
    ``n`` float32 hops with the block)."""
    n = 4
    eqns = _gradient_equations(
        jaxpr_equations, n, dtype=jnp.bfloat16, strategy="ring", layout="zigzag",
        implementation="xla",
    )  # fmt: skip
    moves = [e for e in eqns if e.primitive.name == "ppermute"]
    assert all(e.invars[0].aval.dtype == jnp.bfloat16 for e in moves)
    # By destination offset: k and v go one device on, n - 1 times in the forward and
    # again in the backward; step s's dk and dv go s devices back (n - s on).
    offsets = collections.Counter(
        (e.params["perm"][0][1] - e.params["perm"][0][0]) % n for e in moves
    )
    assert offsets == {1: 2 * 2 * (n - 1) + 2, 2: 2, 3: 2}


def test_two_devices_carry_the_inputs_dtype_through_the_ring(jaxpr_equations):
    """With two devices in the contiguous layout the own block's call starts the output
    and dq, and at most one call follows: the branches carry them in the inputs' dtype
    (one rounding, as the final cast), not in float32 passes in and out of them."""
    eqns = _gradient_equations(
        jaxpr_equations, 2, dtype=jnp.bfloat16, documents=True, strategy="ring",
        layout="contiguous", implementation="xla",
    )  # fmt: skip
    carried = [
        x.aval.dtype
        for e in eqns
        if e.primitive.name == "cond"
        for x in e.outvars
        if x.aval.ndim == 4
    ]
    assert carried and all(d == jnp.bfloat16 for d in carried)
