"""blocksparse_attention in Pallas interpret mode: values and gradients against the f32 reference."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_tpu import (
    BlockSparseConfig,
    CausalMask,
    ChunkedCausalMask,
    FullMask,
    LocalMask,
    MultiHeadMask,
    NumpyMask,
    blocksparse_attention,
)
from ejk_sequtils import attention_tolerance, reference_attention

DROPOUT_SEED = 0xDEADBEEF  # above 2**31: the uint32 bits must survive the int32 carrier
SMALL_BLOCKS = BlockSparseConfig()  # 128 everywhere: several blocks per axis at T=256, S=384


@dataclasses.dataclass(frozen=True)
class Case:
    """One comparison: a mask and the reference options that define the same visibility."""

    name: str
    mask: object
    batch: int = 1
    q_len: int = 256
    kv_len: int = 384
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 64
    ref: tuple = ()  # reference kwargs as pairs; "dense_bias" / "dense_mask": the mask as a
    # -inf bias / as the reference's mask
    segments: bool = False
    soft_cap: float | None = None
    sinks: bool = False
    num_sinks: int = 0  # with sinks: [N] when 0, else [N, num_sinks]
    dropout: float = 0.0
    dtype: object = jnp.float32
    config: BlockSparseConfig | None = SMALL_BLOCKS


def _inputs(case: Case, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    b, t, s, n, kh, h = (
        case.batch,
        case.q_len,
        case.kv_len,
        case.heads,
        case.kv_heads,
        case.head_dim,
    )
    q = jax.random.normal(ks[0], (b, t, n, h), case.dtype)
    k = jax.random.normal(ks[1], (b, s, kh, h), case.dtype)
    v = jax.random.normal(ks[2], (b, s, kh, h), case.dtype)
    sink_shape = (n, case.num_sinks) if case.num_sinks else (n,)
    sinks = jax.random.normal(ks[3], sink_shape, jnp.float32) if case.sinks else None
    seg = None
    if case.segments:
        # Ragged segments from id 0, padding (id -1) at the ends, so some query rows see nothing.
        rng = np.random.default_rng(seed)
        q_ids = np.sort(rng.integers(-1, 3, (b, t)), axis=1).astype(np.int32)
        kv_ids = np.sort(rng.integers(0, 4, (b, s)), axis=1).astype(np.int32)
        kv_ids[:, -7:] = -1
        seg = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
    return q, k, v, sinks, seg


def _loss(out, lse):
    # Weights every output element differently; lse enters too, to test its cotangent.
    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
    finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(out.astype(jnp.float32) * w) + 0.25 * jnp.sum(finite_lse)


def _options(case, seg, sinks):
    """The keyword arguments the kernel and the reference take alike."""
    return {
        "segment_ids": seg,
        "logits_soft_cap": case.soft_cap,
        "softmax_sinks": sinks,
        "dropout_rate": case.dropout,
        "dropout_seed": DROPOUT_SEED if case.dropout else None,
        "return_lse": True,
    }


def _run_kernel(case, q, k, v, sinks, seg):
    def f(q, k, v, sinks):
        options = _options(case, seg, sinks)
        out, lse = blocksparse_attention(q, k, v, case.mask, **options, config=case.config)
        return _loss(out, lse), (out, lse)

    return f


def _run_reference(case, q, k, v, sinks, seg):
    kwargs = dict(case.ref)
    as_bias, as_mask = kwargs.pop("dense_bias", False), kwargs.pop("dense_mask", False)
    if as_bias or as_mask:
        dense = case.mask.dense()
        dense = jnp.asarray(dense[None] if dense.ndim == 3 else dense[None, None])
        # A -inf bias is soft-capped to a finite logit: with a cap, pass the mask itself.
        if as_mask:
            kwargs["mask"] = dense
        else:
            kwargs["bias"] = jnp.where(dense, 0.0, -jnp.inf)

    def f(q, k, v, sinks):
        out, lse = reference_attention(
            *(x.astype(jnp.float32) for x in (q, k, v)), **_options(case, seg, sinks), **kwargs
        )
        return _loss(out, lse), (out, lse)

    return f


def _compare(case: Case, grads: bool = True):
    q, k, v, sinks, seg = _inputs(case)
    argnums = (0, 1, 2, 3) if case.sinks else (0, 1, 2)
    tol = functools.partial(attention_tolerance, case.dtype)
    kern = _run_kernel(case, q, k, v, sinks, seg)
    ref = _run_reference(case, q, k, v, sinks, seg)
    if grads:
        (_, (out, lse)), g = jax.value_and_grad(kern, argnums, has_aux=True)(q, k, v, sinks)
        (_, (r_out, r_lse)), rg = jax.value_and_grad(ref, argnums, has_aux=True)(q, k, v, sinks)
    else:
        _, (out, lse) = kern(q, k, v, sinks)
        _, (r_out, r_lse) = ref(q, k, v, sinks)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (case.batch, case.heads, case.q_len) and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float32), r_out, atol=tol("out"), rtol=tol("out"))
    np.testing.assert_allclose(lse, r_lse, atol=tol("lse"), rtol=tol("lse"))
    if grads:
        for name, a, b, x in zip("q k v sinks".split(), g, rg, (q, k, v, sinks), strict=False):
            assert a.shape == x.shape and a.dtype == x.dtype, name
            assert np.isfinite(np.asarray(a, np.float32)).all(), name
            np.testing.assert_allclose(
                np.asarray(a, np.float32), b, atol=tol("grad"), rtol=tol("grad"), err_msg=name
            )
    return out


T, S = 256, 384
CASES = [
    Case("causal_gqa", CausalMask((T, S)), heads=4, kv_heads=2, ref=(("causal", True),)),
    # Every block whole: no partial block, so no tile is stored (the kernels used to
    # look one up while tracing the partial branch, and a plain call raised KeyError).
    Case("full_whole_blocks", FullMask((T, S)), heads=2, kv_heads=2),
    Case(
        "local_segments_softcap_sinks_mqa",
        LocalMask((T, S), window_size=(40, 10)),
        ref=(("sliding_window", (40, 10)),),
        segments=True,
        soft_cap=3.0,
        sinks=True,
    ),
    Case(
        "causal_dropout_segments_batch2",
        CausalMask((T, S)),
        batch=2,
        ref=(("causal", True),),
        segments=True,
        dropout=0.3,
    ),
    Case(
        "composed_multihead",
        MultiHeadMask(
            [
                ChunkedCausalMask((T, S), chunk_size=96) | LocalMask((T, S), window_size=(8, 8)),
                CausalMask((T, S), offset=64) & LocalMask((T, S), window_size=(200, None)),
            ]
        ),
        kv_heads=2,
        ref=(("dense_bias", True),),
    ),
    Case(
        "ragged_full_padding_rows",
        FullMask((19, 23)),
        batch=2,
        q_len=19,
        kv_len=23,
        heads=3,
        kv_heads=1,
        head_dim=40,
        segments=True,
    ),
    Case(
        "numpy_mask_empty_rows_sinks",
        NumpyMask(
            (np.random.default_rng(3).random((T, S)) < 0.05)
            & (np.arange(T)[:, None] % 50 != 7)  # rows 7, 57, ... see nothing
        ),
        ref=(("dense_bias", True),),
        sinks=True,
        config=BlockSparseConfig(block_q=256, block_kv=128, block_q_dkv=256),
    ),
    Case(
        "causal_three_sinks_per_head",  # [N, 3] sinks, folded by the validation
        CausalMask((128, 256)),
        q_len=128,
        kv_len=256,
        heads=4,
        kv_heads=2,
        ref=(("causal", True),),
        sinks=True,
        num_sinks=3,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_values_and_gradients_match_reference(case):
    _compare(case)


def test_bf16_values_and_gradients():
    mask = LocalMask((T, S), window_size=(100, 20))
    case = Case("bf16", mask, ref=(("sliding_window", (100, 20)),), dtype=jnp.bfloat16, sinks=True)
    _compare(case)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_head_dims(head_dim):
    case = Case(
        f"h{head_dim}",
        CausalMask((128, 128)),
        q_len=128,
        kv_len=128,
        head_dim=head_dim,
        ref=(("causal", True),),
    )
    _compare(case, grads=False)


def test_fully_masked_rows_give_zeros_and_zero_gradients():
    t = 128
    seg = jnp.asarray(np.r_[-np.ones(40), np.ones(88)].astype(np.int32))[None]  # 40 padding
    q, k, v = (jax.random.normal(jax.random.key(i), (1, t, 2, 64)) for i in range(3))

    def f(q):
        out, lse = blocksparse_attention(
            q, k, v, CausalMask((t, t)), segment_ids=seg, return_lse=True
        )
        return out.sum(), (out, lse)

    (_, (out, lse)), dq = jax.value_and_grad(f, has_aux=True)(q)
    assert (out[0, :40] == 0).all() and (lse[0, :, :40] == -jnp.inf).all()
    assert (dq[0, :40] == 0).all() and np.isfinite(dq).all()


@pytest.mark.parametrize(("batch", "q_len", "kv_len"), [(0, 16, 24), (2, 0, 24), (2, 16, 0)])
@pytest.mark.parametrize("sinks", [False, True])
def test_empty_axes_give_the_reference_answer_without_a_launch(batch, q_len, kv_len, sinks):
    q = jax.random.normal(jax.random.key(0), (batch, q_len, 4, 32))
    k = jax.random.normal(jax.random.key(1), (batch, kv_len, 2, 32))
    v = jax.random.normal(jax.random.key(2), (batch, kv_len, 2, 32))
    snk = jax.random.normal(jax.random.key(3), (4, 2)) if sinks else None
    seg = (jnp.zeros((batch, q_len), jnp.int32), jnp.zeros((batch, kv_len), jnp.int32))
    mask = jnp.ones((q_len, kv_len), bool)  # a Mask has positive sizes: an array stands in

    def run(fn, *extra):
        def f(q, k, v, snk):
            out, lse = fn(q, k, v, *extra, segment_ids=seg, softmax_sinks=snk, return_lse=True)
            return out.sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum(), (out, lse)

        return jax.value_and_grad(f, (0, 1, 2, 3) if sinks else (0, 1, 2), has_aux=True)

    (_, (out, lse)), grads = run(blocksparse_attention, mask)(q, k, v, snk)
    (_, (r_out, r_lse)), r_grads = run(reference_attention)(q, k, v, snk)
    assert out.shape == q.shape and lse.shape == (batch, 4, q_len)
    np.testing.assert_array_equal(out, r_out)
    np.testing.assert_array_equal(lse, r_lse)
    for a, b in zip(grads, r_grads, strict=True):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    if kv_len == 0 and batch * q_len:
        assert (out == 0).all() and (grads[0] == 0).all()
        want = jax.nn.logsumexp(snk, axis=1)[None, :, None] if sinks else -jnp.inf
        np.testing.assert_allclose(lse, jnp.broadcast_to(want, lse.shape), rtol=1e-6)
    jaxpr = jax.make_jaxpr(lambda q, k, v: blocksparse_attention(q, k, v, mask))(q, k, v)
    assert _pallas_grids(jaxpr) == {}


def test_traced_array_mask_matches_the_static_mask():
    """A bool array mask (here traced under jit) goes through process_dynamic_mask."""
    t, s = 128, 256
    mask = MultiHeadMask([CausalMask((t, s)), LocalMask((t, s), window_size=(20, 20))])
    q, k, v = (
        jax.random.normal(jax.random.key(i), shape)
        for i, shape in enumerate([(1, t, 2, 64), (1, s, 1, 64), (1, s, 1, 64)])
    )

    def value_and_grads(m):
        loss = lambda q, k, v: jnp.sum(blocksparse_attention(q, k, v, m) ** 2)
        return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)

    want = value_and_grads(mask)
    got = jax.jit(value_and_grads)(jnp.asarray(mask.dense()))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=5e-5)


def test_vmap_over_an_extra_axis():
    t = 128
    q = jax.random.normal(jax.random.key(0), (3, 1, t, 2, 64))
    k = jax.random.normal(jax.random.key(1), (3, 1, t, 1, 64))
    f = lambda q, k: jnp.sum(blocksparse_attention(q, k, k, CausalMask((t, t))) ** 2)
    values, grads = jax.vmap(jax.value_and_grad(f, (0, 1)))(q, k)
    for i in range(3):
        value, grad = jax.value_and_grad(f, (0, 1))(q[i], k[i])
        np.testing.assert_allclose(values[i], value, rtol=1e-6)
        for a, b in zip((grads[0][i], grads[1][i]), grad, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6)


def test_jit_and_determinism():
    case = CASES[0]
    q, k, v, _, _ = _inputs(case)
    f = jax.jit(lambda q, k, v: blocksparse_attention(q, k, v, case.mask, config=case.config))
    a, b = f(q, k, v), f(q, k, v)
    np.testing.assert_array_equal(a, b)


def test_dropout_seed_carriers_agree():
    """A seed above 2**31 as a Python int, a uint32 scalar and the int32 with its bits: one mask."""
    t = 128
    q, k = (jax.random.normal(jax.random.key(i), (1, t, 2, 64)) for i in range(2))
    seeds = (
        DROPOUT_SEED,
        jnp.uint32(DROPOUT_SEED),
        jnp.asarray(DROPOUT_SEED, jnp.uint32).view(jnp.int32),
    )
    outs = [
        blocksparse_attention(q, k, k, CausalMask((t, t)), dropout_rate=0.5, dropout_seed=seed)
        for seed in seeds
    ]
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_dropout_offsets_draw_a_shards_slice_of_the_whole_mask():
    """A shard of a larger call (batch row 1, head 1, query rows 128..255) with its origin
    in ``dropout_offsets`` drops what the whole call drops there: values and gradients."""
    from ejk_kernels_tpu import blocksparse_attention_request
    from ejk_sequtils import validate_attention

    ks = jax.random.split(jax.random.key(4), 4)
    q = jax.random.normal(ks[0], (2, 256, 2, 64))
    k, v = (jax.random.normal(key, (2, 128, 2, 64)) for key in ks[1:3])
    w = jax.random.normal(ks[3], (1, 128, 1, 64))
    shard = lambda x: x[1:, -128:, 1:] if x.shape[1] == 256 else x[1:, :, 1:]
    drop = {"dropout_rate": 0.4, "dropout_seed": DROPOUT_SEED}

    def part(q, k, v):
        request = validate_attention(q, k, v, **drop)
        request = dataclasses.replace(request, dropout_offsets=(1, 1, 128, 0))
        out = blocksparse_attention_request(request, None, config=SMALL_BLOCKS)
        return jnp.sum(out * w)

    def whole(q, k, v):
        return jnp.sum(shard(reference_attention(q, k, v, **drop)) * w)

    got, got_g = jax.value_and_grad(part, argnums=(0, 1, 2))(*map(shard, (q, k, v)))
    want, want_g = jax.value_and_grad(whole, argnums=(0, 1, 2))(q, k, v)
    tol = attention_tolerance("float32")
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 128 * 64)
    for name, g, wg in zip("qkv", got_g, want_g, strict=True):
        np.testing.assert_allclose(g, shard(wg), rtol=tol, atol=tol, err_msg=name)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (
            {
                "q": jnp.zeros((1, 8, 3, 16)),
                "k": jnp.zeros((1, 8, 2, 16)),
                "v": jnp.zeros((1, 8, 2, 16)),
            },
            ValueError,
            "q heads=3 must be a multiple",
        ),
        ({"v": jnp.zeros((1, 8, 1, 8))}, NotImplementedError, "v's head_dim 8 == q's 16"),
        ({"mask": CausalMask((8, 9))}, ValueError, r"mask shape \(8, 9\)"),
        (
            {"mask": MultiHeadMask([CausalMask((8, 8))] * 3)},
            ValueError,
            r"MultiHeadMask shape \(3, 8, 8\)",
        ),
        ({"logits_soft_cap": -1.0}, ValueError, "logits_soft_cap must be a finite number > 0"),
        # jaxtyping (on in tests) or the ValueError (in production) names the argument.
        ({"softmax_sinks": jnp.zeros(3)}, (ValueError, TypeError), "softmax_sinks"),
        ({"segment_ids": jnp.zeros((1, 9), jnp.int32)}, (ValueError, TypeError), "segment_ids"),
        ({"config": {"block_q": 128}}, TypeError, "config"),
        ({"dropout_rate": 0.1}, ValueError, "dropout_seed is required"),
        ({"dropout_rate": 1.0, "dropout_seed": 1}, ValueError, r"dropout_rate must be in \[0, 1\)"),
        (
            {"dropout_rate": 0.1, "dropout_seed": jnp.zeros(2, jnp.int32)},
            (ValueError, TypeError),
            "dropout_seed",
        ),
        ({"mask": jnp.ones((8, 8), jnp.int32)}, TypeError, "mask"),
        ({"mask": jnp.ones((3, 8, 8), bool)}, (ValueError, TypeError), "mask"),
        ({"mask": "causal"}, TypeError, "mask"),
    ],
)
def test_errors(kwargs, exc, match):
    args = {
        "q": jnp.zeros((1, 8, 2, 16)),
        "k": jnp.zeros((1, 8, 1, 16)),
        "v": jnp.zeros((1, 8, 1, 16)),
        "mask": CausalMask((8, 8)),
    }
    args.update(kwargs)
    q, k, v, mask = args.pop("q"), args.pop("k"), args.pop("v"), args.pop("mask")
    with pytest.raises(exc, match=match):
        blocksparse_attention(q, k, v, mask, **args)


def test_config_validation():
    with pytest.raises(ValueError, match="block_kv_dq=96"):
        BlockSparseConfig(block_kv_dq=96)
    with pytest.raises(ValueError, match="block_q=64"):
        BlockSparseConfig(block_q=64)
    with pytest.raises(TypeError, match="block_q must be an int"):
        BlockSparseConfig(block_q=128.0)


WIDE = [
    Case(
        f"wide_{i}",
        mask,
        batch=2,
        q_len=t,
        kv_len=s,
        heads=4,
        kv_heads=kh,
        segments=seg,
        soft_cap=cap,
        sinks=sink,
        ref=ref,
        config=cfg,
    )
    for i, (mask, t, s, kh, seg, cap, sink, ref, cfg) in enumerate(
        [
            (CausalMask((512, 512)), 512, 512, 1, True, None, True, (("causal", True),), None),
            (
                LocalMask((384, 640), window_size=(100, 0)),
                384,
                640,
                2,
                False,
                10.0,
                False,
                (("sliding_window", (100, 0)),),
                BlockSparseConfig(block_kv=256, block_q_dq=256, block_kv_dkv=256),
            ),
            (
                ChunkedCausalMask((300, 300), chunk_size=70),
                300,
                300,
                4,
                True,
                None,
                True,
                (("dense_bias", True),),
                None,
            ),
        ]
    )
]


@pytest.mark.slow
@pytest.mark.parametrize("case", WIDE, ids=lambda c: c.name)
def test_wide_grid(case):
    _compare(case)


def _pallas_calls(jaxpr):
    """name -> (grid, operand avals) of every pallas_call in a (closed) jaxpr, nested included."""
    calls = {}

    def subjaxprs(value):
        values = value if isinstance(value, tuple | list) else (value,)
        for v in values:
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                yield v.jaxpr

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "pallas_call":
                # The kernel name's parameter differs between jax versions.
                name = eqn.params.get("name", eqn.params.get("name_and_src_info"))
                grid = tuple(eqn.params["grid_mapping"].grid)
                calls[str(getattr(name, "name", name))] = (grid, [v.aval for v in eqn.invars])
            for value in eqn.params.values():
                for sub in subjaxprs(value):
                    walk(sub)

    walk(jaxpr.jaxpr)
    return calls


def _pallas_grids(jaxpr):
    """name -> grid of every pallas_call in a (closed) jaxpr."""
    return {name: grid for name, (grid, _) in _pallas_calls(jaxpr).items()}


def test_grids_walk_only_the_needed_blocks():
    """A narrow window: every kernel's reduction axis is cut to the blocks a row needs."""
    t = 1024
    mask = LocalMask((t, t), window_size=(100, 0))  # a q block needs at most 2 kv blocks
    q = jnp.zeros((1, t, 4, 64))
    kv = jnp.zeros((1, t, 2, 64))
    loss = lambda q, k, v: blocksparse_attention(q, k, v, mask, config=SMALL_BLOCKS).sum()
    grids = _pallas_grids(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, kv, kv))
    assert grids["ejk_blocksparse_fwd"] == (1, 4, 8, 2)
    assert grids["ejk_blocksparse_dq"] == (1, 4, 8, 2)
    # dkv: a kv block is needed by at most 2 q blocks, for each of the group's 2 heads.
    assert grids["ejk_blocksparse_dkv"] == (1, 2, 8, 2 * 2)


def _random_computable(rng, shape):
    """A random &/| composition of causal, local and chunked masks (offsets, open sides)."""

    def leaf():
        kind = rng.integers(3)
        if kind == 0:
            return CausalMask(shape, offset=int(rng.integers(-40, 80)))
        if kind == 1:
            sides = [None if rng.random() < 0.3 else int(rng.integers(0, 90)) for _ in range(2)]
            return LocalMask(shape, window_size=tuple(sides), offset=int(rng.integers(-30, 30)))
        return ChunkedCausalMask(shape, chunk_size=int(rng.integers(16, 160)))

    mask = leaf()
    for _ in range(int(rng.integers(1, 3))):
        mask = (mask & leaf()) if rng.random() < 0.5 else (mask | leaf())
    return mask


@pytest.mark.parametrize("seed", range(3))
def test_mask_function_path_equals_stored_tiles_on_random_masks(seed):
    """A computable mask evaluated in the kernels gives the stored-tile path's values and
    gradients exactly, and the reference's within tolerance; T, S not multiples of a block."""
    rng = np.random.default_rng(seed)
    t, s = 200, 328  # padded to 256 x 384: the padding is part of the mask function
    mask = _random_computable(rng, (t, s))
    case = Case(
        "random_computable",
        mask,
        q_len=t,
        kv_len=s,
        heads=4,
        kv_heads=2,
        ref=(("dense_mask", True),),
        segments=seed == 1,
        soft_cap=5.0 if seed == 2 else None,
    )
    out = _compare(case)
    q, k, v, sinks, seg = _inputs(case)

    def run(mask_function):
        def loss(q, k, v):
            out, lse = blocksparse_attention(
                q,
                k,
                v,
                mask,
                **_options(case, seg, sinks),
                config=SMALL_BLOCKS,
                mask_function=mask_function,
            )
            return _loss(out, lse), out

        return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)

    (_, fn_out), fn_grads = run(True)
    (_, tile_out), tile_grads = run(False)
    np.testing.assert_array_equal(fn_out, tile_out)
    np.testing.assert_array_equal(fn_out, out)
    for a, b in zip(fn_grads, tile_grads, strict=True):
        np.testing.assert_array_equal(a, b)


def test_mask_function_path_loads_no_tiles():
    """Causal: the kernels evaluate the mask from grid positions and take no mask input (only
    the SMEM tables); mask_function=False or a NumpyMask brings the int8 tiles back."""
    t = 256
    q = jnp.zeros((1, t, 2, 64))
    kv = jnp.zeros((1, t, 1, 64))

    def operands(mask, **kwargs):
        loss = lambda q, k, v: blocksparse_attention(
            q, k, v, mask, config=SMALL_BLOCKS, **kwargs
        ).sum()
        calls = _pallas_calls(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, kv, kv))
        assert set(calls) == {"ejk_blocksparse_fwd", "ejk_blocksparse_dq", "ejk_blocksparse_dkv"}
        return [aval for _, avals in calls.values() for aval in avals]

    def tiles(avals):
        return [a for a in avals if a.dtype == jnp.int8 and a.shape[1:] == (128, 128)]

    causal = CausalMask((t, t))
    computed = operands(causal)
    assert not tiles(computed)
    for tiled in (operands(causal, mask_function=False), operands(NumpyMask(causal.dense()))):
        assert len(tiles(tiled)) == 3
        assert len(tiled) == len(computed) + 3  # one tile operand per kernel, nothing else


def test_reject_empty_rows_is_splash_rule():
    """reject_empty_rows=True raises (splash's mask check); the default gives zeros."""
    t = 128
    q = jax.random.normal(jax.random.key(0), (1, t, 2, 64))
    mask = CausalMask((t, t), offset=-1)  # row 0 sees no key
    out = blocksparse_attention(q, q, q, mask)
    np.testing.assert_array_equal(out[:, 0], 0.0)
    with pytest.raises(ValueError, match=r"row 0 of the mask \(head 0\) sees no key"):
        blocksparse_attention(q, q, q, mask, reject_empty_rows=True)
    dense = jnp.asarray(mask.dense())
    with pytest.raises(ValueError, match="row 0"):
        blocksparse_attention(q, q, q, dense, reject_empty_rows=True)
    with pytest.raises(NotImplementedError, match="traced"):
        jax.jit(lambda m: blocksparse_attention(q, q, q, m, reject_empty_rows=True))(dense)
    blocksparse_attention(q, q, q, CausalMask((t, t)), reject_empty_rows=True)
