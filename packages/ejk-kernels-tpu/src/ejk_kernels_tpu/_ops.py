"""`blocksparse_attention`: validation, padding, layout and the custom_vjp over the three kernels.

`blocksparse_attention` validates through `ejk_sequtils.validate_attention`;
`blocksparse_attention_request` takes the validated `AttentionRequest` (the facade's entry).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.extend import core as jcore
from jaxtyping import Array, Bool, Float, Int, Integer

from ejk_sequtils import (
    AttentionRequest,
    dropout_key,
    reference_attention,
    score_mod_capture_cotangents,
    validate_attention,
)

from ._backward import dkv as _dkv_kernel
from ._backward import dq as _dq_kernel
from ._common import Static, tiles_of
from ._config import BlockSparseConfig, block_sparse_heuristic, effective_block
from ._forward import forward as _forward_kernel
from ._mask_info import MaskInfo, check_mask, process_dynamic_mask
from ._mask_info import _process as _process_static
from ._masks import (
    FullMask,
    Mask,
    MultiHeadMask,
    NumpyMask,
    attention_mask,
    pad_mask,
    stored_tiles,
)

__all__ = [
    "blocksparse_attention",
    "blocksparse_attention_request",
    "default_interpret",
    "unsupported_reason",
]


def default_interpret() -> Any:
    """False on a TPU backend, else Pallas' TPU interpreter (`pltpu.InterpretParams()`)."""
    return False if jax.default_backend() == "tpu" else pltpu.InterpretParams()


@functools.lru_cache(maxsize=32)
def _static_info(mask: Mask, block: tuple[int, int], is_dkv: bool) -> tuple[MaskInfo, Any]:
    # Every mask's grid shrinks here (splash shrinks only one shared by all heads): a
    # per-head table row walks only its own non-empty blocks.
    return _process_static(
        mask,
        block,
        is_dkv=is_dkv,
        downcast_smem_data=True,
        head_shards=1,
        q_seq_shards=1,
        shrink_grid=True,
        shrink_any_mask=True,
    )


def _tables(
    mask: Any, block: tuple[int, int], is_dkv: bool, tiles: bool
) -> tuple[tuple[Any, ...], Any]:
    """The kernel tables of a padded static or dynamic mask, and its mask function or None.

    The tables (data_next, mask_next, block_mask, int8 tiles, and None for q_sequence; None
    where the kernels need no such input) go to the custom_vjp as (integer, gradient-free) arrays, so
    static and traced masks take one path; a static mask's tables are constants, computed
    once per (mask, block). ``tiles``: store partial tiles even for a computable mask.
    """
    if isinstance(mask, Mask):
        info, mask_fn = _static_info(mask, block, is_dkv)
        if tiles and mask_fn is not None:
            info, mask_fn = _static_info(stored_tiles(mask), block, is_dkv)
    else:
        info, mask_fn = process_dynamic_mask(mask, block, is_dkv=is_dkv)
    if info.q_sequence is not None and not np.array_equal(
        info.q_sequence, np.arange(mask.shape[-2])
    ):
        # The kernels take a query's position from the grid, so q_sequence must be arange(T).
        raise NotImplementedError(
            "the block-sparse kernels evaluate a mask function at query positions arange(T); "
            f"this mask's q_sequence differs (starts {info.q_sequence[:4]})"
        )
    arrays = (info.data_next, info.mask_next, info.block_mask)
    # q_sequence is arange(T): the kernels take it from the grid, so it is not passed.
    return (*(None if x is None else jnp.asarray(x) for x in arrays), tiles_of(info), None), mask_fn


def _info(tables: tuple[jax.Array | None, ...]) -> MaskInfo:
    return MaskInfo(*tables, False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _attention(q, k, v, q_seg, kv_seg, sinks, seed, tables, score_caps, st: Static):
    """``(out, lse)`` in kernel layout.

    ``tables`` = (forward, dq, dkv tables, the mask_mod's features, the mask_mod's captured
    arrays): gradient-free inputs of the kernels. ``score_caps``: the arrays the flex
    score_mod (``st.score_mod``) captures; its features are computed from them here, and
    the floating ones get cotangents (`_score_cotangents`).
    """
    features = _features(tables, score_caps, st, q, k)
    return _forward_kernel(q, k, v, q_seg, kv_seg, sinks, seed, _info(tables[0]), st, features)


def _features(tables, score_caps, st: Static, q, k) -> tuple[jax.Array, ...]:
    """The kernels' feature inputs: the mask_mod's, then the score_mod's (`mod_inputs`)."""
    if st.score_mod is None:
        return tables[3]
    padded = (q.shape[2], k.shape[2])
    scores = st.score_mod.feature_arrays(score_caps, q.shape[0], st.heads, *st.lengths, *padded)
    return (*tables[3], *scores)


def _attention_fwd(q, k, v, q_seg, kv_seg, sinks, seed, tables, score_caps, st: Static):
    o, lse = _attention(q, k, v, q_seg, kv_seg, sinks, seed, tables, score_caps, st)
    return (o, lse), (q, k, v, q_seg, kv_seg, sinks, seed, tables, score_caps, o, lse)


def _attention_bwd(st: Static, res, cts):
    q, k, v, q_seg, kv_seg, sinks, seed, tables, score_caps, o, lse = res
    do, dlse = cts
    # D_i = rowsum(dO * O) (FlashAttention-2, Alg. 2, line 4), less the lse cotangent:
    # d lse_i / d s_ij = P_ij, so dS_ij = P_ij (dP_ij - D_i + dlse_i).
    di = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True) - dlse
    lse_b = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # rows that see nothing: P = exp(-inf) = 0
    features = _features(tables, score_caps, st, q, k)
    dq = _dq_kernel(q, k, v, do, lse_b, di, q_seg, kv_seg, seed, _info(tables[1]), st, features)
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
        features,
    )
    dsinks = None
    if sinks is not None:
        # The sink's weight in row i is exp(sink - lse_i); d out_i / d sink = -weight * out_i.
        weight = jnp.exp(sinks[None, :, None] - lse[..., 0])
        dsinks = -jnp.sum(weight * di[..., 0], axis=(0, 2)).astype(sinks.dtype)
    d_caps = _score_cotangents(st, q, k, v, do, lse, di, tables[4], score_caps)
    return dq, dk, dv, None, None, dsinks, None, None, d_caps


def _score_cotangents(st: Static, q, k, v, do, lse, di, mask_caps, score_caps) -> list[Any] | None:
    """The score_mod's captures' cotangents (None for integer ones), from the chunked XLA pass
    every flex kernel shares (`ejk_sequtils.score_mod_capture_cotangents`), on the unpadded
    call in ``[B, T, N, H]`` layout."""
    if st.score_mod is None:
        return None
    q_len, kv_len = st.lengths
    unpad = lambda x, n: jnp.swapaxes(x[:, :, :n], 1, 2)
    with_captures = lambda jaxpr, caps: jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, list(caps)))
    score_fn = lambda caps, *xs: with_captures(st.score_mod.jaxpr, caps)(*xs)[0]
    mask_fn = lambda *xs: with_captures(st.mask_mod.jaxpr, mask_caps)(*xs)[0]
    return score_mod_capture_cotangents(
        score_fn, score_caps, mask_fn,
        unpad(q, q_len), unpad(k, kv_len), unpad(v, kv_len),
        lse[:, :, :q_len, 0], unpad(do, q_len), di[:, :, :q_len, 0],
        scale=st.scale,
    )  # fmt: skip


_attention.defvjp(_attention_fwd, _attention_bwd)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def unsupported_reason(request: AttentionRequest, *, interpret: Any = None) -> str | None:
    """Why the block-sparse kernels cannot serve ``request``, or None when they can.

    Causal and sliding-window visibility are served (folded into the mask); what is
    refused has no place in the kernels.

    Args:
        request: a validated call (`ejk_sequtils.validate_attention`).
        interpret: as in `blocksparse_attention_request` (float16 compiles only in the
            interpreter); default `default_interpret()`.
    """
    q, v = request.q, request.v
    if request.bias is not None:
        return "the block-sparse kernels take no additive bias (express -inf entries as the mask)"
    if request.cu_seqlens_q is not None:
        return "the block-sparse kernels take no cu_seqlens (pass packed sequences as segment_ids)"
    if v.shape[3] != q.shape[3]:
        return f"the block-sparse kernels need v's head_dim {v.shape[3]} == q's {q.shape[3]}"
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        return f"the block-sparse kernels take float32, bfloat16 or float16, got {q.dtype}"
    interpret = default_interpret() if interpret is None else interpret
    if interpret is False and q.dtype == jnp.float16:
        # Mosaic has no float16 matmul path (the deviceless v6e compile fails).
        return "the block-sparse kernels on TPU take float32 or bfloat16, got float16"
    return None


def _check_mask(mask: Any, heads: int, q_len: int, kv_len: int) -> None:
    """``mask`` is None, a `Mask` of shape ``(T, S)``, a `MultiHeadMask` ``(1|N, T, S)`` or a
    bool array ``[T, S]`` / ``[1|N, T, S]``."""
    if mask is None:
        return
    if isinstance(mask, MultiHeadMask):
        if mask.shape[0] not in (1, heads) or mask.shape[1:] != (q_len, kv_len):
            raise ValueError(
                f"MultiHeadMask shape {mask.shape} must be (1 or {heads=}, {q_len=}, {kv_len=})"
            )
        return
    if isinstance(mask, Mask):
        if mask.shape != (q_len, kv_len):
            raise ValueError(f"mask shape {mask.shape} must be ({q_len=}, {kv_len=})")
        return
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


def _with_visibility(mask: Any, request: AttentionRequest) -> Any:
    """``mask`` (None: every key) and the request's causal / sliding-window visibility."""
    _, q_len, kv_len, *_ = request.shape
    rule = attention_mask(
        q_len, kv_len, causal=request.causal, sliding_window=request.sliding_window
    )
    if mask is None:
        return rule
    if isinstance(rule, FullMask):
        return mask
    if isinstance(mask, MultiHeadMask):
        return MultiHeadMask([m & rule for m in mask.masks])
    if isinstance(mask, Mask):
        return mask & rule
    return jnp.asarray(mask) & jnp.asarray(rule.dense())


def _reject_empty_rows(mask: Any) -> None:
    """Splash attention's rule: a mask row that sees no key is an error (`check_mask`)."""
    if isinstance(mask, Mask):
        check_mask(mask)
        return
    if isinstance(mask, jax.core.Tracer):
        raise NotImplementedError(
            "reject_empty_rows needs a static Mask or a concrete array mask, got a traced array"
        )
    dense = np.asarray(mask).reshape((-1, *np.shape(mask)[-2:]))
    check_mask(MultiHeadMask([NumpyMask(m) for m in dense]))


def _empty_call(request: AttentionRequest, mask: Any) -> Any:
    """`reference_attention`'s answer for a call with an empty axis (nothing to launch)."""
    kwargs = request.keyword_arguments()
    if mask is not None:
        dense = jnp.asarray(mask.dense() if isinstance(mask, Mask) else mask)
        kwargs["mask"] = dense.reshape((1,) * (4 - dense.ndim) + dense.shape)
    return reference_attention(request.q, request.k, request.v, **kwargs)


def _kernel_seed(request: AttentionRequest) -> jax.Array | None:
    """The dropout key ``[seed, b0, n0, i0, j0]`` (`ejk_sequtils.dropout_key`) as int32 ``[5]``
    holding its uint32 bits (the SMEM carrier), or None."""
    if request.dropout_seed is None:
        return None
    key = dropout_key(request.dropout_seed, request.dropout_offsets)
    return jax.lax.bitcast_convert_type(key, jnp.int32)


def blocksparse_attention_request(
    request: AttentionRequest,
    mask: Mask | Bool[Array, "T S"] | Bool[Array, "#N T S"] | None = None,
    *,
    config: BlockSparseConfig | None = None,
    interpret: Any = None,
    mask_function: bool = True,
    reject_empty_rows: bool = False,
) -> Float[Array, "B T N H"] | tuple[Float[Array, "B T N H"], Float[Array, "B N T"]]:
    """Block-sparse attention of an already validated call (the facade's entry point).

    ``request`` is not checked again (`ejk_sequtils.validate_attention` did that); only the
    mask, which is not part of it, is. The request's causal and sliding-window visibility
    join the mask. A call with an empty axis (B, T, S, N or H = 0) launches nothing and gets
    `reference_attention`'s answer (zeros; lse -inf or the sink; zero gradients).

    Args:
        request: the validated call (`ejk_sequtils.AttentionRequest`).
        mask: as in `blocksparse_attention`; None: every key (before causal / window).
        config: block sizes of the forward and backward kernels; default
            `block_sparse_heuristic`.
        interpret: False to compile for TPU, or `pltpu.InterpretParams`; default
            `default_interpret()`.
        mask_function, reject_empty_rows: as in `blocksparse_attention`.

    Returns:
        ``out [B, T, N, H]`` in q's dtype, and with ``request.return_lse`` ``(out, lse [B, N, T])``.

    Raises:
        NotImplementedError: what the kernels cannot serve, with `unsupported_reason`'s reason.
        ValueError, TypeError: a mask or config of the wrong shape or kind; with
            ``reject_empty_rows``, a mask row that sees no key.
    """
    interpret = default_interpret() if interpret is None else interpret
    reason = unsupported_reason(request, interpret=interpret)
    if reason is not None:
        raise NotImplementedError(reason)
    batch, q_len, kv_len, heads, kv_heads, head_dim = request.shape
    _check_mask(mask, heads, q_len, kv_len)
    if config is not None and not isinstance(config, BlockSparseConfig):
        raise TypeError(f"config must be a BlockSparseConfig, got {type(config).__name__}")
    if 0 in (batch, q_len, kv_len, heads, head_dim):
        return _empty_call(request, mask)
    mask = _with_visibility(mask, request)
    if reject_empty_rows:
        _reject_empty_rows(mask)
    q, k, v = request.q, request.k, request.v
    if config is None:
        config = block_sparse_heuristic(q_len, kv_len, head_dim, q.dtype.itemsize)
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
    (fwd_tables, mask_fn), (dq_tables, _), (dkv_tables, _) = (
        _tables(mask, block, is_dkv, tiles=not mask_function)
        for block, is_dkv in ((fwd, False), (dq, False), (dkv, True))
    )
    tables = (fwd_tables, dq_tables, dkv_tables, (), ())
    st = Static(
        heads=heads,
        kv_heads=kv_heads,
        fwd=fwd,
        dq=dq,
        dkv=dkv,
        scale=float(request.softmax_scale),
        soft_cap=request.logits_soft_cap,
        has_segments=request.segment_ids is not None,
        has_sinks=request.softmax_sinks is not None,
        interpret=interpret,
        dropout_rate=request.dropout_rate,
        mask_fn=mask_fn,
    )

    def to_kernel(x, length):
        x = jnp.swapaxes(x, 1, 2)  # [B, heads, seq, H]
        return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))

    q_seg = kv_seg = None
    if request.segment_ids is not None:
        q_ids, kv_ids = request.segment_ids
        # Padding positions get id -1: they see nothing and are seen by nothing.
        q_seg = jnp.pad(
            jnp.asarray(q_ids, jnp.int32), ((0, 0), (0, t_pad - q_len)), constant_values=-1
        )[..., None]
        kv_seg = jnp.pad(
            jnp.asarray(kv_ids, jnp.int32), ((0, 0), (0, s_pad - kv_len)), constant_values=-1
        )[:, None, :]
    sinks = request.softmax_sinks
    sinks = None if sinks is None else jnp.asarray(sinks).astype(jnp.float32)
    o, lse = _attention(
        to_kernel(q, t_pad),
        to_kernel(k, s_pad),
        to_kernel(v, s_pad),
        q_seg,
        kv_seg,
        sinks,
        _kernel_seed(request),
        tables,
        (),
        st,
    )
    out = jnp.swapaxes(o[:, :, :q_len], 1, 2)
    return (out, lse[:, :, :q_len, 0]) if request.return_lse else out


def blocksparse_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K Hv"],
    mask: Mask | Bool[Array, "T S"] | Bool[Array, "#N T S"] | None,
    *,
    segment_ids: Int[Array, "B T"] | tuple[Int[Array, "B T"], Int[Array, "B S"]] | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    softmax_sinks: Float[Array, " N *num_sinks"] | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: int | Integer[Array, ""] | None = None,
    return_lse: bool = False,
    config: BlockSparseConfig | None = None,
    interpret: Any = None,
    mask_function: bool = True,
    reject_empty_rows: bool = False,
) -> Float[Array, "B T N H"] | tuple[Float[Array, "B T N H"], Float[Array, "B N T"]]:
    """Block-sparse attention on TPU (Pallas), differentiable in q, k, v and the sinks.

    Blocks the mask leaves empty are skipped (no copy, no compute); full blocks skip mask
    evaluation. Off TPU the same kernels run in Pallas' TPU interpreter. The attention
    arguments are checked by `ejk_sequtils.validate_attention` (the checks every ejk
    backend shares), then `blocksparse_attention_request` runs the call.

    Args:
        q: queries ``[B, T, N, H]``.
        k, v: keys and values ``[B, S, K, H]``, ``N % K == 0`` (GQA/MQA).
        mask: a `Mask` of shape ``(T, S)`` for every head, a `MultiHeadMask` ``(N, T, S)``,
            or a (possibly traced) bool array ``[T, S]`` / ``[1 or N, T, S]``; None: every
            key. A static mask stores each distinct partial tile once; an array mask keeps
            every tile (`process_dynamic_mask`) but still skips its empty blocks.
        segment_ids: int ``[B, T]`` (needs T == S) or ``(q_ids [B, T], kv_ids [B, S])``;
            a query sees a key only when the ids are equal and >= 0 (negative ids are padding).
        softmax_scale: multiplies ``q·kᵀ``; default ``H ** -0.5``.
        logits_soft_cap: ``cap * tanh(logits / cap)``.
        softmax_sinks: ``[N]`` one logit per query head, or ``[N, num_sinks]`` (folded to one
            per head by logsumexp), in the softmax denominator only.
        dropout_rate: probability in ``[0, 1)`` of dropping a normalised weight (kept ones are
            scaled by ``1 / (1 - rate)``); the keep mask is ejk's counter hash of
            (seed, batch, query head, row, column), `ejk_sequtils.dropout_keep_mask`.
        dropout_seed: a Python int or a uint32/int32 scalar; required when dropout_rate > 0.
        return_lse: also return the float32 log-sum-exp ``[B, N, T]`` (dropout leaves it alone).
        config: block sizes; default `block_sparse_heuristic`.
        interpret: False to compile for TPU, or `pltpu.InterpretParams`; default: interpret
            unless the default backend is a TPU.
        mask_function: when one static mask computable from indices (causal, local,
            chunked, their ``&``/``|``, padded) serves every head, the kernels evaluate it on
            each partial block from ``q_sequence`` and the key indices and store no tile
            (`process_mask`'s mask function). False: store and load partial tiles always.
        reject_empty_rows: raise ValueError, as splash attention's mask check does, when a
            row of the mask (with causal / window joined) sees no key. Default False: such a
            row gives zeros and zero gradients (ejk's rule).

    Returns:
        ``out [B, T, N, H]`` in q's dtype, and with ``return_lse`` ``(out, lse [B, N, T])``.
        A query row that sees no key gives zeros (lse -inf, or the sink's logit); an empty
        axis (B, T or S = 0) gives `reference_attention`'s answer without a launch.

    Raises:
        ValueError, TypeError: a bad argument (the message names it); with
            ``reject_empty_rows``, a mask row that sees no key.
        NotImplementedError: what `unsupported_reason` names (v's head_dim != q's, float64,
            float16 when compiling for TPU).
    """
    request = validate_attention(
        q,
        k,
        v,
        softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap,
        softmax_sinks=softmax_sinks,
        segment_ids=segment_ids,
        dropout_rate=dropout_rate,
        dropout_seed=dropout_seed,
        return_lse=return_lse,
    )
    return blocksparse_attention_request(
        request,
        mask,
        config=config,
        interpret=interpret,
        mask_function=mask_function,
        reject_empty_rows=reject_empty_rows,
    )
