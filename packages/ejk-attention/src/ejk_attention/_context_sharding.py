"""Sequence-sharded facade calls: ``flash_attention(mesh=, in_specs=P(batch, seq, heads))``.

The facade writes the ``shard_map`` and runs `ring_attention` inside it, with the
strategy `choose_strategy` picks. Causal self-attention is laid out in the zigzag order
inside the ``shard_map`` (`to_zigzag_local`: each device's two halves travel by one
``ppermute`` each) so every device does the same work, and laid back out after; other
calls keep the contiguous split. With segment ids the layout is chosen when the call
runs: packed documents shorter than a shard balance the contiguous split as well, and
there the exchange (a query block and its output each way, their gradients in the
backward) would only cost (`_contiguous_balanced`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ejk_sequtils import AttentionRequest, causal_shard_work

from ._backends import packed_segment_ids
from ._ring import one_call_serves, pick_implementation, ring_attention
from ._shard_map import add_traced_seed, shard_start
from ._zigzag_exchange import from_zigzag_local, to_zigzag_local

__all__ = ["choose_strategy", "context_call"]

# Gathered keys/values (and their float32 gradients) a device may hold before the ring is
# preferred for memory, bytes; see docs/performance-history.md, "Context parallelism".
_GATHER_BUDGET = 4 * 2**30


def choose_strategy(request: AttentionRequest, shards: int) -> str:
    """``"all_gather"`` or ``"ring"`` for a call split over ``shards`` devices.

    All-gather (Llama 3's context parallelism) moves each k/v block once per layer and,
    on the kernels, runs a device's rows in one call against the whole sequence; it pays
    the gathered k/v in memory, ``shards`` times a device's block, with their copy in
    global order and their gradients (or, on the steps, float32 gradients). With grouped
    heads (K < N) that is small next to the queries, so all-gather wins while it fits
    `_GATHER_BUDGET`; with as many kv heads as query heads the ring, whose transfers hide
    behind each step's compute, is the default (cost model in docs/performance-history.md).
    Measured on two H200s (N32 K8, causal, forward+backward, T = 32768 and 65536):
    all-gather 2.5-3 % faster than the ring, 10-20 % with 16 documents.
    """
    b, _, kv_len, heads, kv_heads, head_dim = request.shape
    if kv_heads == heads or shards <= 1:
        return "ring"
    itemsize = jnp.dtype(request.k.dtype).itemsize
    # k and v: gathered, in global order, their gradients and those cut into device
    # blocks (one call), or gathered and float32 gradients (steps)
    gathered = b * kv_len * kv_heads * head_dim * 2 * max(4 * itemsize, itemsize + 4)
    return "all_gather" if gathered <= _GATHER_BUDGET else "ring"


# The contiguous split is taken with segment ids when its busiest device has at most this
# many times the work of zigzag's: the exchange it saves moves a query block and its
# output each way (and their gradients), 25 % of the two-GPU time with 16 documents at
# T = 65536 (docs/performance-history.md, "Context parallelism: the notes of the fourth to
# twenty-fourth sessions").
_CONTIGUOUS_BALANCE = 1.1

# The request's fields that `ring_attention` takes by the same name.
_RING_OPTIONS = (
    "softmax_scale",
    "causal",
    "sliding_window",
    "logits_soft_cap",
    "softmax_sinks",
    "segment_ids",
    "dropout_rate",
    "dropout_seed",
)


def _zigzag_fits(request: AttentionRequest, shards: int) -> bool:
    _, q_len, kv_len, *_ = request.shape
    return request.causal and q_len == kv_len and q_len % (2 * shards) == 0


def _contiguous_balanced(q_ids: Any, *, seq_axis: Any, batch_axis: Any, shards: int) -> Any:
    """Whether the contiguous split balances causal self-attention with these documents:
    its busiest device's work (`causal_shard_work`, from every device's ids) within
    `_CONTIGUOUS_BALANCE` of the zigzag layout's. Inside the ``shard_map``; the same on
    every device (the counts are summed over the batch shards), so each takes the same
    branch."""
    ids = jax.lax.all_gather(q_ids, seq_axis, axis=1, tiled=True)
    work = jnp.stack([causal_shard_work(ids, shards, zigzag=z) for z in (False, True)])
    if batch_axis is not None:
        work = jax.lax.psum(work, batch_axis)
    return jnp.max(work[0]) <= _CONTIGUOUS_BALANCE * jnp.max(work[1])


def context_call(
    request: AttentionRequest,
    *,
    mesh: Any,
    batch_axis: Any,
    seq_axis: Any,
    head_axis: Any,
    shards: int,
    shard_map: Any,
    strategy: str | None = None,
    implementation: tuple[str, ...] | None = None,
) -> Any:
    """``request`` with T and S split over ``seq_axis`` (and B, N as given), run by
    `ring_attention` in a ``shard_map`` with ``strategy`` (default `choose_strategy`'s)
    on the steps `pick_implementation` picks from the facade's ``implementation``.

    Causal self-attention takes the zigzag layout; where all-gather runs one call per
    device (`one_call_serves`), only the queries are laid out so (the keys, gathered
    anyway, stay in the contiguous split: no exchange for them or their gradients). With
    segment ids, a ``lax.cond`` keeps the contiguous split where it is about as balanced
    (`_contiguous_balanced`).

    Packed self-attention (``cu_seqlens_q`` alone) runs as the segment ids it describes
    (sequence index, -1 past the last sequence): with one ``cu_seqlens`` for queries and
    keys, causal and window on packed positions are the same masks within each sequence.

    Raises:
        NotImplementedError: a bias, or packed input with its own ``cu_seqlens_k`` or with
            segment ids, which the sequence-parallel path does not serve (the reason names it).
    """
    packed = request.cu_seqlens_q is not None
    for name, present in (
        ("a bias", request.bias is not None),
        (
            "packed input with cu_seqlens_k or segment ids (pass cu_seqlens_q alone)",
            packed
            and (
                request.segment_ids is not None or request.cu_seqlens_k is not request.cu_seqlens_q
            ),
        ),
    ):
        if present:
            raise NotImplementedError(
                f"a sequence-sharded call (in_specs shards T over {seq_axis!r}) does not "
                f"serve {name} yet; pass segment ids for documents, or shard B and N only"
            )
    if packed:
        request = dataclasses.replace(
            request, segment_ids=packed_segment_ids(request), cu_seqlens_q=None, cu_seqlens_k=None
        )
    zigzag = _zigzag_fits(request, shards)
    strategy = strategy or choose_strategy(request, shards)
    seq = PartitionSpec(batch_axis, seq_axis, head_axis, None)
    ids = PartitionSpec(batch_axis, seq_axis)

    arrays: dict[str, Any] = {"q": request.q, "k": request.k, "v": request.v}
    specs: dict[str, Any] = {"q": seq, "k": seq, "v": seq}
    if request.softmax_sinks is not None:
        arrays["softmax_sinks"] = request.softmax_sinks
        specs["softmax_sinks"] = PartitionSpec(head_axis)
    if request.segment_ids is not None:
        arrays["segment_ids"] = tuple(request.segment_ids)
        specs["segment_ids"] = (ids, ids)
    add_traced_seed(request, arrays, specs)
    lse_spec = PartitionSpec(batch_axis, head_axis, seq_axis)

    def in_layout(local: dict[str, Any], zigzag: bool) -> Any:
        def lay(x: Any, axis: int = 1) -> Any:
            return to_zigzag_local(x, axis_name=seq_axis, shards=shards, axis=axis) if zigzag else x

        def unlay(x: Any, axis: int = 1) -> Any:
            return (
                from_zigzag_local(x, axis_name=seq_axis, shards=shards, axis=axis) if zigzag else x
            )

        r = dataclasses.replace(request, **local)
        steps = pick_implementation(implementation, r)
        keys_zigzag = zigzag and not one_call_serves(r, strategy, steps)
        lay_keys = lay if keys_zigzag else (lambda x: x)
        local = {
            **local,
            "q": lay(local["q"]),
            "k": lay_keys(local["k"]),
            "v": lay_keys(local["v"]),
        }
        if "segment_ids" in local:
            q_ids, kv_ids = local["segment_ids"]
            local["segment_ids"] = (lay(q_ids), lay_keys(kv_ids))
        r = dataclasses.replace(request, **local)
        options = {name: getattr(r, name) for name in _RING_OPTIONS}
        # B and N shards hash their global indices too (the ring adds rows and keys).
        offsets = (shard_start(batch_axis, r.q.shape[0]), shard_start(head_axis, r.q.shape[2]))
        out, lse = ring_attention(
            r.q, r.k, r.v, axis_name=seq_axis, return_lse=True, strategy=strategy,
            layout="zigzag" if zigzag else "contiguous",
            kv_layout="zigzag" if keys_zigzag else "contiguous",
            implementation=steps, dropout_offsets=offsets, **options,
        )  # fmt: skip
        return unlay(out), unlay(lse, axis=2)

    def per_shard(local: dict[str, Any]) -> Any:
        if not (zigzag and "segment_ids" in local):
            return in_layout(local, zigzag)
        balanced = _contiguous_balanced(
            local["segment_ids"][0], seq_axis=seq_axis, batch_axis=batch_axis, shards=shards
        )
        contiguous, zigzagged = (functools.partial(in_layout, zigzag=z) for z in (False, True))
        return jax.lax.cond(balanced, contiguous, zigzagged, local)

    mapped = shard_map(per_shard, mesh=mesh, in_specs=(specs,), out_specs=(seq, lse_spec))
    out, lse = mapped(arrays)
    return (out, lse) if request.return_lse else out
