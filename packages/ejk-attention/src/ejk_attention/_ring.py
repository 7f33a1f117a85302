"""Context parallelism: attention over a sequence split across devices, inside ``shard_map``.

Each of the ``n`` devices on ``axis_name`` holds a block of the queries and one of the
keys/values, contiguous (device d: ``[d T, (d+1) T)``) or in the zigzag layout
(chunks d and 2n-1-d, `ejk_sequtils.to_zigzag`), which balances causal work. Two
strategies bring the other devices' key blocks:

- ``"ring"``: the k/v blocks travel round the ring with ``ppermute`` (device d sends to
  d + 1), so at step s device d holds the block of device ``d - s``. The next block's
  ``ppermute`` is issued before the step's compute, so the transfer overlaps it (Liu et
  al. 2023, "Ring Attention with Blockwise Transformers", Sec. 3).
- ``"all_gather"``: keys and values are gathered once (as Llama 3's context
  parallelism does; cheaper when K is small, as with GQA) and the backward
  reduce-scatters dk/dv. On the kernels a device's rows then go in one call against the
  whole sequence (`_context_gathered`); with XLA einsums or dropout the steps read the
  gathered blocks.

Every step runs the calls of `_context_plan.step_plan` (masks on global positions;
hidden blocks skipped with ``lax.switch``) through the Triton kernels
(`ejk_kernels_gpu.context`) or XLA einsums (`_context_calls`); partial results merge
through the log-sum-exp. With dropout every call is one query chunk against one key
chunk and hashes their global positions (`ejk_sequtils.dropout_key`), so the devices
drop what one device running the whole sequence would. The backward (custom VJP) runs
the same steps: each call's dq/dk/dv from the saved GLOBAL output and lse
(FlashAttention-2, Alg. 2, with the row statistics of the whole row); dq accumulates in
place, while each step's dk and dv of another device's block go straight to that device
in the inputs' dtype (ring, `_send_home`) or are reduce-scattered (all-gather).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jaxtyping import Float, Int, Integer

from ejk_sequtils import dropout_key, validate_attention, varying_like

from ._backends import BACKENDS, triton_missing
from ._context_calls import CallMasks, call_backward, call_forward, merge
from ._context_gathered import gathered_backward, gathered_forward, gathers_kv_pair
from ._context_plan import LAYOUTS, Call, Layout, put_rows, step_plan, take_rows

__all__ = [
    "STRATEGIES",
    "Placement",
    "device_backward",
    "device_forward",
    "one_call_serves",
    "pick_implementation",
    "ring_attention",
]

AnyArray = Array | np.ndarray
_F32 = jnp.float32
STRATEGIES = ("ring", "all_gather")
IMPLEMENTATIONS = ("triton", "xla")


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The static (hashable) part of a context-parallel call."""

    axis_name: Any
    masks: CallMasks
    strategy: str
    zigzag: bool
    kv_zigzag: bool | None = None  # the keys' layout where it differs (one call only)


def _ring_size(axis_name: Any) -> int:
    return jax.lax.psum(1, axis_name)


def _shift(tree: Any, axis_name: Any, size: int) -> Any:
    """Send every array of ``tree`` to the next device on the ring."""
    perm = [(d, (d + 1) % size) for d in range(size)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), tree)


def _gather(tree: Any, axis_name: Any) -> Any:
    """Every device's block of ``tree``, stacked on a new leading axis (device order)."""
    return jax.tree.map(lambda x: jax.lax.all_gather(x, axis_name), tree)


def _block_of(gathered: Any, source: Array) -> Any:
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, source, keepdims=False), gathered)


def _ids_of(call: Call, q_ids: Any, kv_ids: Any) -> Any:
    if q_ids is None:
        return None
    return take_rows(q_ids, call.q), take_rows(kv_ids, call.k)


def _documents_meet(ids: tuple[Array, Array]) -> Array:
    """False when no query id equals a key id (their ranges of non-negative ids are apart)."""
    q_ids, k_ids = ids
    big = jnp.iinfo(jnp.int32).max
    lowest = lambda x: jnp.min(jnp.where(x >= 0, x, big))
    return (lowest(q_ids) <= jnp.max(k_ids)) & (lowest(k_ids) <= jnp.max(q_ids))


def _unless_apart(call: Call, q_ids, kv_ids, run_call, carry, always: bool):
    """``run_call(call, carry)``, skipped (``lax.cond``) when the call's query and key
    blocks hold no common document: with documents shorter than a shard most pairs of
    blocks are, and their kernels and merges would do nothing. ``always``: run it without
    the test (the own block, whose documents meet; each ``lax.cond`` sends its predicate
    to the host, and the GPU idles while the host catches up)."""
    ids = _ids_of(call, q_ids, kv_ids)
    if ids is None or always:
        return run_call(call, carry)
    carry = varying_like(carry, *ids)  # both branches must carry the ids' varying axes
    return jax.lax.cond(_documents_meet(ids), lambda c: run_call(call, c), lambda c: c, carry)


def _branch_runner(run_call, q_ids, kv_ids, own: bool):
    """``run_branch(branch, carry)``: the calls of a branch of a step plan, each run or
    skipped by `_unless_apart` (``own``: the step holds the device's own block, whose calls
    always run; the first call, which starts the carry where it covers every row, is one)."""

    def run_branch(branch, carry):
        for call in branch:
            carry = _unless_apart(call, q_ids, kv_ids, run_call, carry, always=own)
        return carry

    return run_branch


def _run_plan(plan, run_branch, carry):
    """Carry through every ``(index, branches)`` of a step plan (``lax.switch`` where the
    branch depends on the devices)."""
    for index, branches in plan:
        if index is None:
            carry = run_branch(branches[0], carry)
            continue
        fns = [functools.partial(run_branch, br) for br in branches]
        carry = jax.lax.switch(index, fns, carry)
    return carry


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a device sits: its index ``me`` on an axis of ``size`` devices, and the key
    blocks of every device stacked in device order (``gathered``: all-gather), or None
    (ring: blocks arrive by ``ppermute``)."""

    me: Any
    size: int
    gathered: Any = None


def _placement(st: _Ring, kv: Any, pair: bool = False) -> Placement:
    """``pair``: gather k and v as one array (`gathered_forward`'s ``(pair, None, ids)``)."""
    if st.strategy != "all_gather":
        return Placement(_axis_index(st), _ring_size(st.axis_name))
    if pair:
        k, v, ids = kv
        kv = (jnp.concatenate([k, v], axis=-1), None, ids)
    return Placement(_axis_index(st), _ring_size(st.axis_name), _gather(kv, st.axis_name))


def _axis_index(st: _Ring) -> Array:
    return jax.lax.axis_index(st.axis_name)


def _step_blocks(st: _Ring, where: Placement, kv: Any, step: int) -> tuple[Any, Any, Any]:
    """``(source, kv, next_kv)`` of a step: the block it holds, and for the ring the
    transfer of the next one, issued here, before the step's compute (it does not depend
    on it)."""
    source = (where.me - step) % where.size
    nxt = None
    if where.gathered is not None:
        kv = kv if step == 0 else _block_of(where.gathered, source)
    elif step < where.size - 1:
        nxt = _shift(kv, st.axis_name, where.size)
    return source, kv, nxt


def _step(st: _Ring, where: Placement, layout: Layout, kv: Any, step: int) -> tuple:
    """``(source, kv, next_kv, plan, q_offsets, k_offsets)`` of one step (`_step_blocks`,
    `step_plan` and the global offsets of the query and key chunks)."""
    source, kv, nxt = _step_blocks(st, where, kv, step)
    plan = step_plan(
        st.masks.causal, st.masks.window, layout, where.me, source, step == 0, _by_chunks(st)
    )
    q_offs = layout.offsets(where.me, layout.q_len)
    k_offs = layout.offsets(source, layout.kv_len)
    return source, kv, nxt, plan, q_offs, k_offs


def _by_chunks(st: _Ring) -> bool:
    """Calls of one chunk each: dropout keys each call by its chunks' global offsets."""
    return st.masks.dropout_rate > 0.0


def _call_key(drop: Array | None, call: Call, q_offs: list, k_offs: list) -> Array | None:
    """The call's `ejk_sequtils.dropout_key` (``drop``: uint32 ``[seed, b0, n0]``, or None):
    with dropout the plan calls whole chunks (`_by_chunks`), so the chunks' global offsets
    are the call's first row and first key."""
    if drop is None:
        return None
    return dropout_key(drop[0], (drop[1], drop[2], q_offs[call.q_chunk], k_offs[call.k_chunk]))


def _layout(st: _Ring, where: Placement, q: Array, k: Array) -> Layout:
    return Layout(
        size=where.size,
        zigzag=st.zigzag,
        q_len=q.shape[1],
        kv_len=k.shape[1],
        keys_zigzag=st.kv_zigzag,
    )


def _gathers_in_one_call(strategy: str, kernels: bool, dropout_rate: float) -> bool:
    """All-gather on the kernels: the device's rows against the whole gathered sequence
    in one call (`_context_gathered`); dropout keeps the steps (one offset per call)."""
    return strategy == "all_gather" and kernels and dropout_rate == 0.0


def _runs_one_call(st: _Ring) -> bool:
    return _gathers_in_one_call(st.strategy, st.masks.kernels, st.masks.dropout_rate)


def _one_call(st: _Ring, where: Placement) -> bool:
    return where.gathered is not None and _runs_one_call(st)


def device_forward(
    st: _Ring, q, k, v, q_ids, kv_ids, where: Placement, drop: Array | None = None
) -> tuple[Array, Array]:
    """``(out, lse)`` of this device's queries: all-gather's one call (`_one_call`), or the
    steps of `step_plan` merged by lse."""
    layout = _layout(st, where, q, k)
    if _one_call(st, where):
        out, lse = gathered_forward(
            st.masks, layout, where.me, q, q_ids, where.gathered, own=(k, v, kv_ids)
        )
        return out.astype(q.dtype), lse
    b, t, n, _ = q.shape
    whole, in_dtype = _sums_start(st, layout, where)
    if whole:
        acc = (None, None)  # set by that call, no zeros to merge with
    else:
        acc = (jnp.zeros((b, t, n, v.shape[-1]), _F32), jnp.full((b, n, t), -jnp.inf, _F32))
        acc = varying_like(acc, q, k, v, q_ids, kv_ids)
    kv = (k, v, kv_ids)
    for step in range(where.size):
        _, kv, nxt, plan, q_offs, k_offs = _step(st, where, layout, kv, step)

        def run_call(call, acc, kv=kv, q_offs=q_offs, k_offs=k_offs):
            k, v, kv_ids = kv
            out, lse = acc
            part = call_forward(
                st.masks,
                call,
                take_rows(q, call.q),
                take_rows(k, call.k),
                take_rows(v, call.k),
                _ids_of(call, q_ids, kv_ids),
                q_offs[call.q_chunk],
                k_offs[call.k_chunk],
                _call_key(drop, call, q_offs, k_offs),
            )
            if out is None:  # the first call covers every row: it starts the merge
                return part[0] if in_dtype else part[0].astype(_F32), part[1]
            o, rows = merge((take_rows(out, call.q), take_rows(lse, call.q, 2)), part)
            return put_rows(out, call.q, o), put_rows(lse, call.q, rows, 2)

        run_branch = _branch_runner(run_call, q_ids, kv[2], own=step == 0)
        acc = _run_plan(plan, run_branch, acc)
        kv = nxt if where.gathered is None else kv
    out, lse = acc
    return out.astype(q.dtype), lse


def device_backward(
    st: _Ring, res, cts, where: Placement, drop: Array | None = None
) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` of this device (float32, or the inputs' dtype: from the one call of
    `_one_call`, or where at most one call follows the own block's, `_later_calls`): dk/dv
    of its own block (ring: with the other devices' shares, `_send_home`) or, with
    ``where.gathered``, of every device's block ``[size, B, S, K, H]``, not yet reduced
    over the devices."""
    q, k, v, q_ids, kv_ids, out, lse = res
    d_out, d_lse = cts
    layout = _layout(st, where, q, k)
    if _one_call(st, where):
        return gathered_backward(st.masks, layout, where.me, res, cts, where.gathered)
    kv = (k, v, kv_ids)

    def zeros(*shape, dtype=_F32):
        return varying_like(jnp.zeros(shape, dtype), q, k, v, q_ids, kv_ids, d_out)

    whole, in_dtype = _sums_start(st, layout, where)
    dq = None if whole else zeros(*q.shape)
    if where.gathered is None:
        dkv = (None, None) if whole else (zeros(*k.shape), zeros(*v.shape))  # the own block's
        arriving = []  # the other devices' shares of it
    else:
        dkv = (zeros(where.size, *k.shape), zeros(where.size, *v.shape))
    for step in range(where.size):
        source, kv, nxt, plan, q_offs, k_offs = _step(st, where, layout, kv, step)

        def run_call(call, carry, kv=kv, q_offs=q_offs, k_offs=k_offs):
            k, v, kv_ids = kv
            dq, dk, dv = carry
            gq, gk, gv = call_backward(
                st.masks,
                call,
                take_rows(q, call.q),
                take_rows(k, call.k),
                take_rows(v, call.k),
                take_rows(out, call.q),
                take_rows(lse, call.q, 2),
                take_rows(d_out, call.q),
                take_rows(d_lse, call.q, 2),
                _ids_of(call, q_ids, kv_ids),
                q_offs[call.q_chunk],
                k_offs[call.k_chunk],
                _call_key(drop, call, q_offs, k_offs),
            )
            if dq is None:  # the first call, over every row and key (`_whole_first_call`)
                dq = gq if in_dtype else gq.astype(_F32)
            else:
                dq = put_rows(dq, call.q, take_rows(dq, call.q) + gq.astype(_F32))
            if dk is None:
                return dq, gk, gv
            dk = put_rows(dk, call.k, take_rows(dk, call.k) + gk.astype(_F32))
            dv = put_rows(dv, call.k, take_rows(dv, call.k) + gv.astype(_F32))
            return dq, dk, dv

        run_branch = _branch_runner(run_call, q_ids, kv[2], own=step == 0)
        if where.gathered is None:
            if step == 0:
                dq, *dkv = _run_plan(plan, run_branch, (dq, *dkv))
            else:
                # a share of one call at most (in_dtype) is that call's, rounded as sent
                share = (zeros(*x.shape, dtype=x.dtype if in_dtype else _F32) for x in (k, v))
                dq, *share = _run_plan(plan, run_branch, (dq, *share))
                arriving.append(_send_home(st, share, (k.dtype, v.dtype), step, where.size))
            kv = nxt
        else:
            blocks = [jax.lax.dynamic_index_in_dim(x, source, keepdims=False) for x in dkv]
            dq, *blocks = _run_plan(plan, run_branch, (dq, *blocks))
            dkv = tuple(
                jax.lax.dynamic_update_index_in_dim(x, blk, source, 0)
                for x, blk in zip(dkv, blocks, strict=True)
            )
    if where.gathered is None:
        dkv = tuple(sum((a[i].astype(_F32) for a in arriving), dkv[i]) for i in range(2))
    return dq, *dkv


def _sums_start(st: _Ring, layout: Layout, where: Placement) -> tuple[bool, bool]:
    """``(whole, in_dtype)``: whether the own block's call covers every row and key, so
    that its output (or gradients) start the sums instead of zeros (`_whole_first_call`);
    and whether at most one call follows it, so that the sums stay in the inputs' dtype:
    the one merge or addition is rounded once, as the final cast would (no float32 pass
    in and out of them)."""
    whole = _whole_first_call(st, layout, where)
    return whole, whole and _later_calls(st, layout, where.size) <= 1


def _whole_first_call(st: _Ring, layout: Layout, where: Placement) -> bool:
    """Whether the first step (the own block) is one call, unconditional, over every query
    row and key of the device."""
    first = step_plan(
        st.masks.causal, st.masks.window, layout, where.me, where.me, True, _by_chunks(st)
    )
    if len(first) != 1 or first[0][0] is not None or len(first[0][1][0]) != 1:
        return False
    call = first[0][1][0][0]
    whole = lambda rows, n: isinstance(rows, slice) and (rows.start, rows.stop) == (0, n)
    return whole(call.q, layout.q_len) and whole(call.k, layout.kv_len)


def _later_calls(st: _Ring, layout: Layout, size: int) -> int:
    """The most calls the steps after the first can make (each step's largest branches;
    the counts do not depend on the devices' indices)."""
    calls = 0
    for step in range(1, size):
        me, source = jnp.int32(step), jnp.int32(0)
        plan = step_plan(
            st.masks.causal, st.masks.window, layout, me, source, False, _by_chunks(st)
        )
        calls += sum(max(len(branch) for branch in branches) for _, branches in plan)
    return calls


def _send_home(st: _Ring, share: Any, dtypes: Any, step: int, size: int) -> Any:
    """The ring backward's step-``step`` share of another block's dk/dv, sent straight to
    the block's owner (``step`` devices back) in the inputs' dtypes: ``size - 1`` transfers
    of a block in all, against ``size`` float32 hops for gradients that travel with their
    block; the owner sums its shares in float32, as all-gather's reduce-scatter does."""
    perm = [(d, (d - step) % size) for d in range(size)]
    return tuple(
        jax.lax.ppermute(x.astype(dtype), st.axis_name, perm)
        for x, dtype in zip(share, dtypes, strict=True)
    )


def _placed_forward(st: _Ring, q, k, v, q_ids, kv_ids, drop) -> tuple[tuple[Array, Array], Any]:
    """``((out, lse), gathered)``: the forward and, with all-gather, every device's
    ``(k, v, kv_ids)`` it read (k and v as one array, ``(pair, None, kv_ids)``, where the
    kernels' one call serves documents: `gathers_kv_pair`)."""
    where = _placement(st, (k, v, kv_ids), pair=_runs_one_call(st) and gathers_kv_pair(q_ids))
    return device_forward(st, q, k, v, q_ids, kv_ids, where, drop), where.gathered


def _forward(st: _Ring, q, k, v, q_ids, kv_ids, drop) -> tuple[Array, Array]:
    return _placed_forward(st, q, k, v, q_ids, kv_ids, drop)[0]


def _backward(st: _Ring, res, cts) -> tuple:
    *res, drop, gathered = res
    q, k, v, *_ = res
    where = Placement(_axis_index(st), _ring_size(st.axis_name), gathered)
    dq, dk, dv = device_backward(st, tuple(res), cts, where, drop)
    if where.gathered is not None:  # each device's share of every block, to the block's owner
        dk, dv = _reduce_scatter(dk, dv, st.axis_name, joint=_one_call(st, where))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


def _reduce_scatter(dk: Array, dv: Array, axis_name: Any, joint: bool) -> tuple[Array, Array]:
    """dk and dv ``[n, ...]`` summed over the devices, block i to device i. ``joint``: in
    one reduce-scatter of the two side by side, where they are the halves of one array
    (all-gather's one call, `gathered_backward`: the concatenation is that array, no copy).
    XLA keeps one collective of a kind in flight, so of two reduce-scatters only one hides
    behind the dq kernel; the other ran exposed (two H200s, T = 65536: 0.3-0.4 ms)."""
    if not joint:  # float32 sums of the steps: joining them would copy both
        return tuple(jax.lax.psum_scatter(x, axis_name, scatter_dimension=0) for x in (dk, dv))
    both = jax.lax.psum_scatter(jnp.concatenate([dk, dv], axis=-1), axis_name, scatter_dimension=0)
    return both[..., : dk.shape[-1]], both[..., dk.shape[-1] :]


def _add_sinks(out: Array, lse: Array, sinks: Array) -> tuple[Array, Array]:
    """Put the sink logits into the softmax denominator: rescale ``out``, extend ``lse``.

    Plain jnp outside the custom VJP, so autodiff (and shard_map's replication
    rules for the replicated sinks) give their gradient; the ring's lse cotangent
    carries it back into q and k.
    """
    new_lse = jnp.logaddexp(lse, sinks.astype(_F32)[None, :, None])
    factor = jnp.exp(lse - new_lse).transpose(0, 2, 1)[..., None]  # 0 where lse = -inf
    return (out.astype(_F32) * factor).astype(out.dtype), new_lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(st: _Ring, q, k, v, q_ids, kv_ids, drop):
    return _forward(st, q, k, v, q_ids, kv_ids, drop)


def _ring_fwd(st: _Ring, q, k, v, q_ids, kv_ids, drop):
    # All-gather keeps the gathered blocks for the backward rather than gathering them
    # again: in one program XLA would merge the two gathers, but not where the forward and
    # the backward run in branches of their own (the facade's `lax.cond` on the layout).
    (out, lse), gathered = _placed_forward(st, q, k, v, q_ids, kv_ids, drop)
    return (out, lse), (q, k, v, q_ids, kv_ids, out, lse, drop, gathered)


_ring.defvjp(_ring_fwd, _backward)


def one_call_serves(request: Any, strategy: str, implementation: str | None = None) -> bool:
    """Whether `ring_attention` with these arguments runs all-gather's one call per device
    (`_context_gathered`): the Triton kernels serve the call and there is no dropout."""
    if strategy != "all_gather" or request.dropout_rate > 0.0:
        return False  # before `_use_kernels`, which imports the kernels and may refuse
    return _gathers_in_one_call(
        strategy, _use_kernels(implementation, request), request.dropout_rate
    )


def pick_implementation(names: tuple[str, ...] | None, request: Any) -> str | None:
    """The steps' ``implementation`` for a facade call asking for ``names`` (its
    ``implementation`` resolved; None: the platform's pick): the first of ``"triton"`` and
    ``"xla"`` among them that serves the call.

    Raises:
        NotImplementedError: ``names`` holds neither, or only a Triton that cannot serve
            the call (the reason).
    """
    if names is None:
        return None
    served = [name for name in names if name in IMPLEMENTATIONS]
    if not served:
        raise NotImplementedError(
            f"a sequence-sharded call runs ring_attention's steps on {IMPLEMENTATIONS}; "
            f"implementation={names} names neither"
        )
    for name in served[:-1]:
        try:
            _use_kernels(name, request)
        except NotImplementedError:
            continue
        return name
    _use_kernels(served[-1], request)  # raises with the reason where it cannot serve
    return served[-1]


def _use_kernels(implementation: str | None, request: Any) -> bool:
    """Whether the steps run the Triton kernels (``implementation``: None picks them on GPU
    when they serve the call)."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}"
        )
    if implementation == "xla":  # (`_backends.XlaBackend.context_steps`: einsums)
        return False
    if triton_missing():
        if implementation == "triton":
            raise NotImplementedError(f"ring_attention: {triton_missing()}")
        return False
    reason = BACKENDS["triton"].context_reason(request)  # its steps: the block kernels
    if implementation == "triton":
        if reason is not None:
            raise NotImplementedError(
                f"ring_attention's Triton steps cannot serve this call: {reason}"
            )
        return True
    return reason is None and jax.default_backend() == "gpu"


def ring_attention(
    q: Float[AnyArray, "B T N H"],
    k: Float[AnyArray, "B S K H"],
    v: Float[AnyArray, "B S K Hv"],
    *,
    axis_name: Any,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    softmax_sinks: Float[AnyArray, " N *num_sinks"] | None = None,
    segment_ids: Int[AnyArray, "B T"]
    | tuple[Int[AnyArray, "B T"], Int[AnyArray, "B S"]]
    | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: int | Integer[AnyArray, ""] | None = None,
    dropout_offsets: tuple[int | Integer[AnyArray, ""], int | Integer[AnyArray, ""]] = (0, 0),
    return_lse: bool = False,
    strategy: str = "ring",
    layout: str = "contiguous",
    kv_layout: str | None = None,
    implementation: str | None = None,
) -> Float[Array, "B T N Hv"] | tuple[Float[Array, "B T N Hv"], Float[Array, "B N T"]]:
    """Context-parallel attention; call it inside ``shard_map`` with T and S sharded over ``axis_name``.

    The arguments are this device's blocks of the global sequence: with
    ``layout="contiguous"`` device d holds queries ``[d * T, (d + 1) * T)`` and keys
    ``[d * S, (d + 1) * S)``; with ``layout="zigzag"`` it holds chunks d and 2n-1-d of
    each (`ejk_sequtils.to_zigzag` lays a global array out so). Masks (causal, window,
    segment ids) apply to global positions. The result equals `reference_attention` on
    the gathered inputs, and so do its gradients.

    Args:
        q: this device's queries ``[B, T, N, H]``.
        k: this device's keys ``[B, S, K, H]``, ``N % K == 0``.
        v: this device's values ``[B, S, K, Hv]``.
        axis_name: the ``shard_map`` mesh axis the sequence is split over.
        softmax_scale: default ``H ** -0.5``.
        causal: global query i sees global keys ``j <= i``.
        sliding_window: ``(left, right)`` or ``w``, in global positions.
        logits_soft_cap: ``cap * tanh(logits / cap)``.
        softmax_sinks: ``[N]`` or ``[N, num_sinks]`` per-head sink logits (replicated on the ring).
        segment_ids: this device's ``[B, T]`` ids (self attention, T == S) or the pair
            ``(q_ids [B, T], kv_ids [B, S])``; the kv ids travel with their block.
        dropout_rate: probability of dropping an attention weight; the keep-mask hashes
            global positions (`ejk_sequtils.dropout_keep_mask`), so the devices drop what
            one device running the whole sequence would.
        dropout_seed: an int or int32/uint32 scalar (the same on every device); required
            when ``dropout_rate > 0``.
        dropout_offsets: ``(batch, head)``: the global index of this device's first batch
            row and first query head, where the ``shard_map`` also splits B or N (the
            hash takes global indices); ``(0, 0)`` otherwise.
        return_lse: also return the float32 lse ``[B, N, T]`` of the local rows.
        strategy: ``"ring"`` (k/v blocks travel, overlapped with compute) or
            ``"all_gather"`` (k/v gathered once, dk/dv reduce-scattered).
        layout: ``"contiguous"`` or ``"zigzag"`` (T and S even).
        kv_layout: the keys' (and values', kv ids') layout, default ``layout``. Another
            one only where all-gather runs a device's rows in one call (``strategy=
            "all_gather"`` on the Triton kernels, no dropout; see `one_call_serves`):
            after the gather only the queries' split matters, so zigzag queries with
            contiguous keys balance causal work without laying the keys out.
        implementation: ``"triton"`` (the flash kernels per step), ``"xla"`` (einsums),
            or None: Triton on GPU where it serves the call, else XLA.

    Returns:
        This device's output block ``[B, T, N, Hv]`` (and its lse).

    Raises:
        ValueError: a bad argument (named).
        NotImplementedError: ``implementation="triton"`` where the kernels cannot serve
            the call (the reason).
    """
    request = validate_attention(
        q,
        k,
        v,
        softmax_scale=softmax_scale,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        softmax_sinks=softmax_sinks,
        segment_ids=segment_ids,
        dropout_rate=dropout_rate,
        dropout_seed=dropout_seed,
        return_lse=return_lse,
    )
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    kv_layout = layout if kv_layout is None else kv_layout
    for name, value in (("layout", layout), ("kv_layout", kv_layout)):
        if value not in LAYOUTS:
            raise ValueError(f"{name} must be one of {LAYOUTS}, got {value!r}")
    t, s_len = request.q.shape[1], request.k.shape[1]
    if (layout == "zigzag" and t % 2) or (kv_layout == "zigzag" and s_len % 2):
        raise ValueError(
            f"layout='zigzag' holds two equal chunks per device; local lengths {t=} and "
            f"S={s_len} must be even (layout={layout!r}, kv_layout={kv_layout!r})"
        )
    masks = CallMasks(
        scale=request.softmax_scale,
        causal=request.causal,
        window=request.sliding_window,
        soft_cap=request.logits_soft_cap,
        kernels=_use_kernels(implementation, request),
        dropout_rate=request.dropout_rate,
    )
    if kv_layout != layout and not _gathers_in_one_call(
        strategy, masks.kernels, masks.dropout_rate
    ):
        raise ValueError(
            f"kv_layout={kv_layout!r} differs from layout={layout!r}: only all-gather's one "
            f"call reads keys in their own layout (strategy='all_gather' on the Triton "
            f"kernels, no dropout); got strategy={strategy!r}, "
            f"implementation={implementation!r}, dropout_rate={request.dropout_rate}"
        )
    st = _Ring(
        axis_name=axis_name,
        masks=masks,
        strategy=strategy,
        zigzag=layout == "zigzag",
        kv_zigzag=None if kv_layout == layout else kv_layout == "zigzag",
    )
    q_ids, kv_ids = request.segment_ids or (None, None)
    drop = None
    if request.dropout_rate > 0.0:  # [seed, b0, n0]; each call adds its rows' and keys' origin
        drop = dropout_key(request.dropout_seed, (*dropout_offsets, 0, 0))[:3]
    out, lse = _ring(st, request.q, request.k, request.v, q_ids, kv_ids, drop)
    if request.softmax_sinks is not None:
        out, lse = _add_sinks(out, lse, request.softmax_sinks)
    return (out, lse) if request.return_lse else out
