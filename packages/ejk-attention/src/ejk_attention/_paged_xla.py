"""The ``xla`` paged attention: gather each sequence's pages, then one masked softmax.

Every platform runs it; it is what CPU tests and small serving use, and what the
Triton kernel is checked against besides the reference. Sequences are processed in
chunks (`jax.lax.map` over groups of sequences) so that the gathered keys and the
scores of one chunk stay within a fixed memory budget, whatever the batch.

The ragged form runs as the ``[B, T]`` form with one query per row: a query at
position ``p`` of sequence ``b`` sees exactly what the last query of a sequence of
length ``p + 1`` sees (its keys ``<= p``, and the window). That is the best layout for
decode rows; a prefill chunk's rows each gather their sequence's keys again (the
Triton kernel reads them once per tile of rows).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from ejk_sequtils import PagedAttentionRequest, gather_pages, paged_visibility, ragged_rows

from ._xla import _grouped_sinks, _row_stats

__all__ = ["xla_paged_attention"]

_F32 = jnp.float32
# The reference's matmul precision (float32 on GPUs and TPUs too, not TF32 / bf16 passes).
_PRECISION = jax.lax.Precision.HIGHEST
# Elements (gathered keys and values, scores) one chunk of sequences may hold: 64 MiB of f32.
_CHUNK_ELEMENTS = 1 << 24


class _Options(NamedTuple):
    """The static options of one call."""

    scale: float
    window: tuple[int, int] | None
    soft_cap: float | None


def xla_paged_attention(request: PagedAttentionRequest) -> Array:
    """``request`` computed in jnp: ``out`` shaped like ``q``, in ``q.dtype`` (forward only).

    Args:
        request: from `ejk_sequtils.validate_paged_attention`.
    """
    opts = _Options(request.softmax_scale, request.sliding_window, request.logits_soft_cap)
    q = jnp.asarray(request.q)
    table = jnp.asarray(request.page_table, jnp.int32)
    kv_lens = jnp.asarray(request.kv_lens, jnp.int32)
    if request.is_ragged:
        seq, position = ragged_rows(request)
        # Row r as the last query of its sequence cut at position + 1 (0 below: no key).
        q, table, kv_lens = q[:, None], table[seq], jnp.maximum(position + 1, 0)
    out = _paged(opts, q, request.k_pages, request.v_pages, table, kv_lens, request.softmax_sinks)
    return out[:, 0] if request.is_ragged else out


@functools.partial(jax.jit, static_argnums=(0,))
def _paged(
    opts: _Options,
    q: Array,
    k_pages: Array,
    v_pages: Array,
    table: Array,
    kv_lens: Array,
    sinks: Array | None,
) -> Array:
    """``[B, T, N, H]`` paged attention, chunked over sequences."""
    batch, q_len, heads, _ = q.shape
    _, page_size, kv_heads, head_dim = k_pages.shape
    capacity = table.shape[1] * page_size
    per_sequence = 2 * capacity * kv_heads * head_dim + 2 * heads * q_len * capacity
    chunk = max(1, min(batch, _CHUNK_ELEMENTS // max(per_sequence, 1)))
    sinks = _grouped_sinks(sinks, kv_heads)  # [1, K, G, 1]

    def attend(rows: tuple[Array, Array, Array]) -> Array:
        q, table, kv_lens = rows
        keys = gather_pages(k_pages, table, kv_lens)
        values = gather_pages(v_pages, table, kv_lens)
        return _attend(opts, q, keys, values, kv_lens - q_len, sinks)

    if chunk >= batch:
        return attend((q, table, kv_lens))

    def attend_one(row: tuple[Array, Array, Array]) -> Array:
        return attend(tuple(x[None] for x in row))[0]

    return jax.lax.map(attend_one, (q, table, kv_lens), batch_size=chunk)


def _attend(
    opts: _Options,
    q: Array,
    keys: Array,
    values: Array,
    first_position: Array,
    sinks: Array | None,
) -> Array:
    """``q [B, T, N, H]`` over contiguous ``keys``/``values`` ``[B, S, K, H]``, bottom-right causal."""
    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    # Grouped-query heads read their kv head through a reshape, not a copy.
    qg = (q.astype(_F32) * opts.scale).reshape(batch, q_len, kv_heads, group, head_dim)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, keys, precision=_PRECISION, preferred_element_type=_F32)
    if opts.soft_cap is not None:
        s = opts.soft_cap * jnp.tanh(s / opts.soft_cap)
    visible = paged_visibility(first_position, q_len, kv_len, sliding_window=opts.window)
    s = jnp.where(visible[:, :, None], s, -jnp.inf)  # [B, 1, 1, T, S] over [B, K, G, T, S]
    _, denom, e = _row_stats(s, sinks)
    out = jnp.einsum(
        "bkgts,bskh->btkgh", e, values, precision=_PRECISION, preferred_element_type=_F32
    )
    # Normalise after p·v (FlashAttention-2, Alg. 1, line 12); a row without mass gives 0.
    scale = 1.0 / jnp.where(denom > 0, denom, 1.0)  # [B, K, G, T]
    out = out * scale.transpose(0, 3, 1, 2)[..., None]
    return out.reshape(batch, q_len, heads, head_dim).astype(q.dtype)
