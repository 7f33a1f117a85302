"""Deviceless Mosaic compiles of forward + backward for v5e and v6e topologies (no TPU needed).

libtpu (``jax[tpu]``, in the test group) compiles for a topology description; a Mosaic
lowering error or a VMEM overflow fails the compile, and so the test.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from ejk_kernels_tpu import (
    BlockSparseConfig,
    CausalMask,
    ChunkedCausalMask,
    FullMask,
    LocalMask,
    MultiHeadMask,
    block_sparse_heuristic,
    block_sparse_search_space,
    blocksparse_attention,
    mask_mod_attention,
)
from ejk_sequtils import validate_attention

# What jax says where this machine has no libtpu to describe a topology (not installed, or
# its lock file held by another process): the only reasons to skip. A topology name libtpu
# rejects (INVALID_ARGUMENT) or any other error fails.
NO_LIBTPU = ("JAX TPU support not installed", "libtpu multi-process lockfile")


@functools.cache
def _device(topology: str):
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except RuntimeError as e:  # skip only where libtpu is absent or held; fail on the rest
        if not any(reason in str(e) for reason in NO_LIBTPU):
            raise
        pytest.skip(f"no deviceless TPU topology {topology!r}: {type(e).__name__}: {e}")
    return topo.devices[0]


def _replicated(topology: str):
    """A sharding that places an abstract input on the topology's first (deviceless) TPU."""
    mesh = jax.sharding.Mesh([_device(topology)], ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _compile(
    topology,
    *,
    t,
    s,
    mask,
    config,
    heads,
    kv_heads,
    head_dim,
    dtype,
    segments,
    sinks,
    cap,
    dropout,
    mask_function=True,
):
    """Compiles forward + backward of one call (batch 2) for ``topology``; checks all three kernels."""
    sh = _replicated(topology)
    batch = 2
    q = jax.ShapeDtypeStruct((batch, t, heads, head_dim), dtype, sharding=sh)
    kv = jax.ShapeDtypeStruct((batch, s, kv_heads, head_dim), dtype, sharding=sh)
    seg = jax.ShapeDtypeStruct((batch, t), jnp.int32, sharding=sh) if segments else None
    snk = jax.ShapeDtypeStruct((heads,), jnp.float32, sharding=sh) if sinks else None

    def grads(q, k, v, seg, snk):
        def loss(q, k, v, snk):
            out, lse = blocksparse_attention(
                q,
                k,
                v,
                mask,
                segment_ids=seg,
                softmax_sinks=snk,
                logits_soft_cap=cap,
                dropout_rate=dropout,
                dropout_seed=1234 if dropout else None,
                return_lse=True,
                config=config,
                interpret=False,
                mask_function=mask_function,
            )
            return out.astype(jnp.float32).sum() + lse.sum()

        argnums = (0, 1, 2, 3) if snk is not None else (0, 1, 2)
        return jax.grad(loss, argnums)(q, k, v, snk)

    compiled = jax.jit(grads).lower(q, kv, kv, seg, snk).compile()
    text = compiled.as_text()
    for name in ("ejk_blocksparse_fwd", "ejk_blocksparse_dq", "ejk_blocksparse_dkv"):
        assert name in text, name


def _case(**kwargs):
    """``_compile``'s arguments: 2 heads, 1 kv head, head_dim 64, f32, no options, unless given."""
    shape = dict(heads=2, kv_heads=1, head_dim=64, dtype=jnp.float32)
    options = dict(segments=False, sinks=False, cap=None, dropout=0.0)
    return {**shape, **options, **kwargs}


CASES = {
    "v5e_h128_bf16_all_features": _case(
        topology="v5e:2x2",
        t=1024,
        s=1024,
        heads=4,
        kv_heads=2,
        head_dim=128,
        dtype=jnp.bfloat16,
        mask=CausalMask((1024, 1024)),
        segments=True,
        sinks=True,
        cap=30.0,
        dropout=0.1,
    ),
    "v6e_h64_f32_local": _case(
        topology="v6e:2x2", t=512, s=768, mask=LocalMask((512, 768), window_size=(128, 0))
    ),
    "v6e_h256_bf16_multihead": _case(
        topology="v6e:2x2",
        t=512,
        s=512,
        kv_heads=2,
        head_dim=256,
        dtype=jnp.bfloat16,
        mask=MultiHeadMask([CausalMask((512, 512)), LocalMask((512, 512), window_size=(64, 64))]),
        sinks=True,
    ),
    "v5e_short_ragged": _case(topology="v5e:2x2", t=19, s=23, mask=FullMask((19, 23))),
    # The mask function in the kernels: chunk division (lax.div), |, padding to whole blocks.
    "v6e_bf16_chunked_or_local_mask_function": _case(
        topology="v6e:2x2",
        t=1000,
        s=1000,
        head_dim=128,
        dtype=jnp.bfloat16,
        mask=ChunkedCausalMask((1000, 1000), chunk_size=300)
        | LocalMask((1000, 1000), window_size=(64, 0), offset=-3),
        segments=True,
    ),
    "v5e_causal_stored_tiles": _case(
        topology="v5e:2x2", t=1024, s=1024, mask=CausalMask((1024, 1024)), mask_function=False
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_heuristic_config_compiles(name):
    case = CASES[name]
    itemsize = jnp.dtype(case["dtype"]).itemsize
    config = block_sparse_heuristic(case["t"], case["s"], case["head_dim"], itemsize)
    _compile(config=config, **case)


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_largest_search_space_configs_compile(topology, head_dim):
    """The biggest-block configs the VMEM predicate admits really fit."""
    t = s = 4096
    space = block_sparse_search_space(t, s, head_dim, 2)
    biggest = max(space, key=lambda c: (c.block_q * c.block_kv, c.block_q_dq * c.block_kv_dq))
    case = dict(CASES["v5e_h128_bf16_all_features"], topology=topology, head_dim=head_dim)
    case.update(t=t, s=s, mask=CausalMask((t, s)))
    _compile(config=biggest, **case)
    _compile(config=BlockSparseConfig(), **case)


def test_traced_array_mask_compiles():
    """A bool mask passed as a jit argument (dynamic tables, every tile kept) lowers too."""
    sh = _replicated("v6e:2x2")
    t, heads = 1024, 2
    q = jax.ShapeDtypeStruct((1, t, heads, 128), jnp.bfloat16, sharding=sh)
    kv = jax.ShapeDtypeStruct((1, t, 1, 128), jnp.bfloat16, sharding=sh)
    mask = jax.ShapeDtypeStruct((heads, t, t), jnp.bool_, sharding=sh)

    def grads(q, k, v, mask):
        loss = lambda q, k, v: blocksparse_attention(q, k, v, mask, interpret=False).sum()
        return jax.grad(lambda *a: loss(*a).astype(jnp.float32), (0, 1, 2))(q, k, v)

    jax.jit(grads).lower(q, kv, kv, mask).compile()


def test_float16_is_refused_when_compiling_for_tpu():
    x = jnp.zeros((1, 128, 1, 64), jnp.float16)
    with pytest.raises(NotImplementedError, match="float16"):
        blocksparse_attention(x, x, x, CausalMask((128, 128)), interpret=False)


def test_vmapped_gradients_compile():
    sh = _replicated("v6e:2x2")
    t = 512
    q = jax.ShapeDtypeStruct((3, 1, t, 2, 128), jnp.bfloat16, sharding=sh)
    kv = jax.ShapeDtypeStruct((3, 1, t, 1, 128), jnp.bfloat16, sharding=sh)
    mask = CausalMask((t, t))
    f = lambda q, k, v: blocksparse_attention(q, k, v, mask, interpret=False).sum()
    g = jax.grad(lambda *a: f(*a).astype(jnp.float32), (0, 1, 2))
    jax.jit(jax.vmap(g)).lower(q, kv, kv).compile()


def _documents_prefix_window(ids, lengths):
    """A flex mask_mod over traced captures: causal documents (``ids[b, q]`` per query,
    ``ids[b, kv]`` per key), or a prefix of ``lengths[b]`` keys (per (b, h), in SMEM),
    within a window that differs per head."""

    def mask_mod(b, h, q_idx, kv_idx):
        same = (ids[b, q_idx] == ids[b, kv_idx]) & (ids[b, q_idx] >= 0) & (kv_idx <= q_idx)
        window = q_idx - kv_idx < 256 * (h + 1)
        return (same | (kv_idx < lengths[b])) & window

    return mask_mod


def _flex_inputs(topology):
    """Abstract ``(q, k/v, ids, lengths, kinds)`` of a flex call on the topology's TPU: bf16,
    GQA 4 on 2, T = 1000, per-(b, h) kinds for blocks of 64."""
    sh = _replicated(topology)
    batch, t, heads, kv_heads, head_dim = 2, 1000, 4, 2, 128
    return (
        jax.ShapeDtypeStruct((batch, t, heads, head_dim), jnp.bfloat16, sharding=sh),
        jax.ShapeDtypeStruct((batch, t, kv_heads, head_dim), jnp.bfloat16, sharding=sh),
        jax.ShapeDtypeStruct((batch, t), jnp.int32, sharding=sh),
        jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=sh),
        jax.ShapeDtypeStruct((batch, heads, 16, 16), jnp.int8, sharding=sh),
    )


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_mask_mod_compiles(topology):
    """`mask_mod_attention` (the flex path), forward + backward, with features of every
    kind and per-(b, h) block tables at a block size other than the kernels'."""
    q, kv, ids, lengths, kinds = _flex_inputs(topology)

    def grads(q, k, v, ids, lengths, kinds):
        def loss(q, k, v):
            request = validate_attention(q, k, v, return_lse=True)
            mask_mod = _documents_prefix_window(ids, lengths)
            out, lse = mask_mod_attention(request, mask_mod, kinds, (64, 64), interpret=False)
            return out.astype(jnp.float32).sum() + jnp.where(jnp.isinf(lse), 0, lse).sum()

        return jax.grad(loss, (0, 1, 2))(q, k, v)

    compiled = jax.jit(grads).lower(q, kv, kv, ids, lengths, kinds).compile()
    text = compiled.as_text()
    for name in ("ejk_blocksparse_fwd", "ejk_blocksparse_dq", "ejk_blocksparse_dkv"):
        assert name in text, name


def _alibi_soft_cap_bias(slopes, bias):
    """A flex score_mod over traced captures: ALiBi (``slopes[h]``, an SMEM scalar per head),
    a per-key bias (``bias[b, kv]``, a key row), then a tanh soft cap."""

    def score_mod(s, b, h, q_idx, kv_idx):
        s = s - slopes[h] * jnp.abs(q_idx - kv_idx).astype(jnp.float32) + bias[b, kv_idx]
        return 30.0 * jnp.tanh(s / 30.0)

    return score_mod


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_score_mod_compiles(topology):
    """`mask_mod_attention` with a score_mod (the flex path), forward + backward and the
    captures' cotangents: the score_mod and its slope lower in all three kernels."""
    q, kv, ids, lengths, kinds = _flex_inputs(topology)
    sh = _replicated(topology)
    batch, t, heads = q.shape[:3]
    slopes = jax.ShapeDtypeStruct((heads,), jnp.float32, sharding=sh)
    bias = jax.ShapeDtypeStruct((batch, t), jnp.float32, sharding=sh)

    def grads(q, k, v, ids, lengths, slopes, bias, kinds):
        def loss(q, k, v, slopes, bias):
            request = validate_attention(q, k, v, return_lse=True)
            mask_mod = _documents_prefix_window(ids, lengths)
            score_mod = _alibi_soft_cap_bias(slopes, bias)
            out, lse = mask_mod_attention(
                request, mask_mod, kinds, (64, 64), score_mod=score_mod, interpret=False
            )
            return out.astype(jnp.float32).sum() + jnp.where(jnp.isinf(lse), 0, lse).sum()

        return jax.grad(loss, (0, 1, 2, 3, 4))(q, k, v, slopes, bias)

    lowered = jax.jit(grads).lower(q, kv, kv, ids, lengths, slopes, bias, kinds)
    text = lowered.compile().as_text()
    for name in ("ejk_blocksparse_fwd", "ejk_blocksparse_dq", "ejk_blocksparse_dkv"):
        assert name in text, name


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_relative_position_table_compiles(topology):
    """A score_mod reading a learned table at ``kv_idx - q_idx`` (clipped to +-64, one row per
    head): the lookup loop over a tile's positions lowers in all three kernels."""
    q, kv, ids, lengths, kinds = _flex_inputs(topology)
    table = jax.ShapeDtypeStruct((q.shape[2], 129), jnp.float32, sharding=_replicated(topology))

    def grads(q, k, v, ids, lengths, table, kinds):
        def loss(q, k, v, table):
            def score_mod(s, b, h, q_idx, kv_idx):
                return s + table[h, jnp.clip(kv_idx - q_idx, -64, 64) + 64]

            request = validate_attention(q, k, v, return_lse=True)
            mask_mod = _documents_prefix_window(ids, lengths)
            out, lse = mask_mod_attention(
                request, mask_mod, kinds, (64, 64), score_mod=score_mod, interpret=False
            )
            return out.astype(jnp.float32).sum() + jnp.where(jnp.isinf(lse), 0, lse).sum()

        return jax.grad(loss, (0, 1, 2, 3))(q, k, v, table)

    lowered = jax.jit(grads).lower(q, kv, kv, ids, lengths, table, kinds)
    text = lowered.compile().as_text()
    for name in ("ejk_blocksparse_fwd", "ejk_blocksparse_dq", "ejk_blocksparse_dkv"):
        assert name in text, name
