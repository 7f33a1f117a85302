"""The ``xla`` paged attention: gather each sequence's pages, then one masked softmax.

Every platform runs it; it is what CPU tests and small serving use, and what the
Triton kernel is checked against besides the reference. Sequences are processed in
chunks (`jax.lax.map` over groups of sequences) so that the gathered keys and the
scores of one chunk stay within a fixed memory budget, whatever the batch.

The ragged form is cut into tiles of query rows, each inside one sequence (`_RowTiles`:
about the mean number of rows per sequence, so a batch of decode steps runs one row per
tile and a prefill chunk a few dozen); each tile then runs as one sequence of the
``[B, T]`` form and gathers its sequence's pages once per tile.

FP8 pages are dequantised as they are gathered (`gather_pages` with ``scales``): a chunk
holds its own sequences' keys in float32, never the whole pool.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from ejk_sequtils import PagedAttentionRequest, gather_pages, paged_visibility

from ._xla import _grouped_sinks, _row_stats

__all__ = ["xla_paged_attention"]

_F32 = jnp.float32
# The reference's matmul precision (float32 on GPUs and TPUs too, not TF32 / bf16 passes).
_PRECISION = jax.lax.Precision.HIGHEST
# Elements (gathered keys and values, scores) one chunk of sequences may hold: 64 MiB of f32.
_CHUNK_ELEMENTS = 1 << 24


class _Pages(NamedTuple):
    """The pools, and their scales when they hold fp8 (else None)."""

    k: Array
    v: Array
    k_scales: Array | None
    v_scales: Array | None


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
    pages = _Pages(request.k_pages, request.v_pages, request.k_scales, request.v_scales)
    if not request.is_ragged:
        first = kv_lens - request.num_q_rows
        return _paged(opts, q, pages, table, kv_lens, first, request.softmax_sinks)
    if request.num_q_rows == 0:
        return jnp.zeros(q.shape, q.dtype)
    tile = _row_tile(request.num_q_rows, request.batch)
    cu_q_lens = jnp.asarray(request.cu_q_lens, jnp.int32)
    return _ragged(opts, tile, q, pages, table, kv_lens, cu_q_lens, request.softmax_sinks)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _ragged(
    opts: _Options,
    tile: int,
    q: Array,
    pages: _Pages,
    table: Array,
    kv_lens: Array,
    cu_q_lens: Array,
    sinks: Array | None,
) -> Array:
    """The ragged form ``q [total_q, N, H]`` as `_paged` over tiles of ``tile`` rows."""
    total_q = q.shape[0]
    tiles = _RowTiles.of(cu_q_lens, kv_lens, tile, total_q)
    rows = jnp.clip(tiles.first_row[:, None] + jnp.arange(tile), 0, total_q - 1)
    out = _paged(
        opts,
        q[rows],  # [tiles, tile, N, H]
        pages,
        table[tiles.seq],
        jnp.where(tiles.live, kv_lens[tiles.seq], 0),
        tiles.first_position,
        sinks,
    )
    out = out[tiles.row_tile, tiles.row_offset]
    return jnp.where(tiles.row_live[:, None, None], out, jnp.zeros((), out.dtype))


def _row_tile(total_q: int, batch: int) -> int:
    """Query rows per tile of the ragged form: about the mean rows per sequence (a power
    of two, at most 32): 1 for a batch of decode steps, more for prefill chunks."""
    mean = -(-total_q // max(batch, 1))
    return min(1 << (mean - 1).bit_length(), 32)


class _RowTiles(NamedTuple):
    """The ragged rows cut into tiles of ``tile`` rows, each inside one sequence.

    A sequence of ``T_b`` rows takes ``cdiv(T_b, tile)`` tiles, so there are at most
    ``min(cdiv(total_q, tile) + B, total_q)`` (a static count; the tiles past the
    sequences' own are not live and see no key). Each tile is then one sequence of the
    ``[B, T]`` form with ``T = tile``, and every query row is read back from its tile.
    """

    seq: Array  # [tiles] the tile's sequence (0 for a tile that is not live)
    live: Array  # [tiles] bool
    first_row: Array  # [tiles] its first row in q
    first_position: Array  # [tiles] that row's position in its sequence
    row_tile: Array  # [total_q] the tile of each row
    row_offset: Array  # [total_q] the row's index inside its tile
    row_live: Array  # [total_q] bool: the row is one of a sequence's (not past cu_q_lens[-1])

    @classmethod
    def of(cls, cu_q_lens: Array, kv_lens: Array, tile: int, total_q: int) -> _RowTiles:
        batch = kv_lens.shape[0]
        q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
        tiles_of = (q_lens + tile - 1) // tile
        ends = jnp.cumsum(tiles_of)  # sequence b owns the tiles [ends[b] - tiles_of[b], ends[b])
        starts = ends - tiles_of
        num_tiles = min(-(-total_q // tile) + batch, total_q)
        j = jnp.arange(num_tiles, dtype=jnp.int32)
        seq = jnp.searchsorted(ends, j, side="right").astype(jnp.int32)  # skips empty ones
        live = seq < batch
        seq = jnp.minimum(seq, batch - 1)
        first_local = (j - starts[seq]) * tile
        r = jnp.arange(total_q, dtype=jnp.int32)
        row_seq = jnp.searchsorted(cu_q_lens, r, side="right").astype(jnp.int32) - 1
        row_seq = jnp.clip(row_seq, 0, batch - 1)
        local = r - cu_q_lens[row_seq]
        return cls(
            seq=seq,
            live=live,
            first_row=cu_q_lens[seq] + first_local,
            first_position=kv_lens[seq] - q_lens[seq] + first_local,
            row_tile=jnp.clip(starts[row_seq] + local // tile, 0, num_tiles - 1),
            row_offset=local % tile,
            row_live=r < cu_q_lens[-1],
        )


@functools.partial(jax.jit, static_argnums=(0,))
def _paged(
    opts: _Options,
    q: Array,
    pages: _Pages,
    table: Array,
    kv_lens: Array,
    first_position: Array,
    sinks: Array | None,
) -> Array:
    """``[B, T, N, H]`` paged attention, chunked over sequences: row ``b``'s queries sit at
    ``first_position[b] + t`` over the first ``kv_lens[b]`` keys of its pages."""
    batch, q_len, heads, _ = q.shape
    _, page_size, kv_heads, head_dim = pages.k.shape
    capacity = table.shape[1] * page_size
    per_sequence = 2 * capacity * kv_heads * head_dim + 2 * heads * q_len * capacity
    chunk = max(1, min(batch, _CHUNK_ELEMENTS // max(per_sequence, 1)))
    sinks = _grouped_sinks(sinks, kv_heads)  # [1, K, G, 1]

    def attend(rows: tuple[Array, Array, Array, Array]) -> Array:
        q, table, kv_lens, first_position = rows
        keys = gather_pages(pages.k, table, kv_lens, scales=pages.k_scales)
        values = gather_pages(pages.v, table, kv_lens, scales=pages.v_scales)
        return _attend(opts, q, keys, values, first_position, sinks)

    rows = (q, table, kv_lens, first_position)
    if chunk >= batch:
        return attend(rows)

    def attend_one(row: tuple[Array, Array, Array, Array]) -> Array:
        return attend(tuple(x[None] for x in row))[0]

    return jax.lax.map(attend_one, rows, batch_size=chunk)


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
