"""Deviceless Mosaic compiles of the ragged paged kernel for v5e and v6e (no TPU needed).

As in `test_compile_tpu.py`: libtpu (the test group's ``jax[tpu]``) compiles for a
topology description, so a Mosaic lowering error (the manual DMAs, the strided head tiles,
the dynamic loops) or a VMEM overflow fails the test. Nothing runs: values are checked in
the interpreter (`test_paged.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from ejk_kernels_tpu import (
    PagedShape,
    RaggedPagedConfig,
    paged_attention,
    ragged_paged_search_space,
)

BATCH, PAGES_PER_SEQ, POOL = 4, 16, 48


# What jax says where this machine has no libtpu to describe a topology (not installed, or
# its lock file held by another process): the only reasons to skip. A topology name libtpu
# rejects (INVALID_ARGUMENT) or any other error fails.
NO_LIBTPU = ("JAX TPU support not installed", "libtpu multi-process lockfile")


@functools.cache
def _sharding(topology: str) -> jax.sharding.NamedSharding:
    """Places an abstract input on the first (deviceless) TPU of ``topology``."""
    from jax.experimental import topologies

    try:
        device = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]
    except RuntimeError as e:  # skip only where libtpu is absent or held; fail on the rest
        if not any(reason in str(e) for reason in NO_LIBTPU):
            raise
        pytest.skip(f"no deviceless TPU topology {topology!r}: {type(e).__name__}: {e}")
    mesh = jax.sharding.Mesh([device], ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _build(topology, *, dtype, heads, kv_heads, head_dim, page_size, q_len, ragged, config, **kw):
    """Compiles one call for ``topology``; its HLO must hold the kernel."""
    spec = functools.partial(jax.ShapeDtypeStruct, sharding=_sharding(topology))
    q_shape = (BATCH * q_len,) if ragged else (BATCH, q_len)
    fp8 = kw.pop("fp8", None)  # None, "per_token" or "scalar" scales
    pages = spec((POOL, page_size, kv_heads, head_dim), jnp.float8_e4m3fn if fp8 else dtype)
    if fp8 == "scalar":
        kw.update(k_scales=0.5, v_scales=0.25)
    args = [
        spec((*q_shape, heads, head_dim), dtype),
        pages,
        pages,
        spec((BATCH, PAGES_PER_SEQ), jnp.int32),
        spec((BATCH,), jnp.int32),
    ]
    args.append(spec((BATCH + 1,), jnp.int32) if ragged else None)
    if kw.pop("sinks", False):
        kw["softmax_sinks"] = jnp.zeros((heads,), jnp.float32)
    if fp8 == "per_token":
        args += [spec((POOL, page_size, kv_heads), jnp.float32)] * 2

    def call(q, k_pages, v_pages, table, lens, cu=None, k_scales=None, v_scales=None):
        if k_scales is not None:
            kw.update(k_scales=k_scales, v_scales=v_scales)
        return paged_attention(q, k_pages, v_pages, table, lens, cu_q_lens=cu, config=config,
                               interpret=False, **kw)  # fmt: skip

    text = jax.jit(call).lower(*args).compile().as_text()
    assert "ejk_ragged_paged_attention" in text


BUILDS = {
    # Decode, GQA 4:1, the heuristic config.
    "v5e_bf16_decode_gqa": dict(
        topology="v5e:2x2", dtype=jnp.bfloat16, heads=32, kv_heads=8, head_dim=128,
        page_size=64, q_len=1, ragged=False, config=None),
    # A ragged batch, MQA, window, several pages per block, f32.
    "v6e_f32_ragged_mqa_window": dict(
        topology="v6e:2x2", dtype=jnp.float32, heads=8, kv_heads=1, head_dim=64, page_size=16,
        q_len=7, ragged=True, config=RaggedPagedConfig(block_q=16, pages_per_block=4),
        sliding_window=(100, 0)),
    # Prefill chunks with every feature, an odd kv head count, small pages (bf16 packing).
    "v6e_bf16_prefill_all_features": dict(
        topology="v6e:2x2", dtype=jnp.bfloat16, heads=6, kv_heads=3, head_dim=128, page_size=8,
        q_len=48, ragged=False, config=RaggedPagedConfig(block_q=32, pages_per_block=8),
        sliding_window=(64, 0), logits_soft_cap=30.0, sinks=True),
    "v5e_f32_head_dim_256": dict(
        topology="v5e:2x2", dtype=jnp.float32, heads=4, kv_heads=2, head_dim=256, page_size=32,
        q_len=3, ragged=True, config=None, sinks=True),
    # FP8 pages (e4m3 copied, dequantised in VMEM) with per-token scales: decode on v5e and
    # v6e, and a ragged batch with scalar scales.
    "v5e_bf16_decode_gqa_fp8": dict(
        topology="v5e:2x2", dtype=jnp.bfloat16, heads=32, kv_heads=8, head_dim=128,
        page_size=64, q_len=1, ragged=False, config=None, fp8="per_token"),
    "v6e_bf16_decode_gqa_fp8": dict(
        topology="v6e:2x2", dtype=jnp.bfloat16, heads=32, kv_heads=8, head_dim=128,
        page_size=64, q_len=1, ragged=False, config=None, fp8="per_token"),
    "v6e_bf16_ragged_fp8_scalar": dict(
        topology="v6e:2x2", dtype=jnp.bfloat16, heads=8, kv_heads=2, head_dim=128, page_size=16,
        q_len=7, ragged=True, config=RaggedPagedConfig(block_q=16, pages_per_block=4),
        fp8="scalar", sinks=True),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BUILDS))
def test_paged_kernel_compiles(name):
    _build(**BUILDS[name])


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_largest_search_space_configs_compile(topology, head_dim):
    """The configs of the search space with the most query rows and the most keys per block
    really fit VMEM (the `fits_paged_vmem` estimate is generous enough)."""
    sizes = dict(heads=32, kv_heads=8, head_dim=head_dim, page_size=16, itemsize=2)
    shape = PagedShape(batch=BATCH, q_rows=512, ragged=False, pages_per_seq=PAGES_PER_SEQ, **sizes)
    space = ragged_paged_search_space(shape)
    for key in (lambda c: (c.block_q, c.pages_per_block), lambda c: (c.pages_per_block, c.block_q)):
        config = max(space, key=key)
        _build(topology, dtype=jnp.bfloat16, q_len=config.block_q, ragged=False, config=config,
               **{k: v for k, v in sizes.items() if k != "itemsize"})  # fmt: skip
