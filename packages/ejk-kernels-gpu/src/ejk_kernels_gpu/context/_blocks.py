"""Kernel entry for context parallelism: one block of queries against one block of keys.

A device of a ring (or of an all-gather step) holds a block of queries and a block of
keys that sit at offsets of the global sequence. `block_forward` runs the forward kernel
on the pair with masks evaluated on GLOBAL positions and returns the block's output and
lse, which the caller merges with other blocks' by the lse (FlashAttention-2's rescaling,
once per block). `block_backward` runs the dq and dk/dv kernels of the pair given the
GLOBAL statistics of each query row (the merged output and lse): the kernels rebuild
``P = exp(s - lse)`` with the global lse, and ``delta = rowsum(dO ∘ O)`` of the global
output, so the pair's dq, dk and dv are exactly its share of the global gradients
(FlashAttention-2, Alg. 2, with the row statistics of the whole row).

Global positions reach the kernels in one of two ways:

- ``q_offset``/``k_offset`` given and a causal or window mask: the packed-sequence path
  (``VARLEN``) without its sequence ids (``SEQ_IDS`` off: one sequence, nothing to
  compare or load, and registers to spare): every token has position ``offset + index``,
  and the kernels compare positions (`kernels.triton._common.visibility`). Block tables computed here
  skip every key block the offsets hide and run the fully visible ones unmasked.
  ``q_offset`` may also give one offset per equal chunk of the rows (a zigzag
  device's two chunks in one call).
- offsets None: positions are local. Exact for a pair that is fully visible (call it
  with ``causal=False``) or on the causal diagonal (equal offsets), and such calls run
  the plain (and on Hopper the warp-specialised / Gluon) builds; the ring picks these
  for the zigzag layout, where every pair is one of the two or hidden.

Segment ids (documents crossing shard boundaries) stay per token and go with the
blocks; the per-batch block tables of `flash._tables` skip key blocks of other documents, as
on one GPU.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import Array
from jaxtyping import Float, Int, UInt32

from ejk_sequtils import validate_attention

from ..flash._backward_launch import backward
from ..flash._config import FlashBackwardConfig, FlashConfig, as_backward_config
from ..flash._forward_launch import forward
from ..flash._select import (
    CallOptions,
    bwd_heuristic,
    call_options,
    can_run_gluon_dkdv,
    fwd_heuristic,
    gluon_dkdv_tiles,
    offer_gluon,
)
from ..flash._tables import PositionRanges, Tables, dummy, range_tables, ranges

__all__ = ["BlockMasks", "block_backward", "block_forward", "block_options"]

_I32 = jnp.int32
_LONG_ROWS = 8192  # keys from which a causal relative call takes the long-row forward config


@dataclasses.dataclass(frozen=True)
class BlockMasks:
    """The static options of one (query block, key block) call (hashable)."""

    scale: float
    causal: bool = False
    window: tuple[int, int] | None = None
    soft_cap: float | None = None
    relative: bool = False  # masks on offset positions (the packed path); else local indices
    dropout_rate: float = 0.0  # the call's keep-mask comes with its dropout key

    def __post_init__(self) -> None:
        if self.relative and not (self.causal or self.window is not None):
            raise ValueError(
                f"relative positions matter only with causal or a window, got {self!r}"
            )


def block_options(
    masks: BlockMasks,
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    has_segments: bool,
    config: FlashConfig | None = None,
    bwd_config: FlashBackwardConfig | FlashConfig | None = None,
) -> CallOptions:
    """The kernels' `CallOptions` of one block call (heuristic configs where None; a
    `FlashConfig` as ``bwd_config``: deprecated, converted, `flash._config.as_backward_config`)."""
    bwd_config = as_backward_config(bwd_config, stacklevel=4)
    request = validate_attention(
        q,
        k,
        v,
        softmax_scale=masks.scale,
        causal=masks.causal,
        sliding_window=masks.window,
        logits_soft_cap=masks.soft_cap,
        segment_ids=(
            (jnp.zeros(q.shape[:2], _I32), jnp.zeros(k.shape[:2], _I32)) if has_segments else None
        ),
        dropout_rate=masks.dropout_rate,
        dropout_seed=0 if masks.dropout_rate > 0.0 else None,  # the key comes in the tables
    )
    opts = call_options(request, config, bwd_config)
    if not masks.relative:
        return opts
    opts = dataclasses.replace(opts, varlen=True, seq_ids=False)
    head_dim, itemsize = q.shape[3], q.dtype.itemsize
    if config is None:  # the packed path reads side inputs: the heuristics leave room
        gluon = offer_gluon(
            itemsize=itemsize, bias=None, dropout_rate=opts.dropout_rate, scale=opts.scale
        )
        # Long rows (a device's rows against a whole gathered sequence, causal) take the
        # unmasked config; windows, documents, a soft cap and chunk-sized calls the
        # short-loop one (`fwd_heuristic`).
        long_rows = masks.window is None and not has_segments and k.shape[1] >= _LONG_ROWS
        short = not long_rows or opts.soft_cap > 0.0
        fwd = fwd_heuristic(
            head_dim, itemsize, True, gluon=gluon, short_loops=short,
            windowed=masks.window is not None,
        )  # fmt: skip
        opts = dataclasses.replace(opts, fwd_cfg=fwd)
    if bwd_config is None:  # on Hopper the Gluon backward, walking the block tables
        group = q.shape[2] // k.shape[2]
        gluon = can_run_gluon_dkdv(opts, None, q, k.shape[1], gluon_dkdv_tiles(head_dim))
        cap = opts.soft_cap > 0.0
        bwd = bwd_heuristic(head_dim, itemsize, True, group, soft_cap=cap, gluon=gluon, tables=True)
        opts = dataclasses.replace(opts, bwd_cfg=bwd)
    return opts


Offset = Int[Array, ""] | int
QueryOffset = Offset | tuple[Offset, ...]


def _keys(q: Array, k: Array | None, v: Array | None, kv: Array | None) -> tuple:
    """``(k, v, kernel_k, kernel_v)``: the keys and values (views of ``kv`` where given:
    for the options only, unused by the kernels) and what the kernels read."""
    if kv is None:
        if k is None or v is None:
            raise ValueError("pass k and v, or kv: the two as one [B, S, K, 2H] array")
        return k, v, k, v
    head_dim = q.shape[3]
    if k is not None or v is not None or kv.ndim != 4 or kv.shape[3] != 2 * head_dim:
        raise ValueError(
            f"kv takes the place of k and v (None then): one [B, S, K, {2 * head_dim}] array, "
            f"each head's k columns then its v columns; got kv {kv.shape}"
            + ("" if k is None and v is None else " beside k or v")
        )
    return kv[..., :head_dim], kv[..., head_dim:], kv, kv


def _chunk_offsets(q_offset: QueryOffset, q_len: int) -> tuple[Array, ...]:
    """The global offsets of the query rows' chunks, int32: one for a contiguous block, or
    one per equal chunk (``len(q_offset)`` of them, in increasing order)."""
    offsets = q_offset if isinstance(q_offset, (tuple, list)) else (q_offset,)
    if not offsets or q_len % len(offsets):
        raise ValueError(
            f"q_offset gives the offsets of equal chunks of the {q_len} query rows; got "
            f"{len(offsets)} offsets"
        )
    return tuple(jnp.asarray(o, _I32) for o in offsets)


def _query_positions(offsets: tuple[Array, ...], q_len: int) -> Array:
    c = q_len // len(offsets)
    return jnp.concatenate([o + jnp.arange(c, dtype=_I32) for o in offsets])


def block_tables(
    opts: CallOptions,
    masks: BlockMasks,
    q_len: int,
    kv_len: int,
    q_offset: QueryOffset,
    k_offset: Offset,
    segment_ids: tuple[Int[Array, "B T"], Int[Array, "B S"]] | None,
    dropout_key: UInt32[Array, 5] | None = None,
    *,
    head_dim: int,
) -> Tables:
    """The kernels' `Tables` of one block call (offsets used only when ``masks.relative``;
    ``q_offset`` a tuple: the rows are equal chunks at those offsets; ``head_dim``: the
    call's, for the dq kernel's tiles, `flash._tables.range_tables`)."""
    chunks = _chunk_offsets(q_offset, q_len)
    if len(chunks) > 1 and masks.dropout_rate > 0.0:
        raise ValueError(
            "dropout hashes positions from one offset per call; got a q_offset of "
            f"{len(chunks)} chunks"
        )
    q_sid = k_sid = q_pos = k_pos = dummy()  # one sequence: no ids (``SEQ_IDS`` off)
    if masks.relative:
        q_pos = _query_positions(chunks, q_len)
        k_pos = jnp.asarray(k_offset, _I32) + jnp.arange(kv_len, dtype=_I32)
        # The ranges by positions: with segment ids the table kernel builds the masks'
        # entries from them (no XLA kernels for the masks); else jnp does
        # (`flash._tables.PositionRanges`).
        rows = PositionRanges.of(q_pos, k_pos, 1, masks.causal, masks.window, of_queries=True)
        cols = PositionRanges.of(
            k_pos, q_pos, len(chunks), masks.causal, masks.window, of_queries=False
        )
    else:  # local positions: the masks' ranges are NumPy constants, as on one GPU
        rows, cols = (
            ranges(q_len, kv_len, masks.causal, masks.window, None, of_queries=of_queries)
            for of_queries in (True, False)
        )
    if segment_ids is None:
        q_seg = k_seg = dummy()
    else:
        # Per batch row, from each block's document ids (`flash._tables.segment_block_table`:
        # blocks of other documents are skipped, as on one GPU).
        segment_ids = q_seg, k_seg = tuple(jnp.asarray(x, _I32) for x in segment_ids)
    fwd_table, dq_table, dkdv_table, counter = range_tables(
        opts, rows, cols, segment_ids, head_dim=head_dim
    )
    if (dropout_key is None) != (masks.dropout_rate == 0.0):
        raise ValueError(
            f"a dropout key comes with dropout_rate > 0 and only then, got "
            f"dropout_rate={masks.dropout_rate} and a key {'' if dropout_key is None else 'not '}None"
        )
    seed = dummy(jnp.uint32) if dropout_key is None else jnp.asarray(dropout_key, jnp.uint32)
    return Tables(
        q_sid, k_sid, q_pos, k_pos, q_seg, k_seg, fwd_table, dq_table, dkdv_table, seed, counter
    )


def block_forward(
    masks: BlockMasks,
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"] | None,
    v: Float[Array, "B S K H"] | None,
    *,
    q_offset: QueryOffset = 0,
    k_offset: Offset = 0,
    segment_ids: tuple[Int[Array, "B T"], Int[Array, "B S"]] | None = None,
    dropout_key: UInt32[Array, 5] | None = None,
    config: FlashConfig | None = None,
    resume: tuple[Float[Array, "B T N H"], Float[Array, "B N T"]] | None = None,
    kv: Float[Array, "B S K 2H"] | None = None,
) -> tuple[Float[Array, "B T N H"], Float[Array, "B N T"]]:
    """Output and lse of ``q`` against one key block, masks on global positions.

    Args:
        masks: scale, causal, window, soft cap, and whether the offsets apply
            (``relative``; else positions are local indices, see the module docstring).
        q: this block's queries ``[B, T, N, H]``.
        k: the key block ``[B, S, K, H]``, ``N % K == 0``.
        v: the value block ``[B, S, K, H]``.
        q_offset: global position of ``q``'s first row (traced int32 is fine), or a
            tuple of offsets, increasing: the rows are that many equal chunks, each
            contiguous from its offset (a device's two chunks of the zigzag layout, against
            the whole gathered sequence in one call). Not with dropout.
        k_offset: global position of ``k``'s first row.
        segment_ids: ``(q_ids [B, T], k_ids [B, S])`` of these blocks, or None.
        dropout_key: with ``masks.dropout_rate > 0``, `ejk_sequtils.dropout_key` of the
            call: the seed and the global (batch, head, row, column) of its first
            element, so the call drops its slice of the whole attention's weights.
        config: the forward tile config; default the heuristic's.
        resume: ``(out, lse)`` of the same rows against other keys (another call's
            result): the rows continue from it inside the kernel, so the result is theirs
            against both calls' keys, with no merge pass; its buffers become the outputs,
            and blocks of rows that see no key here are not written at all.
        kv: in place of ``k`` and ``v`` (then None), the two as one ``[B, S, K, 2H]``
            array, each head's k columns then its v columns (as all-gather moves them, in
            one collective): the kernels read it as it is.

    Returns:
        ``out [B, T, N, H]`` in q's dtype (0 for rows that see no key of the block) and
        the float32 ``lse [B, N, T]`` (``-inf`` for those rows); with ``resume``, against
        its keys too.
    """
    k, v, kernel_k, kernel_v = _keys(q, k, v, kv)
    opts = block_options(masks, q, k, v, segment_ids is not None, config)
    tables = block_tables(
        opts, masks, q.shape[1], k.shape[1], q_offset, k_offset, segment_ids, dropout_key,
        head_dim=q.shape[3],
    )  # fmt: skip
    out, lse, _ = forward(
        opts, q, kernel_k, kernel_v, None, None, tables, resume=resume, kv_pair=kv is not None
    )
    return out, lse


def block_backward(
    masks: BlockMasks,
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"] | None,
    v: Float[Array, "B S K H"] | None,
    out: Float[Array, "B T N H"],
    lse: Float[Array, "B N T"],
    d_out: Float[Array, "B T N H"],
    d_lse: Float[Array, "B N T"] | None = None,
    *,
    q_offset: QueryOffset = 0,
    k_offset: Offset = 0,
    segment_ids: tuple[Int[Array, "B T"], Int[Array, "B S"]] | None = None,
    dropout_key: UInt32[Array, 5] | None = None,
    bwd_config: FlashBackwardConfig | FlashConfig | None = None,
    joint_dkdv: bool = False,
    kv: Float[Array, "B S K 2H"] | None = None,
) -> (
    tuple[Float[Array, "B T N H"], Float[Array, "B S K H"], Float[Array, "B S K H"]]
    | tuple[Float[Array, "B T N H"], Float[Array, "B S K 2H"]]
):
    """This key block's share of the gradients, given the GLOBAL output and lse of the rows.

    Args:
        masks, q, k, v, q_offset, k_offset, segment_ids, dropout_key, kv: as in
            `block_forward`.
        out: the rows' merged (global) output ``[B, T, N, H]``.
        lse: the rows' global float32 lse ``[B, N, T]``.
        d_out: cotangent of the global output.
        d_lse: cotangent of the global lse, or None.
        bwd_config: the backward tile config (`FlashBackwardConfig`); default the heuristic's.
        joint_dkdv: return dk and dv side by side, ``(dq, dkv)`` with ``dkv [B, S, K, 2H]``
            (dk in the first H columns of each head): the Gluon dk/dv kernel writes them
            so, and one reduce-scatter then takes both with no copy (all-gather's backward).

    Returns:
        ``(dq, dk, dv)`` in the inputs' dtypes: dq is this block's addend of q's
        gradient, dk/dv the whole gradient of this block from these rows (``(dq, dkv)``
        with ``joint_dkdv``).
    """
    k, v, kernel_k, kernel_v = _keys(q, k, v, kv)
    opts = block_options(masks, q, k, v, segment_ids is not None, None, bwd_config)
    tables = block_tables(
        opts, masks, q.shape[1], k.shape[1], q_offset, k_offset, segment_ids, dropout_key,
        head_dim=q.shape[3],
    )  # fmt: skip
    dq, dk, dv, _, _ = backward(
        opts, q, kernel_k, kernel_v, None, None, tables, out, lse, d_out, d_lse,
        joint_dkdv=joint_dkdv, kv_pair=kv is not None,
    )  # fmt: skip
    return (dq, dk) if joint_dkdv else (dq, dk, dv)
