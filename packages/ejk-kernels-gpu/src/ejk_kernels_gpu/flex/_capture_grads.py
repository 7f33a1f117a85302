"""Cotangents of the float arrays a score_mod captures, computed in XLA from the forward's lse.

For each element the score_mod sees, its output's cotangent is ``dS = P ∘ (dP - delta)``
(`_flex_ops.flex_dscores` before the chain rule), so a captured table's cotangent is the
sum over elements of ``dS`` pulled back through the score_mod (`jax.vjp` with respect to
the captures). This pass recomputes the scores one chunk of query rows at a time (a scan,
the cotangents summed in its carry), so it never holds ``[B, N, T, S]``; under ``jax.jit``
XLA drops it when the captures' cotangents are not used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from ._launch import FlexCall

__all__ = ["capture_cotangents"]

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
# Scores per chunk of query rows (64 MiB of float32).
_MAX_SCORES = 1 << 24


def _elementwise(jaxpr: Any, captures: Sequence[Any], *grids: Any) -> Any:
    """``jaxpr`` (captures first, then scalars) at every element of the broadcast ``grids``."""
    fn = jcore.jaxpr_as_fun(jaxpr)
    return jnp.vectorize(lambda *xs: fn(*captures, *xs)[0])(*grids)


def capture_cotangents(
    call: FlexCall, q, k, v, score_caps: Sequence[Any], mask_caps: Sequence[Any], lse, d_out, delta
) -> list[Any]:
    """Per score_mod capture: its cotangent (floating captures) or None (integer ones).

    Args:
        call: the call (its plan's jaxprs, the scale).
        q, k, v: the call's inputs.
        score_caps, mask_caps: the arrays each mod captures.
        lse: the forward's ``[B, N, T]`` lse.
        d_out: the output's cotangent ``[B, T, N, Hv]``.
        delta: ``rowsum(dO ∘ O) - d_lse`` ``[B, N, T]``.
    """
    floating = [jnp.issubdtype(jnp.result_type(c), jnp.floating) for c in score_caps]
    if not any(floating):
        return [None] * len(score_caps)
    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    chunk = max(1, min(q_len, _MAX_SCORES // max(1, batch * heads * kv_len)))
    chunks = -(-q_len // chunk)
    pad = chunks * chunk - q_len

    def split(x: Any, axis: int, fill: float) -> Any:
        """``x`` padded along ``axis`` to whole chunks, chunks leading."""
        x = jnp.pad(x.astype(_F32), [(0, pad if i == axis else 0) for i in range(x.ndim)],
                    constant_values=fill)  # fmt: skip
        x = x.reshape(*x.shape[:axis], chunks, chunk, *x.shape[axis + 1 :])
        return jnp.moveaxis(x, axis, 0)

    xs = (
        split(q, 1, 0.0), split(d_out, 1, 0.0), split(lse, 2, -jnp.inf), split(delta, 2, 0.0),
        jnp.arange(chunks, dtype=jnp.int32) * chunk,
    )  # fmt: skip
    k32, v32 = k.astype(_F32), v.astype(_F32)
    b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]
    kv_idx = jnp.arange(kv_len, dtype=jnp.int32)[None, None, None, :]
    wanted = [c for c, f in zip(score_caps, floating, strict=True) if f]

    def step(acc: list[Any], x: Any) -> tuple[list[Any], None]:
        qc, doc, lsec, deltac, start = x
        q_idx = (start + jnp.arange(chunk, dtype=jnp.int32))[None, None, :, None]
        qg = qc.reshape(batch, chunk, kv_heads, group, head_dim)
        raw = jnp.einsum("bckgh,bskh->bkgcs", qg, k32, precision=_HIGHEST) * call.scale
        raw = raw.reshape(batch, heads, chunk, kv_len)

        def modded(float_caps: list[Any]) -> Any:
            it = iter(float_caps)
            caps = [next(it) if f else c for c, f in zip(score_caps, floating, strict=True)]
            return _elementwise(call.plan.score, caps, raw, b, h, q_idx, kv_idx)

        s, pull = jax.vjp(modded, wanted)
        visible = (q_idx < q_len) & jnp.isfinite(lsec)[..., None]
        if call.plan.mask is not None:
            visible = visible & _elementwise(call.plan.mask, mask_caps, b, h, q_idx, kv_idx)
        p = jnp.where(visible, jnp.exp(jnp.where(visible, s - lsec[..., None], -jnp.inf)), 0.0)
        dog = doc.reshape(batch, chunk, kv_heads, group, -1)
        dp = jnp.einsum("bckgd,bskd->bkgcs", dog, v32, precision=_HIGHEST)
        ds = p * (dp.reshape(batch, heads, chunk, kv_len) - deltac[..., None])
        (grads,) = pull(ds.astype(s.dtype))
        return [a + g.astype(a.dtype) for a, g in zip(acc, grads, strict=True)], None

    zeros = [jnp.zeros(jnp.shape(c), _F32) for c in wanted]
    sums, _ = jax.lax.scan(step, zeros, xs)
    it = iter(sums)
    return [next(it).astype(jnp.result_type(c)) if f else None
            for c, f in zip(score_caps, floating, strict=True)]  # fmt: skip
