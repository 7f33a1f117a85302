"""The custom VJP that joins the flash forward and backward launches.

`flash_vjp` computes ``(out, lse)``; its rules (`flash_vjp_fwd`, `flash_vjp_bwd`) also serve
the decode route (`flash._decode`), whose primal is the split-KV kernel.
"""

from __future__ import annotations

import functools

import jax

from ._backward_launch import backward
from ._forward_launch import forward
from ._select import CallOptions
from ._tables import Tables

__all__ = ["flash_vjp", "flash_vjp_bwd", "flash_vjp_fwd"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def flash_vjp(opts: CallOptions, q, k, v, bias, sinks, tables: Tables):
    out, lse, _ = forward(opts, q, k, v, bias, sinks, tables)
    return out, lse


def flash_vjp_fwd(opts: CallOptions, q, k, v, bias, sinks, tables: Tables):
    out, lse, rows = forward(opts, q, k, v, bias, sinks, tables)
    return (out, lse), (q, k, v, bias, sinks, tables.for_backward(), out, rows)


def flash_vjp_bwd(opts: CallOptions, res, cts):
    q, k, v, bias, sinks, tables, out, rows = res
    d_out, d_lse = cts  # lse feeds ring attention's merge, so its cotangent counts too
    grads = backward(opts, q, k, v, bias, sinks, tables, out, rows, d_out, d_lse)
    dq, dk, dv, dbias, dsinks = grads
    return dq, dk, dv, dbias, dsinks, None


flash_vjp.defvjp(flash_vjp_fwd, flash_vjp_bwd)
