"""The custom VJP of a flex call: Triton forward and backward, captures' cotangents in XLA
(`ejk_sequtils.score_mod_capture_cotangents`, shared with the Pallas flex kernels)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from ejk_sequtils import score_mod_capture_cotangents

from ._launch import FlexCall, backward, forward

__all__ = ["flex_vjp"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def flex_vjp(call: FlexCall, q, k, v, score_caps, mask_caps, kv_tables, q_tables):
    """``(out, lse)``; gradients to q, k, v and the score_mod's floating captures."""
    ints, floats = call.plan.pack([*score_caps, *mask_caps])
    return forward(call, q, k, v, ints, floats, kv_tables)


def _fwd(call: FlexCall, q, k, v, score_caps, mask_caps, kv_tables, q_tables):
    ints, floats = call.plan.pack([*score_caps, *mask_caps])
    out, lse = forward(call, q, k, v, ints, floats, kv_tables)
    res = (q, k, v, score_caps, mask_caps, kv_tables, q_tables, ints, floats, out, lse)
    return (out, lse), res


def _bwd(call: FlexCall, res, cts):
    q, k, v, score_caps, mask_caps, kv_tables, q_tables, ints, floats, out, lse = res
    d_out, d_lse = cts
    d_out = d_out.astype(jnp.float32)
    # The lse's cotangent enters as P·d_lse on each score: delta - d_lse in dS = P(dP - delta).
    delta = jnp.einsum("btnd,btnd->bnt", d_out, out.astype(jnp.float32)) - d_lse
    dq, dk, dv = backward(call, q, k, v, ints, floats, kv_tables, q_tables, lse, d_out, delta)
    d_caps = [None] * len(score_caps)
    if call.plan.score is not None:
        score = jcore.jaxpr_as_fun(call.plan.score)
        mask = None if call.plan.mask is None else jcore.jaxpr_as_fun(call.plan.mask)
        d_caps = score_mod_capture_cotangents(
            lambda caps, *xs: score(*caps, *xs)[0],
            score_caps,
            None if mask is None else lambda *xs: mask(*mask_caps, *xs)[0],
            q, k, v, lse, d_out, delta,
            scale=call.scale,
        )  # fmt: skip
    return dq, dk, dv, d_caps, [None] * len(mask_caps), None, None


flex_vjp.defvjp(_fwd, _bwd)
