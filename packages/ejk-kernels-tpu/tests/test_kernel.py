"""BlockSparseAttention through ejk_executor: heuristic, explicit config, jit, grads, cache keys."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ejk_config import stable_json
from ejk_executor import ConfigCache, ConfigSelectorChain, Executor
from ejk_kernels_tpu import (
    BlockSparseAttention,
    BlockSparseConfig,
    CausalMask,
    LocalMask,
    MultiHeadMask,
    NumpyMask,
    block_sparse_heuristic,
    block_sparse_search_space,
    blocksparse_attention,
    blocksparse_attention_request,
)
from ejk_sequtils import validate_attention

T = 128


def _qkv():
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (1, T, 2, 64))
    k = jax.random.normal(ks[1], (1, T, 1, 64))
    v = jax.random.normal(ks[2], (1, T, 1, 64))
    return q, k, v


def test_executor_runs_the_kernel_with_the_heuristic_and_explicit_configs():
    q, k, v = _qkv()
    mask = CausalMask((T, T))
    executor = Executor(ConfigSelectorChain(cache=ConfigCache()))
    kernel = BlockSparseAttention()
    chosen = executor.choose(kernel, q, k, v, mask=mask)
    assert chosen.cfg == block_sparse_heuristic(T, T, 64, 4)
    direct = blocksparse_attention(q, k, v, mask)
    np.testing.assert_allclose(executor(kernel, q, k, v, mask=mask), direct, atol=1e-6)
    cfg = BlockSparseConfig(block_q=256)
    out = executor(kernel, q, k, v, mask=mask, cfg=cfg)
    np.testing.assert_allclose(out, direct, atol=1e-6)
    inv = executor.invocation(kernel, q, k, v, mask=mask)
    # Off TPU (the interpreter) only the heuristic config is worth timing.
    assert list(kernel.config_space(inv)) == [chosen.cfg]
    on_tpu = dataclasses.replace(inv, platform="pallas")
    space = list(kernel.config_space(on_tpu))
    assert space == block_sparse_search_space(T, T, 64, 4)
    assert len(block_sparse_search_space(1024, 1024, 64, 2)) > 1


def test_the_facade_route_config_from_the_executor_then_the_request_entry():
    """The facade selects a config (forward and backward block sizes) through the executor and
    runs its validated request with it."""
    q, k, v = _qkv()
    mask = CausalMask((T, T))
    executor = Executor(ConfigSelectorChain(cache=ConfigCache()))
    kernel = BlockSparseAttention()
    cfg = executor.choose(kernel, q, k, v, mask=mask).cfg
    assert isinstance(cfg, BlockSparseConfig) and cfg.block_q_dkv and cfg.block_kv_dq
    request = validate_attention(q, k, v, causal=True)
    out = blocksparse_attention_request(request, None, config=cfg)
    np.testing.assert_allclose(out, executor(kernel, q, k, v, mask=mask), atol=1e-6)


def test_executor_gradients_inside_jit():
    q, k, v = _qkv()
    mask = LocalMask((T, T), window_size=(16, 0))
    executor = Executor()

    def loss(q, k, v, fn):
        return jnp.sum(fn(q, k, v) ** 2)

    via_exec = lambda q, k, v: executor(BlockSparseAttention(), q, k, v, mask=mask)
    direct = lambda q, k, v: blocksparse_attention(q, k, v, mask)
    g1 = jax.jit(jax.grad(lambda *a: loss(*a, via_exec), (0, 1, 2)))(q, k, v)
    g2 = jax.grad(lambda *a: loss(*a, direct), (0, 1, 2))(q, k, v)
    for a, b in zip(g1, g2, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_masks_have_stable_cache_keys():
    a = MultiHeadMask([CausalMask((T, T)), LocalMask((T, T), window_size=(3, None))])
    b = MultiHeadMask([CausalMask((T, T)), LocalMask((T, T), window_size=(3, None))])
    assert stable_json(a) == stable_json(b)
    assert stable_json(CausalMask((T, T))) != stable_json(CausalMask((T, T), offset=1))
    dense = np.eye(T, dtype=bool)
    assert stable_json(NumpyMask(dense)) == stable_json(NumpyMask(dense.copy()))
    assert "0x" not in stable_json(CausalMask((T, T)) & LocalMask((T, T), window_size=(1, 1)))
