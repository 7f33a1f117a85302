"""The ``xla`` backend: `reference_attention`'s definition in plain jnp, with its own VJP.

The forward is the reference's computation in float32 (grouped-query heads read their
kv head through a reshape, not a copy). The backward recomputes the probabilities
from the saved row max and denominator (FlashAttention-2, Alg. 2, with ``m`` and
``l`` kept apart: rebuilding ``p`` from ``lse = m + log l`` would lose ``log l`` next to
a row max of ``-FLT_MAX``) instead of letting autodiff keep every intermediate, so the
backward runs five matmuls and a few fused elementwise passes.

Causal and sliding-window calls are cut into query blocks that each read only the key
range some query of theirs can see: the blocks above the diagonal (or outside the
band) are never computed, forward or backward.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from ejk_sequtils import AttentionRequest, dropout_keep_mask, dropout_seed_u32, visibility_mask

__all__ = ["XLA_BACKEND", "xla_attention"]

# What the `xla` backend is, in the words `ejk info` prints and the READMEs repeat.
XLA_BACKEND = (
    "_xla.xla_attention: float32 jnp with a custom VJP (causal/window calls in 256-row "
    "query blocks), tested against the float32 reference_attention"
)

_F32 = jnp.float32
# The reference's matmul precision (float32 on GPUs and TPUs too, not TF32 / bf16 passes).
_PRECISION = jax.lax.Precision.HIGHEST
# Query rows per block when causal / window let blocks skip keys (None: one block).
_BLOCK_Q = 256


class _Options(NamedTuple):
    """The static options of one call (hashable: the custom VJP's non-differentiable part)."""

    scale: float
    causal: bool
    window: tuple[int, int] | None
    soft_cap: float | None
    dropout_rate: float
    return_lse: bool


class _Masking(NamedTuple):
    """The integer inputs: they decide visibility and dropout, and carry no gradient."""

    segment_ids: tuple[Array, Array] | None
    cu_seqlens_q: Array | None
    cu_seqlens_k: Array | None
    seed: Array | None
    dropout_offsets: tuple[Any, Any, Any, Any] | None  # a shard's origin in the hash


def xla_attention(request: AttentionRequest) -> Any:
    """``request`` computed in jnp: ``out`` or ``(out, lse)``, as `reference_attention` defines."""
    opts = _Options(
        scale=request.softmax_scale,
        causal=request.causal,
        window=request.sliding_window,
        soft_cap=request.logits_soft_cap,
        dropout_rate=request.dropout_rate,
        return_lse=request.return_lse,
    )
    masking = _Masking(
        segment_ids=request.segment_ids,
        cu_seqlens_q=request.cu_seqlens_q,
        cu_seqlens_k=request.cu_seqlens_k,
        seed=None if request.dropout_rate == 0.0 else dropout_seed_u32(request.dropout_seed),
        dropout_offsets=(
            None
            if request.dropout_rate == 0.0 or request.dropout_offsets is None
            else tuple(jnp.asarray(x, jnp.int32) for x in request.dropout_offsets)
        ),
    )
    q, k, v = (jnp.asarray(x) for x in (request.q, request.k, request.v))
    bias = None if request.bias is None else jnp.asarray(request.bias)
    sinks = request.softmax_sinks
    out, lse = _attention(opts, q, k, v, bias, sinks, masking)
    return (out, lse) if opts.return_lse else out


class _Tile(NamedTuple):
    """What one query block sees: its rows ``[q0, q1)`` and keys ``[k0, k1)``."""

    q0: int
    q1: int
    k0: int
    k1: int


def _tiles(opts: _Options, q_len: int, kv_len: int) -> list[_Tile]:
    """Query blocks and the key range each can see (all keys when nothing is local)."""
    if not (opts.causal or opts.window is not None) or q_len <= _BLOCK_Q:
        return [_Tile(0, q_len, 0, kv_len)]
    left, right = opts.window if opts.window is not None else (q_len + kv_len, q_len + kv_len)
    if opts.causal:
        right = min(right, 0)
    tiles = []
    for q0 in range(0, q_len, _BLOCK_Q):
        q1 = min(q0 + _BLOCK_Q, q_len)
        k0 = min(max(q0 - left, 0), kv_len)
        k1 = max(min(q1 - 1 + right + 1, kv_len), k0)
        tiles.append(_Tile(q0, q1, k0, k1))
    return tiles


def _visible(opts: _Options, masking: _Masking, tile: _Tile) -> Array:
    """bool ``[#B, 1, 1, tq, tk]``: which keys of the tile each of its queries sees."""
    q0, q1, k0, k1 = tile
    ids = masking.segment_ids
    if ids is not None:
        ids = (ids[0][:, q0:q1], ids[1][:, k0:k1])
    # Packed positions are global (offsets into cu_seqlens); the tile's slice of them.
    visible = visibility_mask(
        q1 - q0,
        k1 - k0,
        causal=opts.causal,
        sliding_window=opts.window,
        segment_ids=ids,
        cu_seqlens_q=masking.cu_seqlens_q,
        cu_seqlens_k=masking.cu_seqlens_k,
        q_offset=q0,
        kv_offset=k0,
    )
    return visible[:, :, None]


def _matmul(spec: str, x: Array, y: Array) -> Array:
    """A batched float32 matmul over ``(b, k)`` (the reference's precision)."""
    return jnp.einsum(spec, x, y, precision=_PRECISION, preferred_element_type=_F32)


def _grouped(x: Array, kv_heads: int) -> Array:
    """``[#B, #N, ...]`` as ``[#B, K|1, G|1, ...]`` (head n is kv head n // G, member n % G)."""
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], kv_heads, x.shape[1] // kv_heads, *x.shape[2:])


def _by_head(x: Array, kv_heads: int) -> Array:
    """``[B, T, N, H]`` as ``[B, K, G, T, H]`` (for ``k``/``v``, ``[B, K, S, H]`` with G squeezed)."""
    b, t, n, h = x.shape
    return x.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)


def _by_token(x: Array) -> Array:
    """``[B, K, G, T, H]`` back to ``[B, T, N, H]``."""
    b, kv_heads, group, t, h = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, t, kv_heads * group, h)


class _Heads(NamedTuple):
    """q, k, v laid out for batched matmuls: ``q [B, K, G, T, H]`` (times the softmax scale:
    one pass over q, not over the logits), ``k, v [B, K, S, H]``."""

    q: Array
    k: Array
    v: Array

    @classmethod
    def of(cls, q: Array, k: Array, v: Array, scale: float) -> _Heads:
        kv_heads = k.shape[2]
        q = _by_head(q.astype(_F32) * scale, kv_heads)
        return cls(q, _by_head(k, kv_heads)[:, :, 0], _by_head(v, kv_heads)[:, :, 0])

    def rows(self, tile: _Tile) -> Array:
        """The tile's queries as ``[B, K, G·tq, H]`` (one matmul per kv head)."""
        b, kv_heads, group, _, h = self.q.shape
        return self.q[:, :, :, tile.q0 : tile.q1].reshape(
            b, kv_heads, group * (tile.q1 - tile.q0), h
        )


def _logits(opts: _Options, heads: _Heads, bias: Array | None, tile: _Tile) -> Array:
    """float32 ``[B, K, G, tq, tk]``: ``(scale·q)·kᵀ + bias``, then the soft cap."""
    q0, q1, k0, k1 = tile
    b, kv_heads, group = heads.q.shape[:3]
    s = _matmul("bkqh,bksh->bkqs", heads.rows(tile), heads.k[:, :, k0:k1])
    s = s.reshape(b, kv_heads, group, q1 - q0, k1 - k0)
    if bias is not None:
        s = s + _grouped(bias[:, :, q0:q1, k0:k1].astype(_F32), kv_heads)
    if opts.soft_cap is None:
        return s
    return opts.soft_cap * jnp.tanh(s / opts.soft_cap)


def _keep(opts: _Options, masking: _Masking, shape: tuple[int, ...], tile: _Tile) -> Array:
    """The dropout keep-mask of the tile, ``[B, K, G, tq, tk]`` (the definition's hash)."""
    b, kv_heads, group, tq, tk = shape
    b0, n0, i0, j0 = masking.dropout_offsets or (0, 0, 0, 0)
    keep = dropout_keep_mask(
        masking.seed,
        b,
        kv_heads * group,
        tq,
        tk,
        opts.dropout_rate,
        offsets=(b0, n0, i0 + tile.q0, j0 + tile.k0),
    )
    return keep.reshape(b, kv_heads, group, tq, tk)


def _row_stats(s: Array, sinks: Array | None) -> tuple[Array, Array, Array]:
    """``(m, denom, e)``: the row max (0 where none is finite), denominator and ``exp(s - m)``.

    ``sinks`` is ``[1, K, G, 1]``: a logit in every row's denominator.
    """
    m = jnp.max(s, axis=-1, initial=-jnp.inf)
    if sinks is not None:
        m = jnp.maximum(m, sinks)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m[..., None])
    denom = jnp.sum(e, axis=-1)
    if sinks is not None:
        denom = denom + jnp.exp(sinks - m)
    return m, denom, e


def _tile_forward(opts, heads, bias, sinks, masking, tile):
    """One query block: ``(out [B, K, G, tq, Hv], m, denom)`` with ``m, denom [B, K, G, tq]``."""
    s = jnp.where(_visible(opts, masking, tile), _logits(opts, heads, bias, tile), -jnp.inf)
    m, denom, e = _row_stats(s, sinks)
    if opts.dropout_rate > 0.0:
        keep = _keep(opts, masking, e.shape, tile)
        e = jnp.where(keep, e / (1.0 - opts.dropout_rate), 0.0)
    out = _matmul("bkqs,bksh->bkqh", _flat(e), heads.v[:, :, tile.k0 : tile.k1])
    # Normalise after p·v (FlashAttention-2, Alg. 1, line 12): one pass over [tq, Hv]
    # instead of one over [tq, tk].
    out = out.reshape(*e.shape[:4], out.shape[-1])
    return out * (1.0 / jnp.where(denom > 0, denom, 1.0))[..., None], m, denom


def _flat(x: Array) -> Array:
    """``[B, K, G, tq, ...]`` as ``[B, K, G·tq, ...]``."""
    return x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3], *x.shape[4:])


def _grouped_sinks(sinks: Array | None, kv_heads: int) -> Array | None:
    return None if sinks is None else _grouped(sinks.astype(_F32)[None, :, None], kv_heads)


def _forward(opts, q, k, v, bias, sinks, masking):
    """``(out [B, T, N, Hv] q.dtype, lse [B, N, T] f32, residuals)``."""
    b, q_len, heads_n, _ = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    heads = _Heads.of(q, k, v, opts.scale)
    sinks = _grouped_sinks(sinks, kv_heads)
    parts = [
        _tile_forward(opts, heads, bias, sinks, masking, t) for t in _tiles(opts, q_len, kv_len)
    ]
    out = _concat([p[0] for p in parts], axis=3)  # [B, K, G, T, Hv]
    m = _concat([p[1] for p in parts], axis=3)  # [B, K, G, T]
    denom = _concat([p[2] for p in parts], axis=3)
    lse = jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    lse = lse.reshape(b, heads_n, q_len)
    return _by_token(out).astype(q.dtype), lse, (out, m, denom)


def _concat(xs: list[Array], axis: int) -> Array:
    return xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(opts, q, k, v, bias, sinks, masking):
    out, lse, _ = _forward(opts, q, k, v, bias, sinks, masking)
    return out, lse


def _attention_fwd(opts, q, k, v, bias, sinks, masking):
    out, lse, (out32, m, denom) = _forward(opts, q, k, v, bias, sinks, masking)
    return (out, lse), (q, k, v, bias, sinks, masking, out32, m, denom)


def _attention_bwd(opts, residuals, cotangents):
    q, k, v, bias, sinks, masking, out32, m, denom = residuals
    d_out, d_lse = cotangents
    q_len, kv_len, kv_heads = q.shape[1], k.shape[1], k.shape[2]
    heads = _Heads.of(q, k, v, opts.scale)
    sinks32 = _grouped_sinks(sinks, kv_heads)
    d_out = _by_head(d_out.astype(_F32), kv_heads)  # [B, K, G, T, Hv]
    # D_i = sum_j p_ij dp_ij = dO_i · O_i (FlashAttention-2, Alg. 2, line 4; dropout included).
    row_term = jnp.sum(d_out * out32, axis=-1)
    if opts.return_lse:
        # d lse_i / d s_ij = p_ij: the lse's cotangent joins D with the opposite sign.
        row_term = row_term - d_lse.astype(_F32).reshape(row_term.shape)
    inv_l = 1.0 / jnp.where(denom > 0, denom, 1.0)
    dq_parts, dk, dv, d_bias, d_sinks = [], None, None, None, None
    tiles = _tiles(opts, q_len, kv_len)
    for tile in tiles:
        rows, keys = slice(tile.q0, tile.q1), slice(tile.k0, tile.k1)
        capped = _logits(opts, heads, bias, tile)
        s = jnp.where(_visible(opts, masking, tile), capped, -jnp.inf)
        p = jnp.exp(s - m[..., rows, None]) * inv_l[..., rows, None]
        do = _flat(d_out[:, :, :, rows])
        dp = _matmul("bkqh,bksh->bkqs", do, heads.v[:, :, keys]).reshape(p.shape)
        p_drop = p
        if opts.dropout_rate > 0.0:
            keep = _keep(opts, masking, p.shape, tile)
            p_drop = jnp.where(keep, p / (1.0 - opts.dropout_rate), 0.0)
            dp = jnp.where(keep, dp / (1.0 - opts.dropout_rate), 0.0)
        ds = p * (dp - row_term[..., rows, None])
        if opts.soft_cap is not None:
            ds = ds * (1.0 - jnp.square(capped / opts.soft_cap))  # d tanh = 1 - tanh²
        dq_parts.append(_matmul("bkqs,bksh->bkqh", _flat(ds), heads.k[:, :, keys]))
        dk = _add_at(
            dk, heads.k.shape, keys, _matmul("bkqs,bkqh->bksh", _flat(ds), heads.rows(tile))
        )
        dv = _add_at(dv, heads.v.shape, keys, _matmul("bkqs,bkqh->bksh", _flat(p_drop), do))
        if bias is not None:
            part = _reduce_to(ds, bias.shape)
            d_bias = _add_at_bias(d_bias, bias.shape, rows, keys, part)
        if sinks is not None:
            # A sink is a key without a value: ds_sink = p_sink (0 - D_i + dlse_i).
            p_sink = jnp.exp(sinks32 - m[..., rows]) * inv_l[..., rows]
            part = -jnp.sum(p_sink * row_term[..., rows], axis=(0, 3))
            d_sinks = part if d_sinks is None else d_sinks + part
    b, kv_heads, group, _, head_dim = heads.q.shape
    dq = _concat(
        [
            x.reshape(b, kv_heads, group, t.q1 - t.q0, head_dim)
            for x, t in zip(dq_parts, tiles, strict=True)
        ],
        axis=3,
    )
    grads = [
        (_by_token(dq) * opts.scale).astype(q.dtype),
        dk.transpose(0, 2, 1, 3).astype(k.dtype),  # q carried the scale
        dv.transpose(0, 2, 1, 3).astype(v.dtype),
        None if bias is None else d_bias.astype(bias.dtype),
        None if sinks is None else d_sinks.reshape(sinks.shape).astype(sinks.dtype),
    ]
    return (*grads, None)


def _add_at(total: Array | None, shape: tuple[int, ...], keys: slice, part: Array) -> Array:
    """``total`` ``[B, K, S, H]`` (zeros when None) with ``part`` added at keys ``keys``."""
    if total is None and part.shape == tuple(shape):
        return part
    if total is None:
        total = jnp.zeros(shape, _F32)
    return total.at[:, :, keys].add(part)


def _add_at_bias(
    total: Array | None, shape: tuple[int, ...], rows: slice, keys: slice, part: Array
) -> Array:
    """``total`` (a bias gradient, zeros when None) with ``part`` added at its tile."""
    if total is None and part.shape == tuple(shape):
        return part
    if total is None:
        total = jnp.zeros(shape, _F32)
    return total.at[:, :, rows, keys].add(part)


def _reduce_to(ds: Array, shape: tuple[int, ...]) -> Array:
    """``ds [B, K, G, tq, tk]`` summed onto a bias of ``shape`` ``[#B, #N, T, S]`` (its tile)."""
    b, kv_heads, group, tq, tk = ds.shape
    ds = ds.reshape(b, kv_heads * group, tq, tk)
    axes = tuple(a for a in (0, 1) if shape[a] == 1)
    return jnp.sum(ds, axis=axes, keepdims=True) if axes else ds


_attention.defvjp(_attention_fwd, _attention_bwd)
