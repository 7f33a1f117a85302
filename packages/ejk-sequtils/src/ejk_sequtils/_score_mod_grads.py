"""Cotangents of the float arrays a flex score_mod captures, in XLA from the forward's lse.

Every flex kernel (Triton on GPU, Pallas on TPU) differentiates q, k and v itself; the
arrays a score_mod closes over (ALiBi slopes, a relative-position table) get theirs here,
once for every backend. For each element the score_mod sees, its output's cotangent is
``dS = P ∘ (dP - delta)`` (FlashAttention-2, Alg. 2, before the chain rule through the
mod), so a capture's cotangent is the sum over elements of ``dS`` pulled back through the
score_mod (`jax.vjp` with respect to the captures). The scores are recomputed one chunk
of query rows at a time (a scan, the cotangents summed in its carry), so ``[B, N, T, S]``
is never held; under ``jax.jit`` XLA drops the pass when the cotangents are not used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array
from jaxtyping import Float

__all__ = ["score_mod_capture_cotangents"]

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
# Scores per chunk of query rows (64 MiB of float32).
MAX_SCORES = 1 << 24


def score_mod_capture_cotangents(
    score_fn: Callable[..., Any],
    captures: Sequence[Any],
    mask_fn: Callable[..., Any] | None,
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K Hv"],
    lse: Float[Array, "B N T"],
    d_out: Float[Array, "B T N Hv"],
    delta: Float[Array, "B N T"],
    *,
    scale: float,
    max_scores: int = MAX_SCORES,
) -> list[Any]:
    """Per capture of the score_mod: its cotangent (floating captures) or None (others).

    Args:
        score_fn: ``score_fn(captures, score, b, h, q_idx, kv_idx)`` on scalars (a float32
            score, int32 indices, ``h`` the query head): the score_mod with its captured
            arrays as an argument.
        captures: the arrays ``score_fn`` takes (the score_mod's closure).
        mask_fn: ``mask_fn(b, h, q_idx, kv_idx) -> bool`` on int32 scalars, or None (every
            key visible); it gets no cotangent.
        q, k, v: the call's inputs (GQA: ``N % K == 0``, query head n reads kv head
            ``n // (N // K)``).
        lse: the forward's float32 log-sum-exp; ``-inf`` on a row that sees nothing.
        d_out: the output's cotangent.
        delta: ``rowsum(dO ∘ O) - d_lse`` (float32).
        scale: the softmax scale (``s = scale · q·k`` is what the score_mod sees).
        max_scores: the most scores one chunk of query rows holds.
    """
    floating = [jnp.issubdtype(jnp.result_type(c), jnp.floating) for c in captures]
    if not any(floating):
        return [None] * len(captures)
    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    chunk = max(1, min(q_len, max_scores // max(1, batch * heads * kv_len)))
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
    wanted = [c for c, f in zip(captures, floating, strict=True) if f]

    def step(acc: list[Any], x: Any) -> tuple[list[Any], None]:
        qc, doc, lsec, deltac, start = x
        q_idx = (start + jnp.arange(chunk, dtype=jnp.int32))[None, None, :, None]
        qg = qc.reshape(batch, chunk, kv_heads, group, head_dim)
        raw = jnp.einsum("bckgh,bskh->bkgcs", qg, k32, precision=_HIGHEST) * scale
        raw = raw.reshape(batch, heads, chunk, kv_len)

        def modded(float_caps: list[Any]) -> Any:
            it = iter(float_caps)
            caps = [next(it) if f else c for c, f in zip(captures, floating, strict=True)]
            return jnp.vectorize(lambda *xs: score_fn(caps, *xs))(raw, b, h, q_idx, kv_idx)

        s, pull = jax.vjp(modded, wanted)
        visible = (q_idx < q_len) & jnp.isfinite(lsec)[..., None]
        if mask_fn is not None:
            visible = visible & jnp.vectorize(mask_fn)(b, h, q_idx, kv_idx)
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
            for c, f in zip(captures, floating, strict=True)]  # fmt: skip
