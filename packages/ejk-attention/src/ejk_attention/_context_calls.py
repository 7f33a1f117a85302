"""One call of a context-parallel step, forward and backward: Triton kernels or XLA.

A `Call` (see `_context_plan`) is a block of queries against a block of keys. Its
forward returns the block's ``(out, lse)``, merged by the caller through the lse; its
backward returns the block's ``(dq, dk, dv)`` given the GLOBAL output and lse of the
rows (``P = exp(s - lse)``, ``dS = P ∘ (dP - delta)``, ``delta = rowsum(dO ∘ O) - dlse``;
FlashAttention-2, Alg. 2). ``"triton"`` runs `ejk_kernels_gpu.context`; ``"xla"`` is the
same arithmetic in einsums with float32 score blocks (every platform).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from ejk_kernels_gpu.context import BlockMasks, block_backward, block_forward
from ejk_sequtils import dropout_keep_mask, visibility_mask

from ._context_plan import Call

__all__ = ["CallMasks", "call_backward", "call_forward", "merge"]

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class CallMasks:
    """The static options shared by every call of one context-parallel attention."""

    scale: float
    causal: bool
    window: tuple[int, int] | None
    soft_cap: float | None
    kernels: bool  # Triton kernels, else XLA einsums
    dropout_rate: float = 0.0

    def of(self, call: Call) -> tuple[bool, tuple[int, int] | None, bool]:
        """``(causal, window, relative)`` of a call of this kind."""
        if call.kind == "full":
            return False, None, False
        if call.kind == "causal":
            return True, None, False
        return self.causal, self.window, True


def _block_masks(cm: CallMasks, call: Call) -> Any:
    causal, window, relative = cm.of(call)
    return BlockMasks(
        scale=cm.scale,
        causal=causal,
        window=window,
        soft_cap=cm.soft_cap,
        relative=relative,
        dropout_rate=cm.dropout_rate,
    )


def _dropped(cm: CallMasks, p: Array, key: Array | None) -> Array:
    """``p [B, N, T, S]`` with dropout applied: the keep-mask of the call's global indices
    (``key``: `ejk_sequtils.dropout_key`, ``[seed, b0, n0, i0, j0]``), kept ones scaled."""
    if cm.dropout_rate == 0.0:
        return p
    b, n, t, s = p.shape
    keep = dropout_keep_mask(key[0], b, n, t, s, cm.dropout_rate, offsets=tuple(key[1:]))
    return jnp.where(keep, p / (1.0 - cm.dropout_rate), 0.0)


def _xla_logits(cm: CallMasks, call: Call, q, k, ids, q_off, k_off) -> Array:
    """Masked float32 logits ``[B, N, T, S]`` of a call (query head n reads kv head n // G)."""
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=_F32)
    s = s.reshape(b, n, t, k.shape[1]) * cm.scale
    if cm.soft_cap is not None:
        s = cm.soft_cap * jnp.tanh(s / cm.soft_cap)
    causal, window, relative = cm.of(call)
    vis = visibility_mask(
        t,
        k.shape[1],
        causal=causal,
        sliding_window=window,
        segment_ids=ids,
        q_offset=q_off if relative else 0,
        kv_offset=k_off if relative else 0,
    )
    return jnp.where(vis, s, -jnp.inf)


def _xla_pv(p: Array, v: Array) -> Array:
    """``p [B, N, T, S] @ v [B, S, K, Hv]`` -> float32 ``[B, T, N, Hv]``."""
    b, n, t, s = p.shape
    kv_heads = v.shape[2]
    pg = p.reshape(b, kv_heads, n // kv_heads, t, s).astype(v.dtype)
    o = jnp.einsum("bkgts,bskh->btkgh", pg, v, preferred_element_type=_F32)
    return o.reshape(b, t, n, v.shape[-1])


def call_forward(
    cm: CallMasks, call: Call, q, k, v, ids, q_off, k_off, dropout_key=None
) -> tuple[Array, Array]:
    """``(out [B, T, N, Hv] in q's dtype, lse [B, N, T] float32)`` of one call (sliced inputs;
    ``ids``: the ``(q_ids, k_ids)`` pair or None; offsets used by relative calls;
    ``dropout_key``: the call's `ejk_sequtils.dropout_key` with dropout, else None)."""
    if cm.kernels:
        masks = _block_masks(cm, call)
        return block_forward(
            masks,
            q,
            k,
            v,
            q_offset=q_off,
            k_offset=k_off,
            segment_ids=ids,
            dropout_key=dropout_key,
        )
    s = _xla_logits(cm, call, q, k, ids, q_off, k_off)
    m = jnp.max(s, axis=-1)
    safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - safe[..., None])
    den = p.sum(-1)
    has_mass = den > 0
    safe_den = jnp.where(has_mass, den, 1.0)
    lse = jnp.where(has_mass, safe + jnp.log(safe_den), -jnp.inf)
    out = _xla_pv(_dropped(cm, p, dropout_key), v) / safe_den.transpose(0, 2, 1)[..., None]
    return out.astype(q.dtype), lse


def call_backward(
    cm: CallMasks, call: Call, q, k, v, out, lse, d_out, d_lse, ids, q_off, k_off, dropout_key=None
) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` of one call given the rows' global ``out``, ``lse`` and cotangents."""
    if cm.kernels:
        masks = _block_masks(cm, call)
        return block_backward(
            masks,
            q,
            k,
            v,
            out,
            lse,
            d_out,
            d_lse,
            q_offset=q_off,
            k_offset=k_off,
            segment_ids=ids,
            dropout_key=dropout_key,
        )
    safe_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(_F32), out.astype(_F32))
    row_ct = jnp.where(jnp.isfinite(lse), d_lse.astype(_F32), 0.0) - delta

    def partial_out(q, k, v):
        p = jnp.exp(_xla_logits(cm, call, q, k, ids, q_off, k_off) - safe_lse[..., None])
        # dropout acts on the output's weights only; the lse (and its cotangent) sees all
        return _xla_pv(_dropped(cm, p, dropout_key), v), p.sum(-1)

    _, vjp = jax.vjp(partial_out, q, k, v)
    return vjp((d_out.astype(_F32), row_ct))


def merge(acc: tuple[Array, Array], part: tuple[Array, Array]) -> tuple[Array, Array]:
    """Two partial results ``(out float32 [B, T, N, Hv], lse [B, N, T])`` of the same rows
    over disjoint key sets, merged through the log-sum-exp."""
    (o1, l1), (o2, l2) = acc, part
    lse = jnp.logaddexp(l1, l2)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w1 = jnp.exp(l1 - safe).transpose(0, 2, 1)[..., None]
    w2 = jnp.exp(l2 - safe).transpose(0, 2, 1)[..., None]
    return o1 * w1 + o2.astype(_F32) * w2, lse
