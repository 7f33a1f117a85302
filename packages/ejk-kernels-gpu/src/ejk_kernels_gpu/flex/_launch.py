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
        block_size: ``(q_block, kv_block)``: the tables' blocks, the kernels' tiles.
        table_heads: ``(MB, MN)``: the tables' batch rows and heads (1: broadcast).
        config: launch options.
    """

    plan: ModPlan
    scale: float
    block_size: tuple[int, int]
    table_heads: tuple[int, int]
    config: FlexConfig

    def constexprs(self, q: Any, k: Any, v: Any, functions: tuple[str, ...]) -> dict[str, Any]:
        _, q_len, heads, head_dim = q.shape
        kv_len, kv_heads, v_dim = k.shape[1], k.shape[2], v.shape[3]
        q_block, kv_block = self.block_size
        score_fn, dscore_fn, mask_fn = self.plan.functions()
        named = {"SCORE_FN": score_fn, "DSCORE_FN": dscore_fn, "MASK_FN": mask_fn}
        return dict(
            T=q_len, S=kv_len, N=heads, G=heads // kv_heads, H=head_dim, HV=v_dim,
            SCALE=float(self.scale), MB=self.table_heads[0], MN=self.table_heads[1],
            TB=-(-q_len // q_block), SB=-(-kv_len // kv_block),
            HAS_SCORE=self.plan.score is not None, BLOCK_M=q_block, BLOCK_N=kv_block,
            BLOCK_D=head_block(head_dim), BLOCK_DV=head_block(v_dim),
            **{name: named[name] for name in functions},
        )  # fmt: skip


def forward(call: FlexCall, q, k, v, ints, floats, kv_tables: Tables) -> tuple[Array, Array]:
    """``(out [B, T, N, Hv], lse [B, N, T])``, the lse float32 in natural units."""
    batch, q_len, heads, _ = q.shape
    consts = call.constexprs(q, k, v, ("SCORE_FN", "MASK_FN"))
    out, lse = launch(
        kernels().flex_fwd_kernel,
        (consts["TB"], batch * heads),
        (q, k, v, ints, floats, *kv_tables),
        (
            jax.ShapeDtypeStruct((batch, q_len, heads, v.shape[3]), q.dtype),
            jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32),
        ),
        consts,
        num_warps=call.config.num_warps,
        num_stages=call.config.num_stages,
    )
    return out, lse


def backward(
    call: FlexCall, q, k, v, ints, floats, kv_tables: Tables, q_tables: Tables, lse, d_out, delta
) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)``; ``delta`` is ``rowsum(dO ∘ O) - d_lse`` ``[B, N, T]`` (float32)."""
    batch, _, heads, _ = q.shape
    kv_heads = k.shape[2]
    consts = call.constexprs(q, k, v, ("SCORE_FN", "DSCORE_FN", "MASK_FN"))
    inputs = (q, k, v, d_out.astype(q.dtype), lse, delta, ints, floats)
    options = dict(num_warps=call.config.num_warps, num_stages=call.config.num_stages)
    (dq,) = launch(
        kernels().flex_dq_kernel,
        (consts["TB"], batch * heads),
        (*inputs, *kv_tables),
        (jax.ShapeDtypeStruct(q.shape, q.dtype),),
        consts,
        **options,
    )
    dk, dv = launch(
        kernels().flex_dkdv_kernel,
        (consts["SB"], batch * kv_heads),
        (*inputs, *q_tables),
        (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        consts,
        **options,
    )
    return dq, dk, dv
