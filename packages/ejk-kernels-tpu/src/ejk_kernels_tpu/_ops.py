"""`blocksparse_attention`: validation, padding, layout and the custom_vjp over the three kernels."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float, Int, Integer

from ._backward import dkv as _dkv_kernel
from ._backward import dq as _dq_kernel
from ._common import Static, tiles_of
from ._config import BlockSparseConfig, block_sparse_heuristic, effective_block
from ._forward import forward as _forward_kernel
from ._mask_info import (
    MaskInfo,
    process_dynamic_mask,
    process_dynamic_mask_dkv,
    process_mask,
    process_mask_dkv,
)
from ._masks import Mask, MultiHeadMask, pad_mask

__all__ = ["blocksparse_attention", "default_interpret"]


def default_interpret() -> Any:
    """False on a TPU backend, else Pallas' TPU interpreter (`pltpu.InterpretParams()`)."""
    return False if jax.default_backend() == "tpu" else pltpu.InterpretParams()


@functools.lru_cache(maxsize=32)
def _static_info(mask: Mask, block: tuple[int, int], is_dkv: bool) -> MaskInfo:
    proc = process_mask_dkv if is_dkv else process_mask
    return proc(mask, block, shrink_grid=True)


def _tables(mask: Any, block: tuple[int, int], is_dkv: bool) -> tuple[jax.Array, ...]:
    """(data_next, mask_next, block_mask, int8 tiles) of a padded static or dynamic mask.

    Passed to the custom_vjp as (integer, gradient-free) arrays, so static and traced masks
    take one path; a static mask's tables are constants, computed once per (mask, block).
    """
    if isinstance(mask, Mask):
        info = _static_info(mask, block, is_dkv)
    else:
        info = (process_dynamic_mask_dkv if is_dkv else process_dynamic_mask)(mask, block)
    tile_shape = block[::-1] if is_dkv else block
    return (*(jnp.asarray(x) for x in info[:3]), tiles_of(info, tile_shape))


def _info(tables: tuple[jax.Array, ...]) -> MaskInfo:
    return MaskInfo(*tables, None, False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _attention(q, k, v, q_seg, kv_seg, sinks, seed, tables, st: Static):
    return _forward_kernel(q, k, v, q_seg, kv_seg, sinks, seed, _info(tables[0]), st)


def _attention_fwd(q, k, v, q_seg, kv_seg, sinks, seed, tables, st: Static):
    o, lse = _attention(q, k, v, q_seg, kv_seg, sinks, seed, tables, st)
    return (o, lse), (q, k, v, q_seg, kv_seg, sinks, seed, tables, o, lse)


def _attention_bwd(st: Static, res, cts):
    q, k, v, q_seg, kv_seg, sinks, seed, tables, o, lse = res
    do, dlse = cts
    # D_i = rowsum(dO * O) (FlashAttention-2, Alg. 2, line 4), less the lse cotangent:
    # d lse_i / d s_ij = P_ij, so dS_ij = P_ij (dP_ij - D_i + dlse_i).
    di = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True) - dlse
    lse_b = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # rows that see nothing: P = exp(-inf) = 0
    dq = _dq_kernel(q, k, v, do, lse_b, di, q_seg, kv_seg, seed, _info(tables[1]), st)
    batch, heads, q_len, _ = q.shape
    as_row = lambda x: x.reshape(batch, heads, 1, q_len)
    dk, dv = _dkv_kernel(
        q,
        k,
        v,
        do,
        as_row(lse_b),
        as_row(di),
        None if q_seg is None else q_seg.reshape(batch, 1, q_len),
        None if kv_seg is None else kv_seg.reshape(batch, -1, 1),
        seed,
        _info(tables[2]),
        st,
    )
    dsinks = None
    if sinks is not None:
        # The sink's weight in row i is exp(sink - lse_i); d out_i / d sink = -weight * out_i.
        weight = jnp.exp(sinks[None, :, None] - lse[..., 0])
        dsinks = -jnp.sum(weight * di[..., 0], axis=(0, 2)).astype(sinks.dtype)
    return dq, dk, dv, None, None, dsinks, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _dropout_seed(rate: float, seed: Any) -> jax.Array | None:
    """The seed as int32 ``[1]`` holding its uint32 bits, or None without dropout."""
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {rate=!r}")
    if rate == 0.0:
        return None
    if seed is None:
        raise ValueError(f"dropout_seed is required when dropout_rate={rate} > 0")
    if isinstance(seed, bool):
        raise TypeError(f"dropout_seed must be an int or a uint32/int32 scalar, got {seed!r}")
    if isinstance(seed, int):
        return jnp.asarray([np.uint32(seed & 0xFFFFFFFF).view(np.int32)])
    seed = jnp.asarray(seed)
    if seed.shape != ():
        raise ValueError(f"dropout_seed must be a scalar, got shape {seed.shape}")
    if seed.dtype == jnp.uint32:
        seed = jax.lax.bitcast_convert_type(seed, jnp.int32)
    elif seed.dtype != jnp.int32:
        raise TypeError(
            f"dropout_seed must be an int or a uint32/int32 scalar, got dtype {seed.dtype}"
        )
    return seed.reshape(1)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _check_inputs(q, k, v, mask, segment_ids, softmax_sinks, logits_soft_cap):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k, v must be rank 4 [B, T, N, H]; got {q.shape}, {k.shape}, {v.shape}"
        )
    batch, q_len, heads, head_dim = q.shape
    kv_batch, kv_len, kv_heads, _ = k.shape
    if kv_batch != batch or k.shape[0] != v.shape[0]:
        raise ValueError(f"batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on [B, S, K]; got {k.shape} and {v.shape}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k head_dim must equal q's {head_dim=}, got k shape {k.shape}")
    if v.shape[3] != head_dim:
        raise NotImplementedError(
            f"blocksparse_attention needs v head_dim == {head_dim=}, got {v.shape}"
        )
    if heads % kv_heads:
        raise ValueError(f"{heads=} of q must be a multiple of {kv_heads=} of k and v")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not isinstance(mask, Mask):
        if not (hasattr(mask, "shape") and hasattr(mask, "dtype")):
            raise TypeError(
                f"mask must be a Mask, a MultiHeadMask or a bool array, got {type(mask).__name__}"
            )
        if mask.dtype != jnp.bool_:
            raise TypeError(f"an array mask must have dtype bool, got {mask.dtype}")
        shape = tuple(mask.shape)
        if (
            shape[-2:] != (q_len, kv_len)
            or len(shape) not in (2, 3)
            or (len(shape) == 3 and shape[0] not in (1, heads))
        ):
            raise ValueError(
                f"an array mask must be [{q_len=}, {kv_len=}] or [1 or {heads=}, T, S], got {shape}"
            )
    elif isinstance(mask, MultiHeadMask):
        if mask.shape[0] not in (1, heads) or mask.shape[1:] != (q_len, kv_len):
            raise ValueError(
                f"MultiHeadMask shape {mask.shape} must be (1 or {heads=}, {q_len=}, {kv_len=})"
            )
    elif mask.shape != (q_len, kv_len):
        raise ValueError(f"mask shape {mask.shape} must be ({q_len=}, {kv_len=})")
    if segment_ids is not None:
        if isinstance(segment_ids, tuple | list):
            q_ids, kv_ids = segment_ids
        else:
            if q_len != kv_len:
                raise ValueError(
                    f"a single segment_ids array needs q_len == kv_len, got {q_len=}, {kv_len=}; "
                    "pass (q_ids, kv_ids)"
                )
            q_ids = kv_ids = segment_ids
        if jnp.shape(q_ids) != (batch, q_len) or jnp.shape(kv_ids) != (batch, kv_len):
            raise ValueError(
                f"segment_ids must be [B, T] = {(batch, q_len)} and [B, S] = {(batch, kv_len)}, "
                f"got {jnp.shape(q_ids)} and {jnp.shape(kv_ids)}"
            )
    if softmax_sinks is not None and jnp.shape(softmax_sinks) != (heads,):
        raise ValueError(f"softmax_sinks must be [N] = ({heads},), got {jnp.shape(softmax_sinks)}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap=}")


def blocksparse_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    mask: Mask | Bool[Array, "T S"] | Bool[Array, "#N T S"],
    *,
    segment_ids: Int[Array, "B T"] | tuple[Int[Array, "B T"], Int[Array, "B S"]] | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    softmax_sinks: Float[Array, " N"] | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: int | Integer[Array, ""] | None = None,
    return_lse: bool = False,
    config: BlockSparseConfig | None = None,
    interpret: Any = None,
) -> Float[Array, "B T N H"] | tuple[Float[Array, "B T N H"], Float[Array, "B N T"]]:
    """Block-sparse attention on TPU (Pallas), differentiable in q, k, v and the sinks.

    Blocks the mask leaves empty are skipped (no copy, no compute); full blocks skip mask
    evaluation. Off TPU the same kernels run in Pallas' TPU interpreter.

    Args:
        q: queries ``[B, T, N, H]``.
        k, v: keys and values ``[B, S, K, H]``, ``N % K == 0`` (GQA/MQA).
        mask: a `Mask` of shape ``(T, S)`` for every head, a `MultiHeadMask` ``(N, T, S)``,
            or a (possibly traced) bool array ``[T, S]`` / ``[1 or N, T, S]``. A static mask
            stores each distinct partial tile once; an array mask keeps every tile
            (`process_dynamic_mask`) but still skips its empty blocks.
        segment_ids: int ``[B, T]`` (needs T == S) or ``(q_ids [B, T], kv_ids [B, S])``;
            a query sees a key only when the ids are equal and >= 0 (negative ids are padding).
        softmax_scale: multiplies ``q·kᵀ``; default ``H ** -0.5``.
        logits_soft_cap: ``cap * tanh(logits / cap)``.
        softmax_sinks: ``[N]`` one logit per query head, in the softmax denominator only.
        dropout_rate: probability in ``[0, 1)`` of dropping a normalised weight (kept ones are
            scaled by ``1 / (1 - rate)``); the keep mask is ejk's counter hash of
            (seed, batch, query head, row, column), identical in every backend.
        dropout_seed: a Python int or a uint32/int32 scalar; required when dropout_rate > 0.
        return_lse: also return the float32 log-sum-exp ``[B, N, T]`` (dropout leaves it alone).
        config: block sizes; default `block_sparse_heuristic`.
        interpret: False to compile for TPU, or `pltpu.InterpretParams`; default: interpret
            unless the default backend is a TPU.

    Returns:
        ``out [B, T, N, H]`` in q's dtype, and with ``return_lse`` ``(out, lse [B, N, T])``.
        A query row that sees no key gives zeros (lse -inf, or the sink's logit).
    """
    _check_inputs(q, k, v, mask, segment_ids, softmax_sinks, logits_soft_cap)
    seed = _dropout_seed(dropout_rate, dropout_seed)
    _, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    if config is None:
        config = block_sparse_heuristic(q_len, kv_len, head_dim, q.dtype.itemsize)
    elif not isinstance(config, BlockSparseConfig):
        raise TypeError(f"config must be a BlockSparseConfig, got {type(config).__name__}")
    fq = lambda b: effective_block(b, q_len)
    fk = lambda b: effective_block(b, kv_len)
    fwd = (fq(config.block_q), fk(config.block_kv))
    dq = (fq(config.block_q_dq), fk(config.block_kv_dq))
    dkv = (fq(config.block_q_dkv), fk(config.block_kv_dkv))
    # Pad to whole blocks of every kernel (all block sizes are powers of two).
    t_pad = _round_up(q_len, max(fwd[0], dq[0], dkv[0]))
    s_pad = _round_up(kv_len, max(fwd[1], dq[1], dkv[1]))
    if isinstance(mask, Mask):
        mask = pad_mask(mask, t_pad, s_pad)
    else:
        mask = jnp.asarray(mask, bool)
        mask = mask[None] if mask.ndim == 2 else mask
        mask = jnp.pad(mask, ((0, 0), (0, t_pad - q_len), (0, s_pad - kv_len)))
    tables = (
        _tables(mask, fwd, False),
        _tables(mask, dq, False),
        _tables(mask, dkv, True),
    )
    interpret = default_interpret() if interpret is None else interpret
    if interpret is False and q.dtype == jnp.float16:
        # Mosaic has no float16 matmul path (the deviceless v6e compile fails).
        raise NotImplementedError(
            "blocksparse_attention on TPU takes float32 or bfloat16, got float16"
        )
    st = Static(
        heads=heads,
        kv_heads=kv_heads,
        fwd=fwd,
        dq=dq,
        dkv=dkv,
        scale=float(head_dim**-0.5 if softmax_scale is None else softmax_scale),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        has_segments=segment_ids is not None,
        has_sinks=softmax_sinks is not None,
        interpret=interpret,
        dropout_rate=float(dropout_rate),
    )

    def to_kernel(x, length):
        x = jnp.swapaxes(x, 1, 2)  # [B, heads, seq, H]
        return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))

    q_seg = kv_seg = None
    if segment_ids is not None:
        q_ids, kv_ids = segment_ids if isinstance(segment_ids, tuple | list) else (segment_ids,) * 2
        # Padding positions get id -1: they see nothing and are seen by nothing.
        q_seg = jnp.pad(
            jnp.asarray(q_ids, jnp.int32), ((0, 0), (0, t_pad - q_len)), constant_values=-1
        )[..., None]
        kv_seg = jnp.pad(
            jnp.asarray(kv_ids, jnp.int32), ((0, 0), (0, s_pad - kv_len)), constant_values=-1
        )[:, None, :]
    sinks = None if softmax_sinks is None else jnp.asarray(softmax_sinks, jnp.float32)
    o, lse = _attention(
        to_kernel(q, t_pad),
        to_kernel(k, s_pad),
        to_kernel(v, s_pad),
        q_seg,
        kv_seg,
        sinks,
        seed,
        tables,
        st,
    )
    out = jnp.swapaxes(o[:, :, :q_len], 1, 2)
    return (out, lse[:, :, :q_len, 0]) if return_lse else out
