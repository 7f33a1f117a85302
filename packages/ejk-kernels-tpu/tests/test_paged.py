"""The ragged paged attention kernel in Pallas' TPU interpreter, against the float32 paged
reference (`ejk_sequtils.paged_reference_attention`).

Page tables are random (pages shared between sequences and listed out of order); their
entries past each sequence's last page hold pages outside the pool, and every pool slot no
sequence uses holds NaN, so a kernel that reads either fails.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_executor import ConfigCache, ConfigSelectorChain, Executor
from ejk_kernels_tpu import (
    PagedShape,
    RaggedPagedAttention,
    RaggedPagedConfig,
    fits_paged_vmem,
    paged_attention,
    paged_attention_request,
    paged_shape,
    paged_vmem_bytes,
    ragged_paged_heuristic,
    ragged_paged_search_space,
    unsupported_paged_reason,
)
from ejk_sequtils import (
    FP8_KV_DTYPE,
    assert_allclose,
    attention_tolerance,
    paged_reference_attention,
    quantize_kv,
    validate_paged_attention,
)

POOL, PAGE, H = 11, 8, 32


def _pool_and_table(rng, kv_lens, *, cols, kv_heads, dtype):
    """k and v pools (NaN in every slot no sequence uses) and a random table."""
    table = rng.integers(0, POOL, size=(len(kv_lens), cols)).astype(np.int32)
    for b, n in enumerate(kv_lens):
        table[b, -(-n // PAGE) :] = rng.choice([-5, POOL + 3])  # never read
    used = np.zeros((POOL, PAGE), bool)
    for b, n in enumerate(kv_lens):
        for j in range(n):
            used[table[b, j // PAGE], j % PAGE] = True
    pools = []
    for _ in range(2):
        pool = rng.standard_normal((POOL, PAGE, kv_heads, H)).astype(np.float32)
        pool[~used] = np.nan
        pools.append(jnp.asarray(pool, dtype))
    return pools, jnp.asarray(table), jnp.asarray(np.asarray(kv_lens, np.int32))


def _inputs(seed, kv_lens, *, cols, heads, kv_heads, dtype, q_shape):
    rng = np.random.default_rng(seed)
    (k, v), table, lens = _pool_and_table(rng, kv_lens, cols=cols, kv_heads=kv_heads, dtype=dtype)
    q = jnp.asarray(rng.standard_normal((*q_shape, heads, H)), dtype)
    return q, k, v, table, lens


def _features(features, heads):
    kwargs = dict(features)
    if kwargs.pop("softmax_sinks", False):
        sinks = np.random.default_rng(3).standard_normal((heads, 2))
        kwargs["softmax_sinks"] = jnp.asarray(sinks, jnp.float32)
    return kwargs


def _check(args, kwargs, dtype, **call):
    out = paged_attention(*args, **kwargs, **call)
    assert out.shape == args[0].shape and out.dtype == dtype
    f32 = [x.astype(jnp.float32) for x in args[:3]]
    expected = paged_reference_attention(validate_paged_attention(*f32, *args[3:], **kwargs))
    tol = attention_tolerance(dtype, "out")
    assert_allclose(out, expected, rtol=tol, atol=tol)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    return out


CASES = [
    # (dtype, T, heads, kv_heads, features, config)
    (jnp.float32, 1, 6, 2, {}, None),
    (jnp.float32, 1, 4, 1, {"sliding_window": (9, 0)}, RaggedPagedConfig(pages_per_block=3)),
    (jnp.float32, 5, 6, 3, {"logits_soft_cap": 3.0, "softmax_sinks": True}, None),
    (jnp.float16, 2, 4, 2, {"sliding_window": (20, 0)}, None),  # the interpreter only
    (
        jnp.bfloat16,
        19,
        4,
        2,
        {"sliding_window": 12, "logits_soft_cap": 5.0, "softmax_sinks": True},
        RaggedPagedConfig(block_q=16, pages_per_block=2),
    ),
]


@pytest.mark.parametrize(("dtype", "q_len", "heads", "kv_heads", "features", "config"), CASES)
def test_matches_reference(dtype, q_len, heads, kv_heads, features, config):
    cols = 6
    # idle, shorter than T (negative positions), a page edge, random, full.
    kv_lens = [0, max(q_len - 3, 1), PAGE, 29, cols * PAGE]
    args = _inputs(q_len, kv_lens, cols=cols, heads=heads, kv_heads=kv_heads, dtype=dtype,
                   q_shape=(len(kv_lens), q_len))  # fmt: skip
    out = _check(args, _features(features, heads), dtype, config=config)
    assert np.all(np.asarray(out[0], np.float32) == 0)  # the idle slot


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_batch_mixes_prefill_and_decode(dtype):
    """Query blocks span several sequences (8 rows: decode rows share a block with a
    prefill chunk's tail) and a chunk spans several blocks."""
    kv_lens = [40, 3, 0, 48, 9, 2, 17]
    q_lens = [13, 1, 0, 1, 9, 4, 1]  # prefill chunks, decode steps, an idle slot, T_b > kv_len
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    args = _inputs(7, kv_lens, cols=6, heads=4, kv_heads=2, dtype=dtype, q_shape=(int(cu[-1]),))
    kwargs = {"sliding_window": (20, 0), "logits_soft_cap": 6.0, "cu_q_lens": cu}
    _check(args, _features({**kwargs, "softmax_sinks": True}, 4), dtype,
           config=RaggedPagedConfig(block_q=8, pages_per_block=2))  # fmt: skip


def _fp8(args, *, scalar):
    """``args`` with fp8 pools (NaN slots stay NaN, their scales too) and their scales."""
    q, k, v, table, lens = args
    if scalar:
        scales = {"k_scales": jnp.float32(1 / 64), "v_scales": 1 / 32}
        k, v = ((x.astype(jnp.float32) / s).astype(FP8_KV_DTYPE)
                for x, s in ((k, 1 / 64), (v, 1 / 32)))  # fmt: skip
    else:
        (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
        scales = {"k_scales": ks, "v_scales": vs}
    return (q, k, v, table, lens), scales


@pytest.mark.parametrize("scalar", [False, True], ids=["per_token", "scalar"])
@pytest.mark.parametrize(
    ("dtype", "q_len", "heads", "kv_heads", "features", "config"),
    [
        (jnp.float32, 1, 6, 2, {}, RaggedPagedConfig(block_q=8, pages_per_block=2)),  # GQA decode
        (jnp.bfloat16, 5, 4, 1, {"sliding_window": (9, 0), "softmax_sinks": True}, None),  # MQA
    ],
)
def test_fp8_matches_reference_on_the_dequantised_cache(dtype, q_len, heads, kv_heads,
                                                        features, config, scalar):  # fmt: skip
    """fp8 pages copied as e4m3 and dequantised in the kernel (per-token or scalar scales);
    the reference dequantises (`ejk_sequtils.dequantize_kv`)."""
    cols = 6
    kv_lens = [0, 2, PAGE, 29, cols * PAGE]
    args = _inputs(31, kv_lens, cols=cols, heads=heads, kv_heads=kv_heads, dtype=dtype,
                   q_shape=(len(kv_lens), q_len))  # fmt: skip
    args, scales = _fp8(args, scalar=scalar)
    kwargs = _features(features, heads)
    out = paged_attention(*args, **scales, **kwargs, config=config)
    assert out.shape == args[0].shape and out.dtype == dtype
    expected = paged_reference_attention(
        validate_paged_attention(args[0].astype(jnp.float32), *args[1:], **scales, **kwargs)
    )
    tol = attention_tolerance(dtype, "out")
    assert_allclose(out, expected, rtol=tol, atol=tol)
    assert np.all(np.asarray(out[0], np.float32) == 0)  # the idle slot


def test_configs_agree_and_rows_past_cu_are_zero_under_jit():
    """Traced lengths: one compiled step serves new lengths; rows past ``cu_q_lens[-1]``
    (possible only when traced) give zeros; every block size gives the same values."""
    args = _inputs(4, [30, 4, 12], cols=5, heads=4, kv_heads=1, dtype=jnp.float32, q_shape=(20,))
    q, k, v, table, lens = args
    cu = jnp.asarray([0, 9, 10, 16], jnp.int32)
    step = jax.jit(lambda *a, cu, cfg: paged_attention(*a, cu_q_lens=cu, config=cfg),
                   static_argnames="cfg")  # fmt: skip
    cfg = RaggedPagedConfig(block_q=8, pages_per_block=1)
    out = step(*args, cu=cu, cfg=cfg)
    expected = paged_reference_attention(validate_paged_attention(q[:16], k, v, table, lens,
                                                                  cu_q_lens=cu))  # fmt: skip
    assert_allclose(out[:16], expected, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out[16:]) == 0)
    other = step(q, k, v, table, jnp.asarray([25, 1, 7], jnp.int32), cu=cu, cfg=cfg)
    expected = paged_reference_attention(
        validate_paged_attention(q[:16], k, v, table, jnp.asarray([25, 1, 7], jnp.int32),
                                 cu_q_lens=cu))  # fmt: skip
    assert_allclose(other[:16], expected, rtol=1e-5, atol=1e-5)
    wide = step(*args, cu=cu, cfg=RaggedPagedConfig(block_q=32, pages_per_block=4))
    assert_allclose(wide, out, rtol=1e-5, atol=1e-5)


def test_empty_calls_give_zeros():
    args = _inputs(1, [0, 0], cols=2, heads=2, kv_heads=1, dtype=jnp.float32, q_shape=(2, 3))
    assert np.all(np.asarray(paged_attention(*args)) == 0)
    q, k, v, table, lens = args
    out = paged_attention(q[:, :0], k, v, table, lens)
    assert out.shape == (2, 0, 2, H)


def test_refusals_and_config_checks():
    q, k, v, table, lens = _inputs(2, [3, 9], cols=2, heads=2, kv_heads=1,
                                   dtype=jnp.float16, q_shape=(2, 1))  # fmt: skip
    request = validate_paged_attention(q, k, v, table, lens)
    reason = unsupported_paged_reason(request, interpret=False)
    assert reason is not None and "float16" in reason
    with pytest.raises(NotImplementedError, match="float16"):
        paged_attention_request(request, interpret=False)
    assert unsupported_paged_reason(request) is None  # the interpreter takes float16
    # Heads whose smallest blocks overflow VMEM are refused when compiling, not in the interpreter.
    huge = validate_paged_attention(
        jnp.zeros((1, 1, 512, 256)), jnp.zeros((2, 64, 1, 256)), jnp.zeros((2, 64, 1, 256)),
        jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32))  # fmt: skip
    assert "VMEM" in unsupported_paged_reason(huge, interpret=False)
    assert unsupported_paged_reason(huge) is None
    with pytest.raises(TypeError, match="config"):  # beartype in tests, else the check
        paged_attention_request(request, config={"block_q": 8})
    with pytest.raises(ValueError, match="block_q must be a power of two >= 8"):
        RaggedPagedConfig(block_q=12)
    with pytest.raises(ValueError, match="pages_per_block must be positive"):
        RaggedPagedConfig(pages_per_block=0)
    with pytest.raises(TypeError, match="pages_per_block must be an int"):
        RaggedPagedConfig(pages_per_block=2.0)


def _shape(**sizes):
    base = dict(batch=32, q_rows=1, ragged=False, heads=32, kv_heads=8, head_dim=128,
                page_size=64, pages_per_seq=128, itemsize=2)  # fmt: skip
    return PagedShape(**{**base, **sizes})


def test_fp8_pages_budget_their_scales():
    """fp8 pages: the scale slots ([page_size, K] f32, K padded to 128 lanes) count in the
    VMEM estimate, and the heuristic still fits; `paged_shape` reads the pages' dtype."""
    plain, fp8 = _shape(), _shape(fp8_pages=True)
    cfg = RaggedPagedConfig(block_q=8, pages_per_block=8)
    extra = 2 * 2 * 8 * 64 * 128 * 4
    assert paged_vmem_bytes(cfg, fp8) == paged_vmem_bytes(cfg, plain) + extra
    assert fits_paged_vmem(ragged_paged_heuristic(fp8), fp8)
    pages = jax.ShapeDtypeStruct((4, 64, 8, 128), jnp.float8_e4m3fn)
    q = jax.ShapeDtypeStruct((2, 1, 32, 128), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((2, 3), jnp.int32)
    assert paged_shape(q, pages, table, ragged=False).fp8_pages


def test_heuristic_and_search_space():
    decode = _shape()
    assert ragged_paged_heuristic(decode) == RaggedPagedConfig(block_q=8, pages_per_block=8)
    prefill = _shape(batch=8, q_rows=4096, ragged=True, pages_per_seq=64)
    cfg = ragged_paged_heuristic(prefill)
    assert cfg.block_q >= 32 and cfg.pages_per_block * 64 >= 256
    assert fits_paged_vmem(cfg, prefill)
    space = ragged_paged_search_space(_shape(q_rows=16))
    assert ragged_paged_heuristic(decode) in space and len(space) > 10
    assert all(fits_paged_vmem(c, decode) for c in space)
    # A large group shrinks the blocks until they fit.
    big = _shape(batch=1, q_rows=512, heads=64, kv_heads=1, head_dim=256, itemsize=4)
    cfg = ragged_paged_heuristic(big)
    assert fits_paged_vmem(cfg, big) and cfg.block_q < 64


def test_executor_kernel():
    args = _inputs(5, [3, 20], cols=3, heads=4, kv_heads=2, dtype=jnp.float32, q_shape=(2, 2))
    executor = Executor(ConfigSelectorChain(cache=ConfigCache()))
    kernel = RaggedPagedAttention()
    inv = executor.invocation(kernel, *args, sliding_window=(5, 0))
    heuristic = kernel.heuristic_cfg(inv)
    shape = _shape(batch=2, q_rows=2, heads=4, kv_heads=2, head_dim=H, page_size=PAGE,
                   pages_per_seq=3, itemsize=4)  # fmt: skip
    assert heuristic == ragged_paged_heuristic(shape)
    assert executor.choose(kernel, *args, sliding_window=(5, 0)).cfg == heuristic
    assert list(kernel.config_space(inv)) == [heuristic]  # off TPU: the heuristic only
    on_tpu = list(kernel.config_space(dataclasses.replace(inv, platform="pallas")))
    assert heuristic in on_tpu and len(on_tpu) > 1
    out = executor(kernel, *args, sliding_window=(5, 0))
    assert_allclose(out, paged_attention(*args, sliding_window=(5, 0)), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(24))
def test_sampled_grid(seed):
    """Random batch, lengths, table width, heads (GQA, MQA), T up to 40, features, dtype,
    config; and the same rows as one ragged call."""
    rng = np.random.default_rng(200 + seed)
    choices = ([1, 2, 3], [1, 2, 4], range(1, 7), [1, 2, 7, 23, 40], range(1, 5))
    kv_heads, group, cols, q_len, batch = (int(rng.choice(c)) for c in choices)
    heads = kv_heads * group
    # An idle or a full sequence first, then any lengths.
    kv_lens = [int(rng.choice([0, cols * PAGE])), *rng.integers(0, cols * PAGE + 1, batch - 1)]
    dtype = (jnp.float32, jnp.bfloat16)[seed % 2]
    config = RaggedPagedConfig(block_q=int(rng.choice([8, 16, 32])),
                               pages_per_block=int(rng.integers(1, cols + 1)))  # fmt: skip
    args = _inputs(seed, kv_lens, cols=cols, heads=heads, kv_heads=kv_heads, dtype=dtype,
                   q_shape=(batch, q_len))  # fmt: skip
    offered = {
        "sliding_window": (int(rng.integers(0, 30)), int(rng.integers(0, 3))),
        "logits_soft_cap": float(rng.uniform(1, 20)),
        "softmax_sinks": True,
    }
    chosen = dict(zip(offered, rng.random(len(offered)) < 0.45, strict=True))
    kwargs = _features({k: v for k, v in offered.items() if chosen[k]}, heads)
    _check(args, kwargs, dtype, config=config)
    q_lens = rng.integers(0, q_len + 1, size=batch)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    rows = [(b, t) for b, n in enumerate(q_lens) for t in range(n)]
    q = args[0].reshape(-1, heads, H)[np.asarray([b * q_len + t for b, t in rows], int)]
    _check((q, *args[1:]), {**kwargs, "cu_q_lens": cu}, dtype, config=config)


def test_no_races_between_the_copies_and_the_compute():
    """The interpreter's race detector on two simulated cores (the q-block axis is
    parallel): no slot is read while a copy into it is in flight, no two cores write one
    block. Uninitialised VMEM is NaN (the interpreter's default): uncopied slots stay hidden."""
    ipc = pytest.importorskip("jax._src.pallas.mosaic.interpret.interpret_pallas_call")
    from jax.experimental.pallas import tpu as pltpu

    kv_lens, q_lens = [40, 3, 0, 30], [13, 1, 0, 4]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    args = _inputs(8, kv_lens, cols=6, heads=4, kv_heads=2, dtype=jnp.float32, q_shape=(18,))
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    pltpu.reset_tpu_interpret_mode_state()
    try:
        out = _check(args, {"cu_q_lens": cu, "sliding_window": (17, 0)}, jnp.float32,
                     config=RaggedPagedConfig(block_q=8, pages_per_block=1), interpret=params)  # fmt: skip
        jax.block_until_ready(out)
        assert ipc.races is not None, "the race detector did not run"
        assert not ipc.races.races_found
    finally:
        pltpu.reset_tpu_interpret_mode_state()


def _open(jaxpr):
    """The open jaxpr of ``jaxpr`` (a closed one's inside; jax >= 0.12 merged the two)."""
    return jaxpr if hasattr(jaxpr, "eqns") else jaxpr.jaxpr


def _equations(jaxpr):
    """Every equation of ``jaxpr`` in program order, those of its sub-jaxprs inlined."""
    from jax.extend import core  # public names on every jax the package supports

    for eqn in _open(jaxpr).eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, core.ClosedJaxpr | core.Jaxpr):
                    yield from _equations(sub)


def test_the_next_blocks_copy_starts_before_the_current_one_is_computed():
    """The kernel's walk over kv blocks: each step starts the copies of the next block's
    pages (k and v, ``pages_per_block`` each), then waits for the current block's, then
    computes."""
    q = jnp.zeros((2, 1, 4, H))
    pages = jnp.zeros((POOL, PAGE, 2, H))
    table, lens = jnp.zeros((2, 3), jnp.int32), jnp.asarray([3, 20], jnp.int32)
    config = RaggedPagedConfig(block_q=8, pages_per_block=2)
    call = lambda *a: paged_attention(*a, config=config, interpret=False)
    outer = jax.make_jaxpr(call)(q, pages, pages, table, lens).jaxpr
    (kernel,) = [e for e in _equations(outer) if e.primitive.name == "pallas_call"]
    walks = [e for e in _open(kernel.params["jaxpr"]).eqns if e.primitive.name == "while"]
    walk = walks[-1].params["body_jaxpr"]  # the (sequence, kv block) walk
    names = [e.primitive.name for e in _equations(walk)]
    assert names.count("dma_start") == 2 * 2 and names.count("dma_wait") == 2 * 2
    first = {name: names.index(name) for name in ("dma_start", "dma_wait", "dot_general")}
    assert first["dma_start"] < first["dma_wait"] < first["dot_general"]
