"""The flex launches: forward (out, lse) and backward (dq, then dk and dv) over block lists."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from ..build._limits import head_block
from ..build._triton import kernels, launch
from ._config import FlexConfig
from ._plan import ModPlan

__all__ = ["FlexCall", "Tables", "backward", "forward"]

Tables = tuple[Array, Array, Array, Array]
"""One direction's block lists, FlexAttention's layout: (partial counts ``[MB, MN, R]``,
partial indices ``[MB, MN, R, C]``, full counts, full indices)."""


@dataclasses.dataclass(frozen=True)
class FlexCall:
    """The static part of one flex call (a custom VJP's non-differentiated argument).

    Attributes:
        plan: the translated mods.
        scale: the softmax scale.
        block_size: ``(q_block, kv_block)``: the blocks the lists name.
        table_heads: ``(MB, MN)``: the tables' batch rows and heads (1: broadcast).
        fwd_config: the forward's tiles and launch options.
        bwd_config: the dq and dk/dv kernels'.
    """

    plan: ModPlan
    scale: float
    block_size: tuple[int, int]
    table_heads: tuple[int, int]
    fwd_config: FlexConfig
    bwd_config: FlexConfig

    def constexprs(
        self, q: Any, k: Any, v: Any, cfg: FlexConfig, keys_resident: bool
    ) -> dict[str, Any]:
        """Every constexpr of a kernel but the mod functions (`ModPlan.functions`):
        ``cfg``'s resident tile is keys (dk/dv) with ``keys_resident``, else queries."""
        _, q_len, heads, head_dim = q.shape
        kv_len, kv_heads, v_dim = k.shape[1], k.shape[2], v.shape[3]
        q_block, kv_block = self.block_size
        rows, cols = (cfg.block_k, cfg.block_q) if keys_resident else (cfg.block_q, cfg.block_k)
        return dict(
            T=q_len, S=kv_len, N=heads, G=heads // kv_heads, H=head_dim, HV=v_dim,
            SCALE=float(self.scale), MB=self.table_heads[0], MN=self.table_heads[1],
            TB=-(-q_len // q_block), SB=-(-kv_len // kv_block),
            HAS_SCORE=self.plan.score is not None, BLOCK_M=rows, BLOCK_N=cols,
            BLOCK_D=head_block(head_dim), BLOCK_DV=head_block(v_dim), MASK_M=q_block,
            MASK_N=kv_block,
        )  # fmt: skip


def forward(call: FlexCall, q, k, v, ints, floats, kv_tables: Tables) -> tuple[Array, Array]:
    """``(out [B, T, N, Hv], lse [B, N, T])``, the lse float32 in natural units."""
    batch, q_len, heads, _ = q.shape
    cfg = call.fwd_config
    consts = call.constexprs(q, k, v, cfg, keys_resident=False)
    fns = call.plan.functions()
    out, lse = launch(
        kernels().flex_fwd_kernel,
        (-(-q_len // cfg.block_q), batch * heads),
        (q, k, v, ints, floats, *kv_tables),
        (
            jax.ShapeDtypeStruct((batch, q_len, heads, v.shape[3]), q.dtype),
            jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32),
        ),
        dict(consts, SCORE_FN=fns["SCORE_FN"], MASK_FN=fns["MASK_FN"]),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, lse


def backward(
    call: FlexCall, q, k, v, ints, floats, kv_tables: Tables, q_tables: Tables, lse, d_out, delta
) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)``; ``delta`` is ``rowsum(dO ∘ O) - d_lse`` ``[B, N, T]`` (float32)."""
    batch, q_len, heads, _ = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    cfg = call.bwd_config
    fns = call.plan.functions()
    inputs = (q, k, v, d_out.astype(q.dtype), lse, delta, ints, floats)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    (dq,) = launch(
        kernels().flex_dq_kernel,
        (-(-q_len // cfg.block_q), batch * heads),
        (*inputs, *kv_tables),
        (jax.ShapeDtypeStruct(q.shape, q.dtype),),
        dict(call.constexprs(q, k, v, cfg, keys_resident=False), **fns),
        **options,
    )
    dk, dv = launch(
        kernels().flex_dkdv_kernel,
        (-(-kv_len // cfg.block_q), batch * kv_heads),
        (*inputs, *q_tables),
        (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        dict(call.constexprs(q, k, v, cfg, keys_resident=True), **fns),
        **options,
    )
    return dq, dk, dv
