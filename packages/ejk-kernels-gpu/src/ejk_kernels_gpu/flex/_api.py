"""The public entry: `flex_attention` over block lists, and `unsupported_flex_reason`.

ejk-attention's `BlockMask` stays there (this package imports nothing above it): the
facade passes the mods and the mask's block lists as plain arrays.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import Array
from jaxtyping import Float

from ..build._triton import gpu_available
from ._config import FlexConfig, bwd_heuristic, check_tiles, fwd_heuristic
from ._launch import FlexCall, Tables
from ._plan import ModPlan, Unsupported, plan_mods
from ._vjp import flex_vjp

__all__ = [
    "default_block_size",
    "flex_attention",
    "full_tables",
    "planned_flex_attention",
    "unsupported_flex_reason",
]

_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
_MAX_HEAD_DIM = 256


def default_block_size(q_len: int, kv_len: int) -> tuple[int, int]:
    """The tiles of a call without a block mask: 128, or the power of two (>= 16) covering a
    shorter length."""
    tile = lambda n: min(128, max(16, 1 << max(0, n - 1).bit_length()))
    return tile(q_len), tile(kv_len)


def full_tables(mask_heads: tuple[int, int], rows: int, cols: int) -> Tables:
    """Block lists in which every block is full: what a call without a mask visits."""
    mb, mn = mask_heads
    zeros = jnp.zeros((mb, mn, rows), jnp.int32)
    indices = jnp.broadcast_to(jnp.arange(cols, dtype=jnp.int32), (mb, mn, rows, cols))
    return zeros, indices, zeros + cols, indices


def _block_reason(block_size: tuple[int, int]) -> str | None:
    for name, size in zip(("q_block", "kv_block"), block_size, strict=True):
        if size < 16 or size > 256 or size & (size - 1):
            return (
                f"the Triton flex kernels walk the block mask's blocks in tiles that divide "
                f"them: block sizes must be powers of two in [16, 256], got {name}={size} "
                f"(block_size={block_size})"
            )
    return None


def unsupported_flex_reason(
    q: Any,
    k: Any,
    v: Any,
    score_mod: Callable[..., Any] | None,
    mask_mod: Callable[..., Any] | None,
    block_size: tuple[int, int],
) -> str | None:
    """Why the Triton flex kernels cannot serve a valid call, or None if they can.

    Args:
        q, k, v: the call's arrays (checked already: ``[B, T, N, H]``, ``N % K == 0``).
        score_mod, mask_mod: the mods (None: none).
        block_size: the block mask's ``(q_block, kv_block)`` (the kernels' tiles divide it).

    Returns:
        A sentence naming what is unsupported (a dtype, a head dim, a block size, a
        primitive of a mod without a Triton translation, no way to run Triton), or None.
    """
    if q.dtype not in _DTYPES:
        return f"the Triton flex kernels take float16, bfloat16 or float32, got {q.dtype=}"
    if max(q.shape[3], v.shape[3]) > _MAX_HEAD_DIM:
        return f"the Triton flex kernels take head dims <= 256, got q {q.shape}, v {v.shape}"
    reason = _block_reason(block_size)
    if reason is not None:
        return reason
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if not gpu_available() and not interpret and "triton" in sys.modules:
        return (
            "no GPU, and Triton was imported without its interpreter (set TRITON_INTERPRET=1 "
            "before importing triton to run the kernels interpreted)"
        )
    try:
        plan_mods(score_mod, mask_mod)
    except Unsupported as err:
        return f"the Triton flex kernels cannot run this mod: {err}"
    return None


def flex_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K Hv"],
    *,
    score_mod: Callable[..., Any] | None,
    mask_mod: Callable[..., Any] | None,
    kv_blocks: Tables | None,
    q_blocks: Tables | None,
    block_size: tuple[int, int],
    softmax_scale: float,
    return_lse: bool = False,
    config: FlexConfig | None = None,
    bwd_config: FlexConfig | None = None,
) -> Any:
    """Flex attention in Triton: ``score_mod`` and ``mask_mod`` compiled into the kernels.

    ``s = softmax_scale·q·kᵀ``, then ``score_mod(s, b, h, q_idx, kv_idx)``, then -inf
    where ``mask_mod(b, h, q_idx, kv_idx)`` is False, and a softmax over the keys; a row
    with no visible key gives zeros (lse -inf) and zero gradients. Only the blocks the
    lists name are visited: the mask_mod runs on partial blocks, never on full ones.
    Gradients: q, k, v (Triton), and the score_mod's floating captures (XLA:
    `ejk_sequtils.score_mod_capture_cotangents`).

    Args:
        q: queries ``[B, T, N, H]``; k: keys ``[B, S, K, H]`` (``N % K == 0``); v: values
            ``[B, S, K, Hv]``; one dtype (float16, bfloat16, float32).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx)`` or None.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` or None (with None lists).
        kv_blocks: per query block, the key blocks to visit (partial and full apart, as
            `ejk_attention.BlockMask.kv_blocks`), ``[MB, MN, ceil(T / q_block), ...]`` with
            ``MB`` 1 or B and ``MN`` 1 or N; None: every block full.
        q_blocks: the transposed lists (per key block, the query blocks), None with
            ``kv_blocks``.
        block_size: ``(q_block, kv_block)`` of the lists (the kernels' tiles divide them).
        softmax_scale: multiplies ``q·kᵀ``.
        return_lse: also return the float32 lse ``[B, N, T]``.
        config: the forward's tiles and launch options; default `fwd_heuristic`.
        bwd_config: the dq and dk/dv kernels'; default `bwd_heuristic`.

    Returns:
        ``out [B, T, N, Hv]`` in q's dtype, or ``(out, lse)``.

    Raises:
        NotImplementedError: `unsupported_flex_reason` (a mod's primitive named).
        TypeError: a config that is not a `FlexConfig` (``config``/``bwd_config`` named).
        ValueError: a config whose tiles do not divide the blocks (`check_tiles`, naming it).
    """
    reason = unsupported_flex_reason(q, k, v, score_mod, mask_mod, block_size)
    if reason is not None:
        raise NotImplementedError(reason)
    plan, consts = plan_mods(score_mod, mask_mod)
    n_score = plan.score_captures
    return planned_flex_attention(
        q, k, v, list(consts[:n_score]), list(consts[n_score:]), kv_blocks, q_blocks,
        plan=plan, block_size=block_size, softmax_scale=softmax_scale,
        return_lse=return_lse, config=config, bwd_config=bwd_config,
    )  # fmt: skip


def planned_flex_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K Hv"],
    score_caps: list[Any],
    mask_caps: list[Any],
    kv_blocks: Tables | None,
    q_blocks: Tables | None,
    *,
    plan: ModPlan,
    config: FlexConfig | None,
    bwd_config: FlexConfig | None,
    block_size: tuple[int, int],
    softmax_scale: float,
    return_lse: bool,
) -> Any:
    """`flex_attention` with the mods translated already: ``plan`` and the arrays they capture
    (``score_caps``, then ``mask_caps``, as `plan_mods` returns them), so the executor's
    kernels (`flex._executor`) take the captures as arrays (stand-ins when tuning inside
    ``jit``) and the plan as a static argument. The call is supported (checked by the
    caller); the configs are checked here.

    Raises:
        TypeError: a config that is not a `FlexConfig`.
        ValueError: a config whose tiles do not divide the blocks (`check_tiles`).
    """
    for name, cfg in (("config", config), ("bwd_config", bwd_config)):
        if cfg is not None and not isinstance(cfg, FlexConfig):
            raise TypeError(f"{name} must be a FlexConfig or None, got {cfg!r}")
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    batch, q_len, heads, _ = q.shape
    kv_len = k.shape[1]
    head_dim = max(q.shape[3], v.shape[3])
    itemsize = q.dtype.itemsize
    fwd = config or fwd_heuristic(block_size, head_dim, itemsize)
    bwd = bwd_config or bwd_heuristic(block_size, head_dim, itemsize)
    check_tiles(fwd, block_size, "forward")
    check_tiles(bwd, block_size, "backward")
    if batch * q_len * kv_len == 0:
        out = jnp.zeros((*q.shape[:3], v.shape[3]), q.dtype)
        lse = jnp.full((batch, heads, q_len), -jnp.inf, jnp.float32)
        return (out, lse) if return_lse else out
    q_block, kv_block = block_size
    rows, cols = -(-q_len // q_block), -(-kv_len // kv_block)
    if kv_blocks is None or q_blocks is None:
        kv_blocks, q_blocks = full_tables((1, 1), rows, cols), full_tables((1, 1), cols, rows)
    kv_blocks = tuple(jnp.asarray(x, jnp.int32) for x in kv_blocks)
    q_blocks = tuple(jnp.asarray(x, jnp.int32) for x in q_blocks)
    mask_heads = (int(kv_blocks[0].shape[0]), int(kv_blocks[0].shape[1]))
    if kv_blocks[0].shape[2] != rows or q_blocks[0].shape[2] != cols:
        raise ValueError(
            f"kv_blocks and q_blocks must list {rows} query blocks and {cols} key blocks of "
            f"{block_size}, got {kv_blocks[0].shape} and {q_blocks[0].shape}"
        )
    call = FlexCall(plan, float(softmax_scale), (q_block, kv_block), mask_heads, fwd, bwd)
    out, lse = flex_vjp(call, q, k, v, score_caps, mask_caps, kv_blocks, q_blocks)
    return (out, lse) if return_lse else out
