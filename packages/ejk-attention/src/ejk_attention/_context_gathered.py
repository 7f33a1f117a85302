"""All-gather in one call: a device's queries against the whole gathered sequence.

Once every device's keys and values are gathered, a device's query rows (one contiguous
block, or the zigzag layout's two chunks) need no steps: one kernel call against the
whole sequence in global order, masks on global positions (`ejk_kernels_gpu.context`
with one ``q_offset`` per chunk), gives the rows' output and lse. Nothing is merged, no
float32 accumulator is kept, the kernels walk long rows (one tile sees every key block it
may, not one chunk's), and with documents the block tables skip other documents' blocks
as on one GPU. The backward is one call too: dq of the rows, and dk/dv of the whole
sequence from these rows, laid back out into device blocks for the reduce-scatter, in
the inputs' dtype (each device's partial sum rounded once; half the bytes of float32).

The keys may be laid out apart from the queries (``Layout.keys_zigzag``): once gathered,
only the queries' split decides the balance, so the facade keeps keys and values in the
contiguous split (no layout exchange for them or their gradients, and the global order a
reshape). Dropout keys each call by one offset, so it keeps the steps (`_ring`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from ejk_kernels_gpu.context import BlockMasks, block_backward, block_forward
from ejk_sequtils import from_zigzag, to_zigzag

from ._context_calls import CallMasks
from ._context_plan import Layout

__all__ = [
    "device_blocks",
    "gathered_backward",
    "gathered_forward",
    "gathers_kv_pair",
    "global_order",
    "own_block_first",
]


def global_order(gathered: Array, zigzag: bool) -> Array:
    """Device blocks stacked ``[n, B, S, ...]`` (`jax.lax.all_gather`) as the whole
    sequence ``[B, n S, ...]`` in global order."""
    n, b, s = gathered.shape[:3]
    x = jnp.moveaxis(gathered, 0, 1).reshape(b, n * s, *gathered.shape[3:])
    return from_zigzag(x, n) if zigzag else x


def device_blocks(x: Array, size: int, zigzag: bool) -> Array:
    """The inverse of `global_order`: ``[B, T, ...]`` cut into the ``size`` devices'
    blocks, ``[size, B, T / size, ...]``."""
    if zigzag:
        x = to_zigzag(x, size)
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, size, t // size, *x.shape[2:]), 1, 0)


def _block_masks(cm: CallMasks) -> Any:
    relative = cm.causal or cm.window is not None
    return BlockMasks(
        scale=cm.scale,
        causal=cm.causal,
        window=cm.window,
        soft_cap=cm.soft_cap,
        relative=relative,
    )


def _whole(layout: Layout, gathered: Any) -> tuple[dict[str, Array | None], Array | None]:
    """The gathered ``(k, v, ids)`` (or ``(pair, None, ids)``, `gathers_kv_pair`) in global
    order: the kernels' key arguments (``k``, ``v``, or ``kv``), and the ids."""
    k, v, ids = gathered
    whole = lambda x: None if x is None else global_order(x, layout.kv_zigzag)
    if v is None:
        return {"k": None, "v": None, "kv": whole(k)}, whole(ids)
    return {"k": whole(k), "v": whole(v)}, whole(ids)


def gathers_kv_pair(q_ids: Array | None) -> bool:
    """Whether all-gather moves k and v as one array ``[B, S, K, 2H]`` (each head's k
    columns, then its v columns; the gathered blocks then ``(pair, None, ids)``): with
    documents, where the forward may run the own block first (`own_block_first`). XLA
    keeps one collective in flight, so the gathers of k and of v ran one after the other
    and only the second hid behind the own call (two H200s, T = 65536, 16 documents: the
    first, 0.3 ms, exposed); as one, the whole gather hides. The kernels read the pair in
    place (``kv=``). The zigzag layout takes it too: the facade's ``lax.cond`` between the
    two layouts keeps the residuals of both branches, and residuals of different shapes
    are each filled with zeros in the other branch (0.08 ms, and a copy)."""
    return q_ids is not None


def own_block_first(layout: Layout, q_ids: Array | None) -> bool:
    """Whether the forward runs the device's own key block before the gathered rest
    (`gathered_forward`): with documents, where queries and keys share the contiguous
    split (the facade's layout for documents shorter than a shard). There the own block
    holds nearly all of a device's work, and its call needs no gathered keys."""
    return q_ids is not None and not layout.zigzag and not layout.kv_zigzag


def gathered_forward(
    cm: CallMasks,
    layout: Layout,
    me: Any,
    q: Array,
    q_ids: Array | None,
    gathered: Any,
    own: tuple[Array, Array, Array | None],
) -> tuple[Array, Array]:
    """``(out, lse)`` of this device's rows: one call against the gathered ``(k, v, ids)``
    (each stacked ``[n, B, S, ...]``; ids None without documents; with documents k and v
    as one array, ``(pair, None, ids)``, `gathers_kv_pair`), or where
    `own_block_first`, a call against the device's ``own`` ``(k, v, ids)``, which does
    not wait for the gather (it hides behind the call), and one against every other
    device's keys (the own block's ids made padding, so its blocks are skipped) resuming
    the first call's rows inside the kernel (`block_forward`'s ``resume``): no merge pass,
    and tiles of rows whose documents start in the own block write nothing."""
    masks = _block_masks(cm)
    q_offset = tuple(layout.offsets(me, layout.q_len))
    if not own_block_first(layout, q_ids):
        keys, kv_ids = _whole(layout, gathered)
        return block_forward(
            masks, q, **keys, q_offset=q_offset,
            segment_ids=None if q_ids is None else (q_ids, kv_ids),
        )  # fmt: skip
    own_k, own_v, own_ids = own
    first = block_forward(
        masks, q, own_k, own_v, q_offset=q_offset,
        k_offset=layout.offsets(me, layout.kv_len)[0], segment_ids=(q_ids, own_ids),
    )  # fmt: skip
    k, v, ids = gathered
    others = jax.lax.dynamic_update_index_in_dim(ids, jnp.full_like(own_ids, -1), me, axis=0)
    keys, kv_ids = _whole(layout, (k, v, others))
    return block_forward(
        masks, q, **keys, q_offset=q_offset, segment_ids=(q_ids, kv_ids), resume=first
    )


def gathered_backward(
    cm: CallMasks, layout: Layout, me: Any, res: tuple, cts: tuple, gathered: Any
) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)``: dq of this device's rows; dk and dv of every device's block from
    these rows, ``[n, B, S, K, H]`` in the inputs' dtype, not yet summed over the devices.
    dk and dv are the two halves of one array (the kernel writes them side by side,
    `block_backward`'s ``joint_dkdv``): joined again for the reduce-scatter
    (`_ring._reduce_scatter`), XLA takes that array itself, with no copy."""
    q, _, _, q_ids, _, out, lse = res
    d_out, d_lse = cts
    keys, kv_ids = _whole(layout, gathered)
    dq, dkv = block_backward(
        _block_masks(cm),
        q,
        out=out,
        lse=lse,
        d_out=d_out,
        d_lse=d_lse,
        q_offset=tuple(layout.offsets(me, layout.q_len)),
        segment_ids=None if q_ids is None else (q_ids, kv_ids),
        joint_dkdv=True,
        **keys,
    )
    dkv = device_blocks(dkv, layout.size, layout.kv_zigzag)
    head_dim = q.shape[-1]
    return dq, dkv[..., :head_dim], dkv[..., head_dim:]
