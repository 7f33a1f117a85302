"""The split-KV paged attention kernel against `ejk_sequtils.paged_reference_attention`
(Triton's interpreter on CPU), and the decode route of `flash_attention`."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_gpu import (
    FlashConfig,
    PagedAttention,
    PagedConfig,
    flash_attention,
    paged_attention,
    paged_attention_request,
    paged_heuristic,
    paged_search_space,
    unsupported_paged_reason,
)
from ejk_kernels_gpu.flash import _decode, _select
from ejk_kernels_gpu.paged import _launch as _paged_launch
from ejk_kernels_gpu.paged._config import tile_shape
from ejk_sequtils import (
    FP8_KV_DTYPE,
    paged_reference_attention,
    quantize_kv,
    reference_attention,
    validate_paged_attention,
)

# Past a sequence's last page the table holds ids far outside the pool: a read of one
# would fault or bring garbage into the output.
GARBAGE_PAGE = 1 << 20


def paged_inputs(rng, *, batch, q_len, heads, kv_heads, head_dim, page, pages_per_seq,
                 dtype=jnp.float32, ragged=None, kv_lens=None):  # fmt: skip
    """Random q, a pool with shared and out-of-order pages, kv_lens from 0 to capacity.

    ``ragged``: per-sequence query counts (the ragged form); kv_lens then hold them.
    """
    capacity = page * pages_per_seq
    pool = max(batch * pages_per_seq // 2, 1)  # fewer pages than slots: sequences share pages
    table = rng.integers(0, pool, (batch, pages_per_seq)).astype(np.int32)
    if kv_lens is None:
        kv_lens = rng.integers(0, capacity + 1, batch)
        kv_lens[0] = capacity
        if batch > 2:
            kv_lens[1] = 0
    kv_lens = np.asarray(kv_lens, np.int32)
    if ragged is not None:
        kv_lens = np.clip(np.maximum(kv_lens, ragged), 0, capacity).astype(np.int32)
    used = -(-kv_lens // page)
    table[np.arange(pages_per_seq)[None, :] >= used[:, None]] = GARBAGE_PAGE
    k = rng.standard_normal((pool, page, kv_heads, head_dim))
    v = rng.standard_normal((pool, page, kv_heads, head_dim))
    extra = {}
    if ragged is not None:
        cu = np.concatenate([[0], np.cumsum(ragged)]).astype(np.int32)
        q = rng.standard_normal((int(cu[-1]), heads, head_dim))
        extra["cu_q_lens"] = jnp.asarray(cu)
    else:
        q = rng.standard_normal((batch, q_len, heads, head_dim))
    arrays = tuple(jnp.asarray(x, dtype) for x in (q, k, v))
    return (*arrays, jnp.asarray(table), jnp.asarray(kv_lens)), extra


def check(args, extra, config, close, dtype=jnp.float32, **kwargs):
    out = paged_attention(*args, config=config, **extra, **kwargs)
    request = validate_paged_attention(*args, **extra, **kwargs)
    expected = paged_reference_attention(request)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    close(out, expected, dtype, "out")
    return out


# (batch, q_len, heads, kv_heads, head_dim, page, pages_per_seq, config)
CASES = [
    # decode, GQA, pages larger than the key block, three splits
    (3, 1, 6, 2, 32, 32, 4, PagedConfig(block_kv=16, num_splits=3)),
    # MQA, pages smaller than the key block (a page per row), T = 5 over 2 splits
    (2, 5, 4, 1, 40, 16, 5, PagedConfig(block_kv=32, num_splits=2)),
    # MHA, one split (the kernel writes the output), a tile of 16 rows = 2 tiles of T = 19
    (2, 19, 2, 2, 16, 16, 3, PagedConfig(block_m=16, block_kv=16, num_splits=1)),
    # the heuristic config
    (2, 3, 8, 2, 64, 16, 6, None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:7])))
def test_paged_matches_reference(rng, close, case):
    batch, q_len, heads, kv_heads, head_dim, page, pps, config = case
    args, extra = paged_inputs(
        rng, batch=batch, q_len=q_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        page=page, pages_per_seq=pps,
    )  # fmt: skip
    out = check(args, extra, config, close)
    if batch > 2:  # the idle slot (kv_len 0) outputs zeros
        assert not np.any(np.asarray(out[1]))


@pytest.mark.parametrize("splits", [1, 3])
def test_paged_window_soft_cap_and_sinks(rng, close, splits):
    """Window, soft cap and two sinks per head folded (in the kernel with one split, in the
    combine with several); rows of a short sequence before its first key output zeros."""
    args, extra = paged_inputs(
        rng, batch=3, q_len=6, heads=4, kv_heads=2, head_dim=32, page=16, pages_per_seq=4,
        kv_lens=[64, 3, 37],
    )  # fmt: skip
    sinks = jnp.asarray(rng.standard_normal((4, 2)), jnp.float32)
    check(
        args, extra, PagedConfig(block_kv=16, num_splits=splits), close,
        sliding_window=(9, 0), logits_soft_cap=4.0, softmax_sinks=sinks,
    )  # fmt: skip


def test_paged_ragged_batch(rng, close):
    """Prefill chunks longer than a tile, decode rows and an empty sequence in one call."""
    q_lens = np.array([23, 1, 0, 7, 1])
    args, extra = paged_inputs(
        rng, batch=5, q_len=0, heads=4, kv_heads=2, head_dim=32, page=16, pages_per_seq=3,
        ragged=q_lens,
    )  # fmt: skip
    check(args, extra, PagedConfig(block_m=16, block_kv=16, num_splits=2), close)


def test_paged_float16(rng, close):
    args, extra = paged_inputs(
        rng, batch=2, q_len=2, heads=4, kv_heads=1, head_dim=64, page=32, pages_per_seq=2,
        dtype=jnp.float16,
    )  # fmt: skip
    check(args, extra, PagedConfig(block_kv=32, num_splits=2), close, jnp.float16)


def _fp8(args, *, scalar):
    """``args`` with fp8 pools and their scales (`quantize_kv`, or one scale per pool)."""
    q, k, v, table, kv_lens = args
    if scalar:
        scales = {"k_scales": jnp.float32(1 / 64), "v_scales": 1 / 32}
        k, v = ((x / s).astype(FP8_KV_DTYPE) for x, s in ((k, 1 / 64), (v, 1 / 32)))
    else:
        (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
        scales = {"k_scales": ks, "v_scales": vs}
    return (q, k, v, table, kv_lens), scales


@pytest.mark.parametrize("scalar", [False, True], ids=["per_token", "scalar"])
@pytest.mark.parametrize(
    ("q_len", "kv_heads", "page", "config", "dtype"),
    [
        # GQA decode, pages larger than the key block, three splits (the combine)
        (1, 2, 32, PagedConfig(block_kv=16, num_splits=3), jnp.float32),
        # MQA, T = 5, pages smaller than the key block (a page per row), one split
        (5, 1, 8, PagedConfig(block_kv=16, num_splits=1), jnp.float32),
        # float16 queries: e4m3 -> float16 in registers
        (2, 2, 16, PagedConfig(block_kv=16, num_splits=2), jnp.float16),
    ],
)
def test_paged_fp8_matches_reference_on_the_dequantised_cache(rng, close, scalar, q_len,
                                                              kv_heads, page, config, dtype):  # fmt: skip
    """fp8 pages with per-token or scalar scales, read and dequantised in the kernel; the
    reference dequantises (`ejk_sequtils.dequantize_kv`) and runs in float32."""
    args, extra = paged_inputs(
        rng, batch=3, q_len=q_len, heads=4, kv_heads=kv_heads, head_dim=32, page=page,
        pages_per_seq=4, kv_lens=[4 * page, 0, 2 * page + 3], dtype=dtype,
    )  # fmt: skip
    args, scales = _fp8(args, scalar=scalar)
    out = check(args, extra, config, close, dtype, sliding_window=(40, 0), **scales)
    assert not np.any(np.asarray(out[1]))  # the idle slot


def test_paged_jit_is_deterministic(rng):
    args, _extra = paged_inputs(
        rng, batch=2, q_len=1, heads=4, kv_heads=2, head_dim=16, page=16, pages_per_seq=2
    )
    fn = jax.jit(lambda *a: paged_attention(*a, config=PagedConfig(block_kv=16, num_splits=2)))
    np.testing.assert_array_equal(fn(*args), fn(*args))


def _wide_grid():
    """(q_len, heads, kv_heads, splits): slow but for q_len 64 with 8:1 groups and 4 splits
    (every row of a 64-row tile a (token, head) pair of the one kv group), which the default
    run keeps."""
    for q_len, (heads, kv_heads), splits in itertools.product(
        [1, 2, 8, 64], [(8, 8), (8, 2), (8, 1)], [1, 4]
    ):
        default = (q_len, kv_heads, splits) == (64, 1, 4)
        marks = () if default else pytest.mark.slow
        yield pytest.param(q_len, heads, kv_heads, splits, marks=marks)


@pytest.mark.parametrize(("q_len", "heads", "kv_heads", "splits"), list(_wide_grid()))
def test_paged_wide_grid(rng, close, q_len, heads, kv_heads, splits):
    args, extra = paged_inputs(
        rng, batch=3, q_len=q_len, heads=heads, kv_heads=kv_heads, head_dim=32, page=16,
        pages_per_seq=6,
    )  # fmt: skip
    check(args, extra, PagedConfig(block_m=64, block_kv=32, num_splits=splits), close)


def test_empty_calls_give_zeros():
    q = jnp.ones((2, 0, 4, 16), jnp.float32)
    pages = jnp.ones((3, 16, 2, 16), jnp.float32)
    table = jnp.zeros((2, 1), jnp.int32)
    out = paged_attention(q, pages, pages, table, jnp.asarray([16, 3], jnp.int32))
    assert out.shape == q.shape
    no_pages = jnp.ones((0, 16, 2, 16), jnp.float32)
    q1 = jnp.ones((2, 1, 4, 16), jnp.float32)
    out = paged_attention(q1, no_pages, no_pages, table, jnp.zeros((2,), jnp.int32))
    assert not np.any(np.asarray(out))


def test_unsupported_and_bad_config(rng):
    args, _extra = paged_inputs(
        rng, batch=1, q_len=1, heads=2, kv_heads=1, head_dim=16, page=16, pages_per_seq=1
    )
    request = validate_paged_attention(*args)
    assert unsupported_paged_reason(request) is None
    with pytest.raises(TypeError, match="PagedConfig"):  # ours, or the shape checks' message
        paged_attention_request(request, config={"num_splits": 2})
    big = validate_paged_attention(
        jnp.zeros((1, 1, 1, 512)), jnp.zeros((1, 16, 1, 512)), jnp.zeros((1, 16, 1, 512)),
        jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32),
    )  # fmt: skip
    assert "head_dim <= 256" in unsupported_paged_reason(big)
    with pytest.raises(NotImplementedError, match="head_dim=512"):
        paged_attention_request(big)


def test_paged_config_validates_its_fields():
    with pytest.raises(ValueError, match="block_kv must be a power of two, got block_kv=48"):
        PagedConfig(block_kv=48)
    with pytest.raises(ValueError, match="block_m must be >= 16"):
        PagedConfig(block_m=8)
    with pytest.raises(ValueError, match="num_splits must be positive, got num_splits=0"):
        PagedConfig(num_splits=0)
    with pytest.raises(TypeError, match="num_stages must be an int"):
        PagedConfig(num_stages=2.0)


def test_heuristic_fills_the_gpu_and_the_space_fits():
    def splits(batch, seq):
        return paged_heuristic(
            batch=batch, q_len=1, ragged=False, heads=32, kv_heads=8, head_dim=128, capacity=seq
        ).num_splits

    # Fewer sequences, more splits; short sequences are not split below 512 keys a split.
    assert splits(1, 131072) > splits(8, 32768) > splits(32, 8192) >= 2
    assert splits(128, 1024) == 1 and splits(1, 600) == 1
    space = paged_search_space(group=4, max_q_len=1, max_keys=8192, head_dim=128)
    assert {c.num_splits for c in space} == {1, 2, 4, 8, 16}
    assert PagedConfig(block_m=64, block_kv=64, num_splits=2, num_stages=3) in space
    # A whole kv group per tile: a decode step of G = 4 needs 16 rows; 64 tokens of it 128.
    assert tile_shape(PagedConfig(block_m=64), 4, 1).rows == 16
    assert tile_shape(PagedConfig(block_m=128), 4, 512) == tile_shape(
        PagedConfig(block_m=128), 4, 32
    )


def test_fp8_pages_decode_with_longer_key_blocks_and_their_own_shared_memory():
    """FP8 pages: decode tiles take twice the keys a step (as many bytes in flight as a 16-bit
    block), prefill tiles and head_dim 64 keep theirs; the search space counts the pages'
    shared memory at one byte, so it offers deeper pipelines the 16-bit count would drop."""

    def heuristic(q_len, head_dim, kv_itemsize):
        return paged_heuristic(
            batch=32, q_len=q_len, ragged=False, heads=32, kv_heads=8, head_dim=head_dim,
            capacity=8192, kv_itemsize=kv_itemsize,
        )  # fmt: skip

    assert heuristic(1, 128, 2).block_kv == 64 and heuristic(1, 128, 1).block_kv == 128
    assert heuristic(512, 128, 1) == heuristic(512, 128, 2)
    assert heuristic(1, 64, 1) == heuristic(1, 64, 2)
    args = dict(group=4, max_q_len=1, max_keys=8192, head_dim=256)
    wide = set(paged_search_space(**args, kv_itemsize=1))
    assert set(paged_search_space(**args)) < wide
    deep = PagedConfig(block_m=16, block_kv=128, num_stages=3, num_splits=2)
    assert deep in wide and deep not in paged_search_space(**args)


def test_query_tiles_cover_every_row_once():
    q_lens = jnp.asarray([5, 0, 1, 9, 2], jnp.int32)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens)[:-1]])
    tiles = np.asarray(
        _paged_launch.query_tiles(q_lens, starts, q_lens + 3, tokens=4, max_tiles=10)
    )
    rows = [start + t for seq, start, t0, q_len, _ in tiles for t in range(t0, min(t0 + 4, q_len))]
    assert sorted(rows) == list(range(17))
    assert np.all(tiles[tiles[:, 3] > 0, 4] == np.asarray(q_lens + 3)[tiles[tiles[:, 3] > 0, 0]])


@pytest.fixture(name="decode_launches")
def decode_launches_fixture(monkeypatch):
    """The `PagedCall` of each split-KV launch the decode route makes (spied)."""
    launches = []
    forward = _decode.paged_forward
    monkeypatch.setattr(_decode, "paged_forward", lambda *a: launches.append(a[0]) or forward(*a))
    return launches


@pytest.mark.parametrize("causal,q_len", [(False, 3), (True, 1)])
def test_flash_attention_decode_takes_the_split_kv_kernel_with_flash_gradients(
    rng, close, monkeypatch, decode_launches, causal, q_len
):
    """Few queries, many keys: the split-KV forward serves flash_attention (spied), values
    and every gradient (flash backward) match the reference; top-left causal with one query
    sees key 0 alone."""
    monkeypatch.setattr(_select, "MIN_DECODE_KEYS", 64)
    launches = decode_launches
    q, k, v = (
        jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in [(2, q_len, 4, 16), (2, 70, 2, 16), (2, 70, 2, 16)]
    )
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
    kwargs = dict(causal=causal, softmax_sinks=sinks, logits_soft_cap=3.0)
    out = flash_attention(q, k, v, **kwargs)
    assert len(launches) == 1 and launches[0].causal == causal
    close(out, reference_attention(q, k, v, **kwargs), jnp.float32, "out")

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a[:3], softmax_sinks=a[3], causal=causal, logits_soft_cap=3.0) ** 2)  # fmt: skip

    grads = jax.grad(loss(flash_attention), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    expected = jax.grad(loss(reference_attention), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for name, g, e in zip(("dq", "dk", "dv", "dsinks"), grads, expected, strict=True):
        close(g, e, jnp.float32, "grad", name)


def test_flash_attention_decode_over_many_keys_merges_its_splits(rng, close, decode_launches):
    """One query over 1100 keys (past the route's `MIN_DECODE_KEYS`, unpatched): the
    heuristic splits the keys, and the splits' merge (`combine_splits`, with a sink and a
    soft cap) gives the reference's values at float32's tolerance."""
    q, k, v = (
        jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in [(2, 1, 4, 16), (2, 1100, 2, 16), (2, 1100, 2, 16)]
    )
    kwargs = dict(softmax_sinks=jnp.asarray(rng.standard_normal(4), jnp.float32))
    kwargs.update(logits_soft_cap=3.0)
    out = flash_attention(q, k, v, **kwargs)
    [call] = decode_launches
    assert call.config.num_splits > 1
    close(out, reference_attention(q, k, v, **kwargs), jnp.float32, "out")


def test_flash_attention_route_leaves_other_calls():
    def request(**kwargs):
        from ejk_sequtils import validate_attention

        q = jnp.zeros((1, 1, 4, 16))
        k = jnp.zeros((1, 2048, 2, 16))
        return validate_attention(q, k, k, **kwargs)

    assert _select.routes_to_decode(request(), None)
    assert not _select.routes_to_decode(request(), FlashConfig())  # explicit: flash
    assert not _select.routes_to_decode(request(sliding_window=(8, 8)), None)
    assert not _select.routes_to_decode(request(return_lse=True), None)
    assert not _select.routes_to_decode(request(dropout_rate=0.1, dropout_seed=1), None)


def test_executor_runs_the_paged_kernel(rng, close):
    from ejk_executor import ConfigCache, ConfigSelectorChain, Executor, Invocation

    args, extra = paged_inputs(
        rng, batch=3, q_len=0, heads=4, kv_heads=2, head_dim=16, page=16, pages_per_seq=2,
        ragged=np.array([5, 1, 2]),
    )  # fmt: skip
    kernel = PagedAttention()
    inv = Invocation.make(kernel, args, extra)
    cfg = kernel.heuristic_cfg(inv)
    assert cfg == paged_heuristic(
        batch=3, q_len=8, ragged=True, heads=4, kv_heads=2, head_dim=16, capacity=32, itemsize=4
    )
    assert cfg in kernel.config_space(inv)
    executor = Executor(ConfigSelectorChain(cache=ConfigCache()))
    out = executor(kernel, *args, **extra)
    close(
        out, paged_reference_attention(validate_paged_attention(*args, **extra)), jnp.float32, "out"
    )


def test_traced_kv_lens_past_capacity_read_only_the_table(rng, close):
    """Under jit, kv_lens are not checked: a length past the table's capacity places the
    queries as the reference does (every held key visible) and reads no page past the table."""
    args, _ = paged_inputs(
        rng, batch=2, q_len=2, heads=4, kv_heads=2, head_dim=16, page=16, pages_per_seq=2,
        kv_lens=[32, 20],
    )  # fmt: skip
    q, k, v, table, _ = args
    kv_lens = jnp.asarray([37, 20], jnp.int32)  # capacity 32
    cfg = PagedConfig(block_kv=16, num_splits=2)
    out = jax.jit(lambda lens: paged_attention(q, k, v, table, lens, config=cfg))(kv_lens)
    expected = jax.jit(
        lambda lens: paged_reference_attention(validate_paged_attention(q, k, v, table, lens))
    )(kv_lens)
    close(out, expected, jnp.float32, "out")
