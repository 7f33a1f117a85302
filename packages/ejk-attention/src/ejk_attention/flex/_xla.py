"""The ``xla`` flex backend: `flex_attention`'s definition in plain jnp, one query chunk at a time.

Each chunk of query rows computes its scores against every key, applies the score_mod and
the mask_mod (both vmapped over the chunk's index grid) and a softmax that gives an
emptied row zeros. Chunks hold at most ``max_scores`` scores, so a long call never holds
the ``[B, N, T, S]`` matrix; each chunk is rematerialised in the backward
(`jax.checkpoint`), so the gradient does not keep it either. Gradients come from JAX's
autodiff: q, k, v and every float array the mods close over (a bias table, ALiBi slopes)
get theirs, closures over traced values included; integer captures get none.

Nothing is skipped: the block tables are a kernel's shortcut, this is the definition
(the mask_mod is evaluated at every element, with the call's own ``b`` and ``h``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array
from jaxtyping import Float, Int

from .._backend import Backend
from ._evaluate import mask_grid, score_grid
from ._request import FlexRequest

__all__ = ["XlaFlexBackend", "xla_flex_attention"]

_F32 = jnp.float32
# The reference's matmul precision (float32 on GPUs and TPUs too, not TF32 / bf16 passes).
_PRECISION = jax.lax.Precision.HIGHEST
# Scores per query chunk (64 MiB of float32): bounds the memory of one step.
MAX_SCORES = 1 << 24


class XlaFlexBackend(Backend):
    """The definition in chunked jnp (`xla_flex_attention`): every mod, every platform."""

    name = "xla"

    def run(self, request: FlexRequest, config: Any, bwd_config: Any) -> Any:
        del config, bwd_config  # no performance knobs
        return xla_flex_attention(request)


def xla_flex_attention(request: FlexRequest, *, max_scores: int = MAX_SCORES) -> Any:
    """``request`` computed in jnp: ``out [B, T, N, Hv]`` or ``(out, lse [B, N, T])``.

    Args:
        request: the checked call.
        max_scores: the most scores one query chunk holds (``B x N x chunk x S``); at
            least one query row runs per chunk.
    """
    q, k, v = (jnp.asarray(x) for x in (request.q, request.k, request.v))
    batch, q_len, kv_len, heads, *_ = request.shape
    if q_len == 0:
        out = jnp.zeros((*q.shape[:3], v.shape[3]), q.dtype)
        lse = jnp.zeros((batch, heads, 0), _F32)
        return (out, lse) if request.return_lse else out
    rows = functools.partial(
        _attend_rows,
        k=k.astype(_F32),
        v=v.astype(_F32),
        scale=request.softmax_scale,
        score_mod=request.score_mod,
        mask_mod=request.mask_mod,
    )
    # Rematerialised in the backward: autodiff would otherwise keep each chunk's scores.
    rows = jax.checkpoint(rows, prevent_cse=False)
    chunk = max(1, min(q_len, max_scores // max(1, batch * heads * kv_len)))
    full = q_len // chunk
    q32 = q.astype(_F32)
    outs, lses = [], []
    if full:
        chunks = q32[:, : full * chunk].reshape(batch, full, chunk, *q.shape[2:])
        starts = jnp.arange(full, dtype=jnp.int32) * chunk
        out, lse = jax.lax.map(lambda xs: rows(*xs), (jnp.swapaxes(chunks, 0, 1), starts))
        outs.append(jnp.swapaxes(out, 0, 1).reshape(batch, full * chunk, *out.shape[3:]))
        lses.append(jnp.moveaxis(lse, 0, 2).reshape(batch, heads, full * chunk))
    if full * chunk < q_len:  # the last, shorter chunk
        out, lse = rows(q32[:, full * chunk :], jnp.int32(full * chunk))
        outs.append(out)
        lses.append(lse)
    out = jnp.concatenate(outs, axis=1).astype(q.dtype)
    lse = jnp.concatenate(lses, axis=2)
    return (out, lse) if request.return_lse else out


def _attend_rows(
    q: Float[Array, "B C N H"],
    start: Int[Array, ""],
    *,
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K Hv"],
    scale: float,
    score_mod: Any,
    mask_mod: Any,
) -> tuple[Float[Array, "B C N Hv"], Float[Array, "B N C"]]:
    """Attention of query rows ``start .. start + C`` against every key, in float32."""
    batch, rows, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    # Query head n reads kv head n // group: split N as (K, group), no copy of k or v.
    qg = q.reshape(batch, rows, kv_heads, group, head_dim)
    s = jnp.einsum("bckgh,bskh->bkgcs", qg, k, precision=_PRECISION) * scale
    s = s.reshape(batch, heads, rows, kv_len)
    b = jnp.arange(batch, dtype=jnp.int32)
    h = jnp.arange(heads, dtype=jnp.int32)
    q_idx = start + jnp.arange(rows, dtype=jnp.int32)
    kv_idx = jnp.arange(kv_len, dtype=jnp.int32)
    visible = None if mask_mod is None else mask_grid(mask_mod, b, h, q_idx, kv_idx)
    if score_mod is not None:
        # Every element, hidden ones too, as a kernel's partial block does: a hidden key's
        # score is replaced by -inf below and gets a zero cotangent.
        s = score_grid(score_mod, s, b, h, q_idx, kv_idx)
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    p, lse = _softmax(s)
    pg = p.reshape(batch, kv_heads, group, rows, kv_len)
    out = jnp.einsum("bkgcs,bskd->bckgd", pg, v, precision=_PRECISION)
    return out.reshape(batch, rows, heads, v.shape[3]), lse


def _softmax(s: Float[Array, "B N C S"]) -> tuple[Float[Array, "B N C S"], Float[Array, "B N C"]]:
    """Softmax over the last axis and its log-normaliser; a row of only ``-inf`` gives zeros
    and lse ``-inf``, with zero (not NaN) gradients.

    The row max is a constant for autodiff (the result does not depend on it); an empty
    row's sum is replaced by 1 before the division and the log, so no ``0/0`` or
    ``log 0`` reaches the gradient.
    """
    m = jnp.max(s, axis=-1, initial=-jnp.inf)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.exp(s - m[..., None])
    total = jnp.sum(e, axis=-1)
    has_mass = total > 0
    safe = jnp.where(has_mass, total, 1.0)
    lse = jnp.where(has_mass, m + jnp.log(safe), -jnp.inf)
    return e / safe[..., None], lse
