"""Which kernel calls one step of context parallelism makes: the static plan.

At step ``s`` device ``d`` holds its queries and the key block of device ``source``
(``d - s`` on the ring; any device's with all-gather). Each side is laid out as one
contiguous chunk or, in the zigzag layout, two chunks ``i`` and ``2n - 1 - i`` of half
the length (`ejk_sequtils.to_zigzag`). Chunks sit at global offsets that depend on the
traced device index, so a step is a choice, taken at run time with ``lax.switch``,
between a few static lists of `Call`s on static slices:

- ``"full"``: every query of the slice sees every key (plain non-causal call);
- ``"causal"``: the slices are the same positions (the causal diagonal, local indices);
- ``"relative"``: anything else visible: masks on global positions (the packed path of
  the kernels, `ejk_kernels_gpu.context`);
- no call at all when the mask hides the pair.

Causal self-attention with equal chunks (contiguous or zigzag, no window) has a plan of
one call per step on the fast builds: the own block is causal on local indices (local
order follows global order), and every other block is, for the zigzag layout, either
all queries against the early key chunk (source before d) or the late query chunk
against all keys (source after d), the same amount of work either way (Brandon et al.
2023, "Striped attention"; Liu et al. 2023; the zigzag of Zhu's ring-flash-attention).
Other masks (windows, T != S) go pair by pair of chunks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

__all__ = ["Call", "Layout", "put_rows", "step_plan", "take_rows"]

LAYOUTS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the sequence is split over the ``size`` devices of the axis."""

    size: int
    zigzag: bool
    q_len: int  # local query rows
    kv_len: int  # local key rows
    keys_zigzag: bool | None = None  # the keys' own layout (all-gather's one call); None: same

    @property
    def kv_zigzag(self) -> bool:
        return self.zigzag if self.keys_zigzag is None else self.keys_zigzag

    @property
    def chunks(self) -> int:
        return 2 if self.zigzag else 1

    def q_chunks(self) -> list[slice]:
        c = self.q_len // self.chunks
        return [slice(i * c, (i + 1) * c) for i in range(self.chunks)]

    def k_chunks(self) -> list[slice]:
        c = self.kv_len // self.chunks
        return [slice(i * c, (i + 1) * c) for i in range(self.chunks)]

    def offsets(self, device: Any, length: int) -> list[Array]:
        """Global offsets of the chunks a device holds (``length``: its local rows)."""
        device = jnp.asarray(device, jnp.int32)
        if not self.zigzag:
            return [device * length]
        c = length // 2
        return [device * c, (2 * self.size - 1 - device) * c]


Rows = slice | tuple[Any, int]  # static rows, or (traced start, static length)


@dataclasses.dataclass(frozen=True)
class Call:
    """One kernel call of a step: local query rows ``q``, local key rows ``k`` (`Rows`),
    its kind, and which query and key chunks they lie in (for a relative call's offsets)."""

    q: Rows
    k: Rows
    kind: str  # "full" | "causal" | "relative"
    q_chunk: int = 0
    k_chunk: int = 0


def take_rows(x: Array, rows: Rows, axis: int = 1) -> Array:
    """The rows ``rows`` of ``x`` along ``axis``."""
    if isinstance(rows, slice):
        return jax.lax.slice_in_dim(x, rows.start, rows.stop, axis=axis)
    start, length = rows
    return jax.lax.dynamic_slice_in_dim(x, start, length, axis=axis)


def put_rows(x: Array, rows: Rows, value: Array, axis: int = 1) -> Array:
    """``x`` with the rows ``rows`` along ``axis`` replaced by ``value``."""
    start = rows.start if isinstance(rows, slice) else rows[0]
    return jax.lax.dynamic_update_slice_in_dim(x, value.astype(x.dtype), start, axis)


def _fast_causal(causal: bool, window: Any, layout: Layout) -> bool:
    return causal and window is None and layout.q_len == layout.kv_len


def _pair_status(
    causal: bool, window: Any, q_off: Array, q_len: int, k_off: Array, k_len: int
) -> Array:
    """int32: 0 hidden, 1 fully visible, 2 causal diagonal, 3 partly visible."""
    q_last, k_last = q_off + q_len - 1, k_off + k_len - 1
    hidden = jnp.asarray(q_len == 0 or k_len == 0)
    full = jnp.asarray(True)
    if causal:
        hidden |= k_off > q_last
        full &= k_last <= q_off
    if window is not None:
        left, right = window
        hidden |= (k_last < q_off - left) | (k_off > q_last + right)
        full &= (k_off >= q_last - left) & (k_last <= q_off + right)
    diagonal = jnp.asarray(causal and window is None and q_len == k_len) & (q_off == k_off)
    return jnp.where(hidden, 0, jnp.where(full, 1, jnp.where(diagonal, 2, 3))).astype(jnp.int32)


def _fast_plan(causal, window, layout: Layout, me, source, own_block: bool):
    """The one-call plans of unmasked and of causal self-attention (see `step_plan`), or
    None for other masks."""
    everything = (Call(slice(0, layout.q_len), slice(0, layout.kv_len), "full"),)
    if not causal and window is None:
        return [(None, (everything,))]
    if not _fast_causal(causal, window, layout):
        return None
    if own_block:  # local causal is exact: local order follows global order
        whole = (Call(slice(0, layout.q_len), slice(0, layout.kv_len), "causal"),)
        return [(None, (whole,))]
    me, source = jnp.asarray(me), jnp.asarray(source)
    if not layout.zigzag:
        return [(jnp.where(source < me, 1, 0).astype(jnp.int32), ((), everything))]
    # The late query chunk sees the early key chunk; and either the early queries see
    # the early keys (source before me) or the late queries the late keys (after):
    # chunk a of both, a traced. No branch, so no host round trip for a predicate.
    (q0, q1), (k0, _) = layout.q_chunks(), layout.k_chunks()
    a = jnp.where(source < me, 0, 1).astype(jnp.int32)
    cq, ck = q0.stop, k0.stop
    calls = (Call(q1, k0, "full"), Call((a * cq, cq), (a * ck, ck), "full"))
    return [(None, (calls,))]


def step_plan(
    causal: bool,
    window: tuple[int, int] | None,
    layout: Layout,
    me: Any,
    source: Any,
    own_block: bool,
    by_chunks: bool = False,
) -> list[tuple[Array | None, tuple[tuple[Call, ...], ...]]]:
    """The calls of one step: a list of ``(index, branches)``, each a ``lax.switch`` over
    static branches (tuples of `Call`s; an empty one skips); index None: the one branch
    runs unconditionally.

    Args:
        causal, window: the call's masks (global positions).
        layout: the split of the sequence.
        me: this device's index on the axis (traced).
        source: the device whose key block this step holds (traced).
        own_block: the step holds this device's own keys (``source == me``, statically).
        by_chunks: every call one query chunk against one key chunk (their rows sit at
            the chunks' global offsets: dropout hashes global positions), no fast plan.
    """
    fast = None if by_chunks else _fast_plan(causal, window, layout, me, source, own_block)
    if fast is not None:
        return fast
    plan = []
    q_offs = layout.offsets(me, layout.q_len)
    k_offs = layout.offsets(source, layout.kv_len)
    for a, qs in enumerate(layout.q_chunks()):
        for b, ks in enumerate(layout.k_chunks()):
            status = _pair_status(
                causal, window, q_offs[a], qs.stop - qs.start, k_offs[b], ks.stop - ks.start
            )
            branches = tuple((Call(qs, ks, kind, a, b),) for kind in ("full", "causal", "relative"))
            plan.append((status, ((), *branches)))
    return plan
