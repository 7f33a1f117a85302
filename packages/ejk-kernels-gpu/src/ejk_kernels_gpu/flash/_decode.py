"""Decoding through `flash_attention`: few queries over many keys take the split-KV kernel.

With ``T·G`` query rows per kv group small and ``S`` large, the flash forward has one
program per (batch, head) walking every key: a few hundred programs on a GPU of 132 SMs
(one per (batch, head, 64 queries)) and each kv head's keys read ``G`` times. The paged
kernel (`kernels.triton._paged`) reads them once per group and splits them over programs. A
contiguous cache ``[B, S, K, H]`` is a pool of ``B`` pages of ``S`` tokens, sequence ``b``
owning page ``b``.

Gradients stay those of the flash kernels: `_decode` is a custom VJP whose primal is the
split-KV forward and whose rules are the flash forward (for its residuals) and backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ejk_sequtils import AttentionRequest

from ..paged._config import paged_heuristic, tile_shape
from ..paged._launch import PagedCall, paged_forward, uniform_tiles
from ._config import FlashBackwardConfig, FlashConfig
from ._select import CallOptions, call_options, routes_to_decode
from ._tables import Tables, kernel_tables
from ._vjp import flash_vjp_bwd, flash_vjp_fwd

__all__ = ["decode_route"]


def _split_kv(call: PagedCall, q, k, v, sinks):
    """``out [B, T, N, H]`` of the split-KV kernel on the cache as one page per sequence."""
    batch, q_len, heads, head_dim = q.shape
    kv_len = k.shape[1]
    # Top-left causal with one query (the only causal call routed): it sees key 0 alone,
    # which is bottom-right causal over one key.
    keys = 1 if call.causal else kv_len
    kv_lens = jnp.full((batch,), keys, jnp.int32)
    table = jnp.arange(batch, dtype=jnp.int32)[:, None]
    tiles = uniform_tiles(kv_lens, q_len=q_len, tokens=call.tile.tokens)
    out = paged_forward(call, q.reshape(batch * q_len, heads, head_dim), k, v, table, tiles, sinks)
    return out.reshape(q.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _decode(call: PagedCall, opts: CallOptions, q, k, v, sinks, tables: Tables):
    return _split_kv(call, q, k, v, sinks)


def _decode_fwd(call: PagedCall, opts: CallOptions, q, k, v, sinks, tables: Tables):
    (out, _), residuals = flash_vjp_fwd(opts, q, k, v, None, sinks, tables)
    return out, residuals


def _decode_bwd(call: PagedCall, opts: CallOptions, residuals, d_out):
    q = residuals[0]
    batch, q_len, heads, _ = q.shape
    d_lse = jnp.zeros((batch, heads, q_len), jnp.float32)  # the lse is not an output here
    dq, dk, dv, _, dsinks, _ = flash_vjp_bwd(opts, residuals, (d_out, d_lse))
    return dq, dk, dv, dsinks, None


_decode.defvjp(_decode_fwd, _decode_bwd)


def decode_route(
    request: AttentionRequest, config: FlashConfig | None, bwd_config: FlashBackwardConfig | None
):
    """``out`` of a request `routes_to_decode` serves (the split-KV forward, the flash
    kernels' gradients), or None for every other request."""
    if not routes_to_decode(request, config):
        return None
    batch, q_len, kv_len, heads, kv_heads, head_dim = request.shape
    cfg = paged_heuristic(
        batch=batch,
        q_len=q_len,
        ragged=False,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        capacity=1 if request.causal else kv_len,
        itemsize=request.q.dtype.itemsize,
    )
    call = PagedCall(
        scale=float(request.softmax_scale),
        causal=request.causal,
        window=None,
        soft_cap=0.0 if request.logits_soft_cap is None else float(request.logits_soft_cap),
        config=cfg,
        tile=tile_shape(cfg, heads // kv_heads, q_len),
    )
    opts = call_options(request, config, bwd_config)
    tables = kernel_tables(opts, request)
    arrays = (request.q, request.k, request.v, request.softmax_sinks)
    q, k, v, sinks = (None if x is None else jnp.asarray(x) for x in arrays)
    return _decode(call, opts, q, k, v, sinks, tables)
