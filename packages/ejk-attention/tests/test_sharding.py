"""`flash_attention(mesh=, in_specs=)`: batch/head sharded calls on 8 host CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ejk_attention import flash_attention, reference_attention
from ejk_sequtils import attention_tolerance

TOL = attention_tolerance("float32")
GRAD_TOL = attention_tolerance("float32", "grad")

B, T, S, N, K, H = 4, 9, 11, 8, 4, 8


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets the host device count)")
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def _inputs():
    rng = np.random.default_rng(0)
    shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, H))
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)
    kw = {
        "bias": jnp.asarray(rng.standard_normal((B, 1, T, S)), jnp.float32),
        "softmax_sinks": jnp.linspace(-1.0, 1.0, N),
        "segment_ids": (
            jnp.asarray(np.sort(rng.integers(-1, 3, (B, T)), axis=1), jnp.int32),
            jnp.asarray(np.sort(rng.integers(-1, 3, (B, S)), axis=1), jnp.int32),
        ),
        "causal": True,
        "return_lse": True,
    }
    return q, k, v, kw


@pytest.mark.parametrize(
    "spec",
    [
        P("data", None, "model"),
        pytest.param(P("model", None, "data"), marks=pytest.mark.slow),
        None,
    ],
)
def test_batch_and_head_sharding_matches_reference(mesh, spec):
    q, k, v, kw = _inputs()
    if spec is None:  # the default: batch over every axis needs B % 8 == 0
        q, k, v = (jnp.concatenate([x, x]) for x in (q, k, v))
        kw = {"causal": True, "return_lse": True}
    out, lse = jax.jit(lambda q, k, v: flash_attention(q, k, v, mesh=mesh, in_specs=spec, **kw))(
        q, k, v
    )
    want, want_lse = reference_attention(q, k, v, **kw)
    np.testing.assert_allclose(out, want, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(lse, want_lse, rtol=TOL, atol=TOL)
    if spec is None:
        return  # the default spec's gradients take the same path as the explicit ones

    def loss(fn, **extra):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, **kw, **extra)[0]))

    got = jax.grad(loss(flash_attention, mesh=mesh, in_specs=spec), argnums=(0, 1, 2))(q, k, v)
    want_g = jax.grad(loss(reference_attention), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want_g, strict=True):
        np.testing.assert_allclose(g, w, rtol=GRAD_TOL, atol=GRAD_TOL)


@pytest.mark.parametrize(
    ("implementation", "spec"),
    [
        ("xla", P("data", None, "model")),
        ("xla", P(("data", "model"))),
        ("triton", P("model", None, "data")),
    ],
)
def test_dropout_in_a_batch_and_head_sharded_call_draws_the_global_mask(mesh, implementation, spec):
    """Each shard hashes its global (batch, head) indices: the sharded call drops exactly
    the weights the unsharded call drops (values and gradients, traced seed)."""
    q, k, v, _ = _inputs()
    if spec == P(("data", "model")):  # batch over all 8 devices
        q, k, v = (jnp.concatenate([x, x]) for x in (q, k, v))
    kw = {"causal": True, "dropout_rate": 0.3}
    w = jnp.asarray(np.random.default_rng(3).standard_normal(q.shape), jnp.float32)

    def loss(fn, **extra):
        return lambda q, k, v, seed: jnp.sum(fn(q, k, v, dropout_seed=seed, **kw, **extra) * w)

    sharded = loss(flash_attention, mesh=mesh, in_specs=spec, implementation=implementation)
    plain = loss(reference_attention)
    seed = jnp.uint32(2**31 + 77)
    got, got_g = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2)))(q, k, v, seed)
    want, want_g = jax.value_and_grad(plain, argnums=(0, 1, 2))(q, k, v, seed)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * float(jnp.sum(jnp.abs(w))))
    for name, g, wg in zip("qkv", got_g, want_g, strict=True):
        np.testing.assert_allclose(g, wg, rtol=GRAD_TOL, atol=GRAD_TOL, err_msg=name)
    # The shards' masks are not one mask repeated: the output changes with the batch row.
    out = flash_attention(
        q, k, v, dropout_seed=seed, mesh=mesh, in_specs=spec, implementation=implementation, **kw
    )
    np.testing.assert_allclose(
        out, reference_attention(q, k, v, dropout_seed=seed, **kw), rtol=TOL, atol=TOL
    )


def test_explicit_mesh_and_sharded_inputs(mesh):
    explicit = jax.make_mesh((2, 4), ("data", "model"))
    q, k, v, _ = _inputs()
    spec = P("data", None, "model")
    if hasattr(jax.sharding, "AxisType"):
        q, k, v = (jax.device_put(x, NamedSharding(explicit, spec)) for x in (q, k, v))
    out = flash_attention(q, k, v, mesh=explicit, in_specs=spec)
    np.testing.assert_allclose(out, reference_attention(q, k, v), rtol=TOL, atol=TOL)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (P("data", "model"), r"splits the sequence \(T=9, S=11\) into 4 shards, not evenly"),
        (P(None, None, None, "model"), r"shards head_dim"),
        (P("data", None, "nope"), r"names axis 'nope', not in mesh axes"),
        (P("model"), r"splits batch 4 into 4 shards|splits batch"),
    ],
)
def test_bad_specs_are_named(mesh, spec, match):
    q, k, v, _ = _inputs()
    if spec == P("model"):
        q, k, v = (x[:3] for x in (q, k, v))
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, mesh=mesh, in_specs=spec)


@pytest.mark.parametrize("under_jit", [False, True])
def test_already_sharded_inputs_run_per_shard(mesh, pallas_calls, under_jit):
    explicit = jax.make_mesh((2, 4), ("data", "model"))
    if not hasattr(jax.sharding, "AxisType"):
        pytest.skip("needs Explicit mesh axes (jax >= 0.7)")
    q, k, v, _ = _inputs()
    spec = P("data", None, "model")
    q, k, v = (jax.device_put(x, NamedSharding(explicit, spec)) for x in (q, k, v))
    fn = lambda q, k, v: flash_attention(q, k, v, causal=True, implementation="pallas")
    out = (jax.jit(fn) if under_jit else fn)(q, k, v)
    assert pallas_calls == [(B // 2, T, N // 4, H)]  # one shard's shape: the call ran per shard
    np.testing.assert_allclose(out, reference_attention(q, k, v, causal=True), rtol=TOL, atol=TOL)
    assert out.sharding.spec[:3] == spec[:3]


SEQ_CASES = {
    # name: (in_specs over a ("data", "sp") 2x4 mesh, kwargs)
    "zigzag-causal-docs-sinks": (P("data", "sp", None), {"causal": True}),
    "8way-window-softcap": (
        P(None, ("data", "sp")),
        {"causal": True, "sliding_window": (5, 0), "logits_soft_cap": 2.0},
    ),
    "heads-and-seq-full": (P(None, "sp", "data"), {}),
    # documents of 4 tokens: the contiguous split is as balanced as zigzag and is kept
    "contiguous-docs": (P("data", "sp", None), {"causal": True}),
}


def _matches_reference(sharded, kw, inputs, rng):
    """``sharded(q, key, v) -> (out, lse)`` against `reference_attention` with ``kw``:
    values, lse and the gradients of a random projection of both."""
    q = inputs[0]
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def loss(fn):
        def f(q, key, v):
            out, lse = fn(q, key, v)
            return jnp.sum(out * w) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        return f

    plain = lambda q, key, v: reference_attention(q, key, v, **kw)
    out, lse = jax.jit(sharded)(*inputs)
    want, want_lse = plain(*inputs)
    np.testing.assert_allclose(out, want, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(lse, want_lse, rtol=TOL, atol=TOL)
    got = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(*inputs)
    want_g = jax.grad(loss(plain), argnums=(0, 1, 2))(*inputs)
    for name, g, wg in zip("qkv", got, want_g, strict=True):
        np.testing.assert_allclose(g, wg, rtol=GRAD_TOL, atol=GRAD_TOL, err_msg=name)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.slow) if c == "8way-window-softcap" else c
        for c in SEQ_CASES
    ],
)
def test_sequence_sharding_matches_unsharded(case):
    """T sharded over "sp" (context parallelism): values, lse and gradients as unsharded."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets the host device count)")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "sp"))
    spec, kw = SEQ_CASES[case]
    rng = np.random.default_rng(5)
    b, t, n, k, h = 2, 32, 4, 2, 8
    q, key, v = (
        jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in ((b, t, n, h), (b, t, k, h), (b, t, k, h))
    )
    kw = dict(kw, return_lse=True)
    if case.endswith("docs-sinks"):
        ids = np.sort(rng.integers(0, 4, (b, t)), axis=1)
        ids[:, -3:] = -1
        kw.update(segment_ids=jnp.asarray(ids, jnp.int32), softmax_sinks=jnp.linspace(-1, 1, n))
    if case == "contiguous-docs":
        ids = np.repeat(np.arange(t // 4), 4)[None].repeat(b, 0)
        ids[1, -6:] = -1
        kw.update(segment_ids=jnp.asarray(ids, jnp.int32))
    sharded = lambda q, key, v: flash_attention(q, key, v, mesh=mesh, in_specs=spec, **kw)
    _matches_reference(sharded, kw, (q, key, v), rng)


def test_the_layout_follows_the_documents():
    """With segment ids a sequence-sharded causal call keeps the contiguous split where
    its busiest device has about zigzag's work (documents shorter than a shard), else lays
    the rows out in zigzag (one long document); every device of the mesh decides alike,
    the batch shards' documents counted together."""
    from ejk_attention._context_sharding import _contiguous_balanced
    from ejk_attention._shard_map import shard_map_compat

    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets the host device count)")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "sp"))
    t = 64
    short = np.repeat(np.arange(16), 4)
    one = np.zeros(t, int)

    def decide(rows):
        ids = jnp.asarray(np.stack(rows), jnp.int32)
        f = lambda x: _contiguous_balanced(x, seq_axis="sp", batch_axis="data", shards=4)[None]
        spread = shard_map_compat(
            f, mesh=mesh, in_specs=(P("data", "sp"),), out_specs=P(("data", "sp")), check=False
        )
        return np.asarray(jax.jit(spread)(ids)).tolist()

    assert decide([short, short]) == [True] * 8
    assert decide([one, one]) == [False] * 8
    assert decide([short, one]) == [False] * 8  # the batch shards' work together
    padded = short.copy()
    padded[32:] = -1  # the last two shards' rows see nothing: contiguous leaves them idle
    assert decide([padded, padded]) == [False] * 8


def test_the_facade_chooses_the_layout_when_the_call_runs(jaxpr_equations):
    """A sequence-sharded causal call with segment ids branches on the documents: one
    branch exchanges the rows into zigzag (``ppermute``), the other keeps the contiguous
    split (`test_the_layout_follows_the_documents` checks which runs); without ids no
    branch exchanges."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets the host device count)")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "sp"))
    q = jnp.zeros((2, 32, 4, 8))
    kv = jnp.zeros((2, 32, 2, 8))
    ids = jnp.zeros((2, 32), jnp.int32)
    spec = P("data", "sp", None)

    def exchanges(**kw):
        call = lambda q, k, v: flash_attention(q, k, v, mesh=mesh, in_specs=spec, causal=True, **kw)
        jaxpr = jax.make_jaxpr(call)(q, kv, kv).jaxpr
        conds = [e for e in jaxpr_equations(jaxpr) if e.primitive.name == "cond"]
        count = lambda b: sum(e.primitive.name == "ppermute" for e in jaxpr_equations(b.jaxpr))
        return [[count(b) for b in c.params["branches"]] for c in conds]

    # the steps' own branches (blocks of other documents skipped) exchange nothing
    [[zigzag, contiguous]] = [c for c in exchanges(segment_ids=ids) if any(c)]
    assert zigzag > 0 and contiguous == 0
    assert not any(any(c) for c in exchanges())


def test_sequence_sharding_runs_the_implementation_asked_for():
    """``implementation="triton"`` runs the kernels' steps (on CPU the interpreter; with
    all-gather one call per device, queries zigzag and keys contiguous); a backend without
    steps is refused with the reason."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets the host device count)")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "sp"))
    rng = np.random.default_rng(6)
    b, t, n, k, h = 2, 32, 4, 2, 8
    q, key, v = (
        jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in ((b, t, n, h), (b, t, k, h), (b, t, k, h))
    )
    ids = np.sort(rng.integers(0, 4, (b, t)), axis=1)
    ids[:, -3:] = -1
    kw = {"causal": True, "segment_ids": jnp.asarray(ids, jnp.int32), "return_lse": True}
    spec = P("data", "sp", None)
    sharded = lambda q, key, v: flash_attention(
        q, key, v, mesh=mesh, in_specs=spec, implementation="triton", **kw
    )
    _matches_reference(sharded, kw, (q, key, v), rng)
    with pytest.raises(NotImplementedError, match="names neither"):
        flash_attention(q, key, v, mesh=mesh, in_specs=spec, implementation="cudnn", **kw)


def test_sequence_sharding_refuses_what_it_cannot_serve(mesh):
    q, k, v, kw = _inputs()
    q, k, v = (x[:, :8] for x in (q, k, v))
    with pytest.raises(NotImplementedError, match="does not serve a bias"):
        flash_attention(q, k, v, kw["bias"][:, :, :8, :8], mesh=mesh, in_specs=P("data", "model"))
    cu = jnp.asarray([0, 3, 8], jnp.int32)
    with pytest.raises(NotImplementedError, match=r"packed input with cu_seqlens_k or segment ids"):
        flash_attention(
            q[:1],
            k[:1],
            v[:1],
            cu_seqlens_q=cu,
            cu_seqlens_k=jnp.asarray([0, 4, 8], jnp.int32),
            mesh=mesh,
            in_specs=P(None, "model"),
        )


@pytest.mark.parametrize("kw", [{"causal": True}, {"sliding_window": (3, 1)}])
def test_packed_sequences_in_a_sequence_sharded_call(mesh, kw):
    """cu_seqlens alone shards the sequence as the segment ids it describes: documents
    crossing shard boundaries, padding past the last one; values and gradients."""
    rng = np.random.default_rng(11)
    t = 32
    q, w = (jnp.asarray(rng.standard_normal((1, t, N, H)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((1, t, K, H)), jnp.float32) for _ in range(2))
    cu = jnp.asarray([0, 5, 5, 19, 29], jnp.int32)  # an empty sequence, 3 padding tokens

    def loss(fn, **extra):
        return lambda q, k, v: jnp.sum(fn(q, k, v, cu_seqlens_q=cu, **kw, **extra) * w)

    sharded = loss(flash_attention, mesh=mesh, in_specs=P(None, "model"), implementation="xla")
    got, got_g = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2)))(q, k, v)
    want, want_g = jax.value_and_grad(loss(reference_attention), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * float(jnp.sum(jnp.abs(w))))
    for name, g, wg in zip("qkv", got_g, want_g, strict=True):
        np.testing.assert_allclose(g, wg, rtol=GRAD_TOL, atol=GRAD_TOL, err_msg=name)


@pytest.mark.parametrize(
    "spec", [pytest.param(P("data", "model"), marks=pytest.mark.slow), P(None, "data", "model")]
)
def test_dropout_in_a_sequence_sharded_call_draws_the_global_mask(mesh, spec):
    """The ring's calls hash global rows and keys, and the batch/head shards around it
    their global indices: values and gradients equal the unsharded call's."""
    rng = np.random.default_rng(7)
    shapes = ((B, 16, N, H), (B, 16, K, H), (B, 16, K, H), (B, 16, N, H))
    q, k, v, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)
    kw = {"causal": True, "dropout_rate": 0.25}

    def loss(fn, **extra):
        return lambda q, k, v, seed: jnp.sum(fn(q, k, v, dropout_seed=seed, **kw, **extra) * w)

    sharded = loss(flash_attention, mesh=mesh, in_specs=spec, implementation="xla")
    seed = jnp.int32(-5)
    got, got_g = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2)))(q, k, v, seed)
    want, want_g = jax.value_and_grad(loss(reference_attention), argnums=(0, 1, 2))(q, k, v, seed)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * float(jnp.sum(jnp.abs(w))))
    for name, g, wg in zip("qkv", got_g, want_g, strict=True):
        np.testing.assert_allclose(g, wg, rtol=GRAD_TOL, atol=GRAD_TOL, err_msg=name)


def test_kernels_inside_a_users_shard_map_give_per_device_gradients():
    """The Triton kernels called in a model's own ``shard_map`` (type checks on, jax's
    default) over a batch-sharded mesh: each device's gradient is its own, not the sum
    over the devices (custom-call results must be typed as varying like their inputs)."""
    from ejk_attention._shard_map import shard_map_compat
    from ejk_kernels_gpu import flash_attention as kernel_attention

    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py sets the host device count)")
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    rng = np.random.default_rng(5)
    shapes = ((2, 8, 2, 8), (2, 8, 2, 8), (2, 8, 2, 8), (2, 8, 2, 8))
    q, k, v, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)
    spec = P("data")
    sharded = shard_map_compat(
        lambda q, k, v: kernel_attention(q, k, v), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec
    )

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    got = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(reference_attention), argnums=(0, 1, 2))(q, k, v)
    for name, g, wg in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(g, wg, rtol=GRAD_TOL, atol=GRAD_TOL, err_msg=name)


@pytest.mark.parametrize(
    ("shape", "shards", "want"),
    [
        ((1, 32768, 32, 8, 128), 2, "all_gather"),  # grouped heads: the gathered k/v are small
        ((1, 32768, 32, 32, 128), 2, "ring"),  # as many kv heads as query heads
        ((1, 32768, 32, 8, 128), 1, "ring"),
        ((1, 1 << 20, 32, 8, 128), 8, "ring"),  # the gathered k/v would pass the budget
    ],
)
def test_the_strategy_the_facade_picks(shape, shards, want):
    from ejk_attention._context_sharding import choose_strategy
    from ejk_sequtils import validate_attention

    b, t, n, kv, h = shape
    zeros = lambda *s: np.broadcast_to(np.zeros((), jnp.bfloat16), s)  # no memory behind
    q, k = zeros(b, t, n, h), zeros(b, t, kv, h)
    assert choose_strategy(validate_attention(q, k, k, causal=True), shards) == want
