"""Ring attention: sequence-parallel attention inside ``shard_map``.

Each of the ``n`` devices on ``axis_name`` holds one contiguous block of the
queries and one of the keys/values. The k/v blocks travel round the ring with
``ppermute`` (device d sends to d + 1), so at step s device d holds the block that
started on device ``d - s``. Each step folds that block into an online softmax
(running max, denominator and unnormalised output; FlashAttention-2, Alg. 1),
and the partial results merge through the log-sum-exp. The next block's
``ppermute`` is issued before the current block's compute, so XLA can overlap
the transfer with the math (Liu et al. 2023, "Ring Attention with Blockwise
Transformers", Sec. 3).

The backward pass is a second ring (custom VJP): dq accumulates in place, while
dk and dv travel with their k/v block and arrive home after ``n`` hops. Each
block's gradient is the VJP of ``(P @ v, rowsum P)`` with ``P = exp(s - lse)``
for the saved global lse and cotangents ``(dout, dlse - D)``, ``D = rowsum(dout * out)``,
which is FlashAttention-2's ``dS = P * (dP - D)`` (Alg. 2) without writing it out.
Blocks that causality or the window hide entirely are skipped with ``lax.cond``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jaxtyping import Float, Int

from ejk_sequtils import validate_attention, visibility_mask

__all__ = ["ring_attention"]

AnyArray = Array | np.ndarray
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The static (hashable) part of a ring attention call."""

    axis_name: Any
    scale: float
    causal: bool
    window: tuple[int, int] | None
    soft_cap: float | None


def _ring_size(axis_name: Any) -> int:
    return jax.lax.psum(1, axis_name)


def _shift(tree: Any, axis_name: Any, size: int) -> Any:
    """Send every array of ``tree`` to the next device on the ring."""
    perm = [(d, (d + 1) % size) for d in range(size)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), tree)


def _visible(
    st: _Ring, q_len: int, kv_len: int, q_start: Array, k_start: Array, q_ids: Any, kv_ids: Any
) -> Array:
    """bool ``[B|1, 1, Tl, Sl]``: which keys of this block each local query sees."""
    return visibility_mask(
        q_len,
        kv_len,
        causal=st.causal,
        sliding_window=st.window,
        segment_ids=None if q_ids is None else (q_ids, kv_ids),
        q_offset=q_start,
        kv_offset=k_start,
    )


def _block_hidden(st: _Ring, q_len: int, kv_len: int, q_start: Array, k_start: Array) -> Array:
    """True when causality or the window hides the whole block (its compute can be skipped)."""
    hidden = jnp.asarray(False)
    if st.causal:
        hidden |= k_start > q_start + q_len - 1
    if st.window is not None:
        left, right = st.window
        hidden |= k_start + kv_len - 1 < q_start - left
        hidden |= k_start > q_start + q_len - 1 + right
    return hidden


def _logits(st: _Ring, q: Array, k: Array) -> Array:
    """Soft-capped float32 logits ``[B, N, Tl, Sl]``; query head n reads kv head ``n // G``."""
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=_F32)
    s = s.reshape(b, n, t, k.shape[1]) * st.scale
    if st.soft_cap is not None:
        s = st.soft_cap * jnp.tanh(s / st.soft_cap)
    return s


def _pv(p: Array, v: Array) -> Array:
    """``p [B, N, Tl, Sl] @ v [B, Sl, K, Hv]`` -> float32 ``[B, N, Tl, Hv]``."""
    b, n, t, s = p.shape
    kv_heads = v.shape[2]
    pg = p.reshape(b, kv_heads, n // kv_heads, t, s).astype(v.dtype)
    o = jnp.einsum("bkgts,bskh->bkgth", pg, v, preferred_element_type=_F32)
    return o.reshape(b, n, t, v.shape[-1])


def _positions(q: Array, k: Array, axis_name: Any, size: int, step: int) -> tuple[Array, Array]:
    """Global start of this device's queries and of the k/v block it holds at ``step``."""
    me = jax.lax.axis_index(axis_name)
    source = (me - step) % size
    return me * q.shape[1], source * k.shape[1]


def _forward(st: _Ring, q, k, v, q_ids, kv_ids) -> tuple[Array, Array]:
    size = _ring_size(st.axis_name)
    b, t, n, _ = q.shape
    s_len = k.shape[1]
    m = jnp.full((b, n, t), -jnp.inf, _F32)
    den = jnp.zeros((b, n, t), _F32)
    acc = jnp.zeros((b, n, t, v.shape[-1]), _F32)

    def fold(carry, kv, step):
        m, den, acc = carry
        k, v, kv_ids = kv
        q_start, k_start = _positions(q, k, st.axis_name, size, step)
        vis = _visible(st, t, s_len, q_start, k_start, q_ids, kv_ids)
        s = jnp.where(vis, _logits(st, q, k), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - safe)
        p = jnp.exp(s - safe[..., None])
        return m_new, den * alpha + p.sum(-1), acc * alpha[..., None] + _pv(p, v)

    kv = (k, v, kv_ids)
    carry = (m, den, acc)
    for step in range(size):
        # Issue the transfer of the next block first: it does not depend on this step's math.
        nxt = _shift(kv, st.axis_name, size) if step < size - 1 else None
        if step == 0:
            carry = fold(carry, kv, step)  # the own block is never hidden
        else:
            q_start, k_start = _positions(q, k, st.axis_name, size, step)
            carry = jax.lax.cond(
                _block_hidden(st, t, s_len, q_start, k_start),
                lambda c, kv: c,
                functools.partial(fold, step=step),
                carry,
                kv,
            )
        kv = nxt
    m, den, acc = carry
    has_mass = den > 0
    safe_den = jnp.where(has_mass, den, 1.0)
    lse = jnp.where(has_mass, m + jnp.log(safe_den), -jnp.inf)
    out = (acc / safe_den[..., None]).transpose(0, 2, 1, 3).astype(q.dtype)
    return out, lse


def _backward(st: _Ring, res, cts) -> tuple:
    q, k, v, q_ids, kv_ids, out, lse = res
    d_out, d_lse = cts
    size = _ring_size(st.axis_name)
    t, s_len = q.shape[1], k.shape[1]
    safe_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(_F32), out.astype(_F32))
    row_ct = d_lse.astype(_F32) - delta  # cotangent of rowsum(P)
    d_out_t = d_out.astype(_F32).transpose(0, 2, 1, 3)  # [B, N, T, Hv]

    def block_grads(kv, step):
        k, v, kv_ids = kv
        q_start, k_start = _positions(q, k, st.axis_name, size, step)
        vis = _visible(st, t, s_len, q_start, k_start, q_ids, kv_ids)

        def partial_out(q, k, v):
            p = jnp.exp(jnp.where(vis, _logits(st, q, k), -jnp.inf) - safe_lse[..., None])
            return _pv(p, v), p.sum(-1)

        _, vjp = jax.vjp(partial_out, q, k, v)
        return vjp((d_out_t, row_ct))

    def accumulate(carry, kv, step):
        dq, dk, dv = carry
        gq, gk, gv = block_grads(kv, step)
        return dq + gq.astype(_F32), dk + gk.astype(_F32), dv + gv.astype(_F32)

    kv = (k, v, kv_ids)
    dq = jnp.zeros(q.shape, _F32)
    dkv = (jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
    for step in range(size):
        nxt = _shift(kv, st.axis_name, size) if step < size - 1 else None
        if step == 0:
            dq, *dkv = accumulate((dq, *dkv), kv, step)
        else:
            q_start, k_start = _positions(q, k, st.axis_name, size, step)
            dq, *dkv = jax.lax.cond(
                _block_hidden(st, t, s_len, q_start, k_start),
                lambda c, kv: c,
                functools.partial(accumulate, step=step),
                (dq, *dkv),
                kv,
            )
        # dk/dv travel with their block; after `size` hops they are home.
        dkv = _shift(tuple(dkv), st.axis_name, size)
        kv = nxt
    dk, dv = dkv
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


def _add_sinks(out: Array, lse: Array, sinks: Array) -> tuple[Array, Array]:
    """Put the sink logits into the softmax denominator: rescale ``out``, extend ``lse``.

    Plain jnp outside the custom VJP, so autodiff (and shard_map's replication
    rules for the replicated sinks) give their gradient; the ring's lse cotangent
    carries it back into q and k.
    """
    new_lse = jnp.logaddexp(lse, sinks.astype(_F32)[None, :, None])
    factor = jnp.exp(lse - new_lse).transpose(0, 2, 1)[..., None]  # 0 where lse = -inf
    return (out.astype(_F32) * factor).astype(out.dtype), new_lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(st: _Ring, q, k, v, q_ids, kv_ids):
    return _forward(st, q, k, v, q_ids, kv_ids)


def _ring_fwd(st: _Ring, q, k, v, q_ids, kv_ids):
    out, lse = _forward(st, q, k, v, q_ids, kv_ids)
    return (out, lse), (q, k, v, q_ids, kv_ids, out, lse)


_ring.defvjp(_ring_fwd, _backward)


def ring_attention(
    q: Float[AnyArray, "B T N H"],
    k: Float[AnyArray, "B S K H"],
    v: Float[AnyArray, "B S K Hv"],
    *,
    axis_name: Any,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    softmax_sinks: Float[AnyArray, " N *num_sinks"] | None = None,
    segment_ids: Int[AnyArray, "B T"]
    | tuple[Int[AnyArray, "B T"], Int[AnyArray, "B S"]]
    | None = None,
    return_lse: bool = False,
) -> Float[Array, "B T N Hv"] | tuple[Float[Array, "B T N Hv"], Float[Array, "B N T"]]:
    """Sequence-parallel attention; call it inside ``shard_map`` with T and S sharded over ``axis_name``.

    The arguments are this device's blocks: device d holds queries
    ``[d * T, (d + 1) * T)`` and keys ``[d * S, (d + 1) * S)`` of the global sequence,
    and masks (causal, window, segment ids) apply to global positions. The result
    equals `reference_attention` on the gathered inputs, and so do its gradients.

    Args:
        q: this device's queries ``[B, T, N, H]``.
        k: this device's keys ``[B, S, K, H]``, ``N % K == 0``.
        v: this device's values ``[B, S, K, Hv]``.
        axis_name: the ``shard_map`` mesh axis the sequence is split over.
        softmax_scale: default ``H ** -0.5``.
        causal: global query i sees global keys ``j <= i``.
        sliding_window: ``(left, right)`` or ``w``, in global positions.
        logits_soft_cap: ``cap * tanh(logits / cap)``.
        softmax_sinks: ``[N]`` or ``[N, num_sinks]`` per-head sink logits (replicated on the ring).
        segment_ids: this device's ``[B, T]`` ids (self attention, T == S) or the pair
            ``(q_ids [B, T], kv_ids [B, S])``; the kv ids travel with their block.
        return_lse: also return the float32 lse ``[B, N, T]`` of the local rows.

    Returns:
        This device's output block ``[B, T, N, Hv]`` (and its lse).
    """
    request = validate_attention(
        q,
        k,
        v,
        softmax_scale=softmax_scale,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        softmax_sinks=softmax_sinks,
        segment_ids=segment_ids,
        return_lse=return_lse,
    )
    st = _Ring(
        axis_name=axis_name,
        scale=request.softmax_scale,
        causal=request.causal,
        window=request.sliding_window,
        soft_cap=request.logits_soft_cap,
    )
    q_ids, kv_ids = request.segment_ids or (None, None)
    out, lse = _ring(st, request.q, request.k, request.v, q_ids, kv_ids)
    if request.softmax_sinks is not None:
        out, lse = _add_sinks(out, lse, request.softmax_sinks)
    return (out, lse) if request.return_lse else out
