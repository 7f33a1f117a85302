"""`mask_mod_attention`: the block-sparse kernels under a user's mask_mod and its block kinds
table, and a score_mod.

The flex path of the kernels (FlexAttention's ``score_mod``, ``mask_mod`` and ``BlockMask``,
built in ``ejk_attention.flex``; this package takes only their parts: functions and a
table). The mods are split by `ModMask` and `ModScore` (their captured arrays become
per-query, per-key or per-(b, h) kernel inputs), the kinds table becomes the kernels'
`MaskInfo` (`block_kind_info`: empty blocks never visited, full ones without the mask,
partial ones with it), and the call runs through the same custom_vjp as
`blocksparse_attention`, which also gives the score_mod's float captures their cotangents.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ejk_sequtils import AttentionRequest

from ._block_kinds import block_kind_info, rescale_kinds
from ._common import Static
from ._config import BlockSparseConfig, block_sparse_heuristic, effective_block
from ._mask_info import FULL
from ._mask_mod import ModMask, ModScore
from ._ops import _attention, _empty_call, _round_up, default_interpret, unsupported_reason

__all__ = ["mask_mod_attention", "unsupported_mask_mod_reason"]

# The request's options the flex path has no place for (a flex call sets none of them).
_OPTIONS = ("bias", "segment_ids", "cu_seqlens_q", "softmax_sinks", "logits_soft_cap")


def unsupported_mask_mod_reason(
    request: AttentionRequest,
    mask_mod: Callable[..., Any] | None,
    *,
    score_mod: Callable[..., Any] | None = None,
    interpret: Any = None,
) -> str | None:
    """Why `mask_mod_attention` cannot serve ``request`` under ``mask_mod`` and ``score_mod``,
    or None (a mod reading a captured array at a position that depends on both q_idx and
    kv_idx is named, with the operation that reads it)."""
    reason = unsupported_reason(request, interpret=interpret)
    if reason is not None:
        return reason
    used = [name for name in _OPTIONS if getattr(request, name) is not None]
    if used or request.causal or request.sliding_window is not None or request.dropout_rate:
        return f"the mask_mod path takes the mask as a mask_mod only, got {used or 'causal/window/dropout'}"
    for split, mod in ((ModMask, mask_mod), (ModScore, score_mod)):
        if mod is not None:
            try:
                split.trace(mod)
            except NotImplementedError as err:
                return str(err)
    return None


def _always(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    del b, h, q_idx, kv_idx
    return jnp.bool_(True)


def mask_mod_attention(
    request: AttentionRequest,
    mask_mod: Callable[..., Any] | None,
    kinds: Int[Array, "Bm Nm Tb Sb"] | None,
    block_size: tuple[int, int] | None,
    *,
    score_mod: Callable[..., Any] | None = None,
    config: BlockSparseConfig | None = None,
    interpret: Any = None,
) -> Float[Array, "B T N H"] | tuple[Float[Array, "B T N H"], Float[Array, "B N T"]]:
    """Block-sparse attention of a validated call under ``mask_mod`` (FlexAttention's mask)
    and ``score_mod``.

    ``s = softmax_scale·q·kᵀ``, then ``score_mod(s, b, h, q_idx, kv_idx)`` (in every kernel,
    on every visited tile), then ``-inf`` where the mask hides a key, and a softmax over the
    keys. Differentiable in q, k, v and the float arrays the score_mod captures (their
    cotangents from `ejk_sequtils.score_mod_capture_cotangents`); the mask and integer
    captures have no gradient. A query row with no visible key gives zeros, lse ``-inf``
    and zero gradients.

    Args:
        request: the validated call (q, k, v, softmax scale, ``return_lse``; no other mask).
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` on int32 scalars, capturing
            arrays (traced or not) that it reads per query, per key or per (b, h) (see
            `ModMask`); ``h`` is the query head; None: every key.
        kinds: int8 ``[B or 1, N or 1, ceil(T / block_q), ceil(S / block_kv)]``, 0 empty (never
            visited), 1 partial (the mask_mod is evaluated), 2 full (it is not): a flex
            ``BlockMask``'s table; a row of 1 serves every batch row (head). None (with
            ``mask_mod`` None): every block full.
        block_size: ``(block_q, block_kv)`` of ``kinds``; the kernels' own blocks (``config``)
            may differ: the table is re-cut (`rescale_kinds`).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx)`` on a float32 score and int32
            scalars, capturing arrays read per query, per key or per (b, h) as the mask_mod's
            (see `ModScore`); None: the scores as they are.
        config: block sizes; default `block_sparse_heuristic`.
        interpret: False to compile for TPU, or `pltpu.InterpretParams`; default
            `default_interpret()`.

    Returns:
        ``out [B, T, N, H]`` in q's dtype, and with ``request.return_lse`` ``(out, lse [B, N, T])``.

    Raises:
        NotImplementedError: `unsupported_mask_mod_reason`'s reason.
        TypeError: a config of another type.
    """
    interpret = default_interpret() if interpret is None else interpret
    reason = unsupported_mask_mod_reason(
        request, mask_mod, score_mod=score_mod, interpret=interpret
    )
    if reason is not None:
        raise NotImplementedError(reason)
    if config is not None and not isinstance(config, BlockSparseConfig):
        raise TypeError(f"config must be a BlockSparseConfig, got {type(config).__name__}")
    batch, q_len, kv_len, heads, kv_heads, head_dim = request.shape
    if 0 in (batch, q_len, kv_len, heads, head_dim):
        return _empty_call(request, None)
    q, k, v = request.q, request.k, request.v
    if config is None:
        config = block_sparse_heuristic(q_len, kv_len, head_dim, q.dtype.itemsize)
    fq = lambda b: effective_block(b, q_len)
    fk = lambda b: effective_block(b, kv_len)
    blocks = {
        "fwd": (fq(config.block_q), fk(config.block_kv)),
        "dq": (fq(config.block_q_dq), fk(config.block_kv_dq)),
        "dkv": (fq(config.block_q_dkv), fk(config.block_kv_dkv)),
    }
    padded = (
        _round_up(q_len, max(b[0] for b in blocks.values())),
        _round_up(kv_len, max(b[1] for b in blocks.values())),
    )
    if mask_mod is None:
        mask_mod, kinds, block_size = (
            _always,
            jnp.full((1, 1, 1, 1), FULL, jnp.int8),
            (q_len, kv_len),
        )
    mod, consts = ModMask.trace(mask_mod)
    features = tuple(mod.feature_arrays(consts, batch, heads, q_len, kv_len, *padded))
    score, score_caps = (None, []) if score_mod is None else ModScore.trace(score_mod)
    kinds = jnp.asarray(kinds)
    table_batch = kinds.shape[0]
    tables = []
    for name, block in blocks.items():
        cut = rescale_kinds(kinds, tuple(block_size), block, (q_len, kv_len), padded)
        info = block_kind_info(cut.reshape(-1, *cut.shape[2:]), is_dkv=name == "dkv")
        tables.append((info.data_next, None, info.block_mask, None, None))
    st = Static(
        heads=heads,
        kv_heads=kv_heads,
        fwd=blocks["fwd"],
        dq=blocks["dq"],
        dkv=blocks["dkv"],
        scale=float(request.softmax_scale),
        soft_cap=None,
        has_segments=False,
        has_sinks=False,
        interpret=interpret,
        mask_mod=mod,
        score_mod=score,
        lengths=(q_len, kv_len),
        table_batch=table_batch,
    )

    def to_kernel(x: jax.Array, length: int) -> jax.Array:
        x = jnp.swapaxes(x, 1, 2)  # [B, heads, seq, H]
        return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))

    o, lse = _attention(
        to_kernel(q, padded[0]),
        to_kernel(k, padded[1]),
        to_kernel(v, padded[1]),
        None,
        None,
        None,
        None,
        (*tables, features, tuple(consts)),
        list(score_caps),
        st,
    )
    out = jnp.swapaxes(o[:, :, :q_len], 1, 2)
    return (out, lse[:, :, :q_len, 0]) if request.return_lse else out
