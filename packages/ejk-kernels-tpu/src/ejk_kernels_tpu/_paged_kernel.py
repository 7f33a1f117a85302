"""The ragged paged attention kernel (Pallas TPU) and its launch.

Both call forms arrive as one flattened batch of query rows: sequence ``b`` owns rows
``cu[b]:cu[b + 1]`` (its last tokens), its keys sit in the pages ``page_table[b]`` of the
pool and number ``kv_lens[b]``. Kernel layout: q and the output ``[K, G, R, H]`` (kv head,
query head of the group, row, head dim), so a grid step's block ``[K, G, block_q, H]``
holds every head of ``block_q`` consecutive rows; the rows of one kv head's group form
one ``[G * block_q, H]`` tile (row ``g * block_q + t``), and k/v are read once per group.

Grid ``(R / block_q,)``: step ``i`` walks the sequences that own rows of its block (from
the scalar-prefetched ``seq_lo``/``seq_hi``) and, for each, the kv blocks its rows can
see (causal bottom-right, the window's left edge), with an online softmax. A kv block is
``pages_per_block`` whole pages (all kv heads) copied from the pool in HBM by manual
async DMA into one of two VMEM slots; the next block's copy (the same sequence's next
block, else the next sequence's first) starts before the current block is computed. Rows of the block owned by another sequence, keys past ``kv_lens[b]``
and keys the rule hides are masked, so each row accumulates its own sequence's keys only.

FP8 pages (``kv_scales`` 1: one scale per pool, in SMEM; 2: one per stored token and kv
head, ``[P, page_size, K]`` copied with their pages into VMEM) are copied as e4m3 (half
the bytes of bf16) and dequantised in the kernel, ``page * scale`` in float32 then q's
dtype, before the block's matmuls (`ejk_sequtils.dequantize_kv`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._common import NN_DIMS, dot, logits

__all__ = ["PagedStatic", "paged_forward"]


@dataclasses.dataclass(frozen=True)
class PagedStatic:
    """Trace-time options of one launch.

    Attributes:
        kv_heads, group: K and the query heads per kv head G.
        page_size, pages_per_seq, num_pages: the pool and the table's width.
        block_q: rows per grid step; pages_per_block: pages per kv block.
        scale, soft_cap: softmax scale and the logits soft cap (or None).
        window_left: how far left of its position a query sees (None: no window).
        has_sinks: whether ``sinks`` f32 ``[N]`` is passed.
        kv_scales: 0 (pages in q's dtype), or fp8 pages with 1 (scalar scales, f32 ``[2]``
            in SMEM: k's, v's) or 2 (per-token scales ``[P, page_size, K]``, k's and v's).
        interpret: False on TPU, else the `pltpu.InterpretParams` to run with.
    """

    kv_heads: int
    group: int
    page_size: int
    pages_per_seq: int
    num_pages: int
    block_q: int
    pages_per_block: int
    scale: float
    soft_cap: float | None
    window_left: int | None
    has_sinks: bool
    interpret: Any
    kv_scales: int = 0

    @property
    def block_kv(self) -> int:
        """Keys per kv block."""
        return self.pages_per_block * self.page_size


def _cdiv(a: jax.Array, b: int) -> jax.Array:
    return jax.lax.div(a + (b - 1), jnp.int32(b))


class _PageCopies:
    """The DMAs of one kv block of one sequence into one VMEM slot (k and v, every page).

    Pages past the sequence's last one (``kv_len``) are neither read from the table nor
    copied; their slots keep stale data that the masks hide.
    """

    def __init__(self, st: PagedStatic, refs: dict[str, Any], seq: Any, kv_len: Any) -> None:
        self.st, self.refs, self.seq = st, refs, seq
        self.pages_used = jnp.minimum(_cdiv(kv_len, st.page_size), st.pages_per_seq)

    def _each(self, block: Any, slot: Any, action: str) -> None:
        st, r = self.st, self.refs
        for p in range(st.pages_per_block):
            index = block * st.pages_per_block + p

            @pl.when(index < self.pages_used)
            def _copy(p=p, index=index):
                page = r["page_table"][self.seq * st.pages_per_seq + index]
                page = jnp.clip(page, 0, st.num_pages - 1)  # traced tables are not checked
                names = ("k", "v", "ks", "vs") if st.kv_scales == 2 else ("k", "v")
                for kind, name in enumerate(names):
                    copy = pltpu.make_async_copy(
                        r[f"{name}_hbm"].at[page],
                        r[f"{name}_buf"].at[slot, p],
                        r["sem"].at[kind, slot],
                    )
                    getattr(copy, action)()

    def start(self, block: Any, slot: Any) -> None:
        self._each(block, slot, "start")

    def wait(self, block: Any, slot: Any) -> None:
        self._each(block, slot, "wait")


def _head_tile(buf: Any, slot: Any, head: int, st: PagedStatic) -> jax.Array:
    """kv head ``head`` of a slot ``[pages_per_block, page_size, K, H]``: ``[block_kv, H]``."""
    return buf[slot, :, :, head, :].reshape(st.block_kv, buf.shape[-1])


def _dequantized_tile(
    r: dict[str, Any], name: str, slot: Any, head: int, st: PagedStatic, dtype: Any
) -> jax.Array:
    """`_head_tile` of ``name`` ("k" or "v") in ``dtype``: fp8 pages times their scales
    (per token: the slot's ``[block_kv, 1]`` column of kv head ``head``; or the scalar)."""
    tile = _head_tile(r[f"{name}_buf"], slot, head, st)
    if st.kv_scales == 0:
        return tile
    if st.kv_scales == 2:
        scales = r[f"{name}s_buf"][slot, :, :, head : head + 1].reshape(st.block_kv, 1)
    else:
        scales = r["scales"][0 if name == "k" else 1]
    return (tile.astype(jnp.float32) * scales).astype(dtype)


class _Walk(NamedTuple):
    """What grid step ``i`` walks of sequence ``seq``: its kv blocks ``j0 <= j < j1`` (none
    when ``j1 <= j0``) and where its rows of the block sit.

    Attributes:
        seq: the sequence; the end of the walk's range may be one past the last sequence,
            whose scalars are then read from the last one (and never used).
        kv_len: its length; first_pos: the position of its first query row ``q0``.
        q0: its first row; lo, hi: its rows ``[lo, hi)`` inside the block.
        j0, j1: the kv blocks its rows of the block can see.
    """

    seq: Any
    kv_len: Any
    first_pos: Any
    q0: Any
    lo: Any
    hi: Any
    j0: Any
    j1: Any

    @classmethod
    def of(cls, r: dict[str, Any], st: PagedStatic, block_first: Any, seq: Any) -> _Walk:
        seq_ref = jnp.minimum(seq, r["kv_lens"].shape[0] - 1)  # no read past the tables
        q0, q1 = r["cu"][seq_ref], r["cu"][seq_ref + 1]
        kv_len = r["kv_lens"][seq_ref]
        first_pos = kv_len - (q1 - q0)
        lo, hi = jnp.maximum(q0, block_first), jnp.minimum(q1, block_first + st.block_q)
        kv_end = jnp.minimum(kv_len, first_pos + hi - q0)  # past the last row's position
        kv_begin = jnp.int32(0)
        if st.window_left is not None:
            kv_begin = jnp.maximum(first_pos + lo - q0 - st.window_left, 0)
        j0 = jax.lax.div(kv_begin, jnp.int32(st.block_kv))
        j1 = jnp.where((hi > lo) & (kv_end > kv_begin), _cdiv(kv_end, st.block_kv), j0)
        return cls(seq, kv_len, first_pos, q0, lo, hi, j0, j1)

    @property
    def empty(self) -> Any:
        return self.j1 <= self.j0

    def positions(self, row: jax.Array) -> jax.Array:
        """The query position of each row (``row``: its index in the flattened batch); a
        row of another sequence (or of none) gets -1: it sees no key."""
        inside = (row >= self.lo) & (row < self.hi)
        return jnp.where(inside, self.first_pos + row - self.q0, -1)


def _kernel(*refs: Any, st: PagedStatic, names: list[str]) -> None:
    r = dict(zip(names, refs, strict=True))
    m_scr, l_scr, acc_scr = r["m"], r["l"], r["acc"]
    i = pl.program_id(0)
    bq, rows = st.block_q, st.group * st.block_q

    for h in range(st.kv_heads):
        for g in range(st.group):
            tile = pl.ds(g * bq, bq)
            if st.has_sinks:
                # The sink is one more logit of every row, seen from the start (m = sink, l = 1).
                sink = r["sinks"][h * st.group + g]
                m_scr[h, tile, :] = jnp.full((bq, 1), sink, jnp.float32)
                l_scr[h, tile, :] = jnp.ones((bq, 1), jnp.float32)
            else:
                m_scr[h, tile, :] = jnp.full((bq, 1), -jnp.inf, jnp.float32)
                l_scr[h, tile, :] = jnp.zeros((bq, 1), jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    block_first = i * bq
    # Row t of the block (rows of a group tile repeat every block_q).
    row = block_first + jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), bq)
    end = r["seq_hi"][i]
    walk = functools.partial(_Walk.of, r, st, block_first)

    def copies(w: _Walk) -> _PageCopies:
        return _PageCopies(st, r, w.seq, w.kv_len)

    def next_walked(seq: Any) -> Any:
        """The first sequence from ``seq`` on (before ``end``) with a kv block to walk."""
        return jax.lax.while_loop(lambda s: (s < end) & walk(s).empty, lambda s: s + 1, seq)

    first = walk(next_walked(r["seq_lo"][i]))

    @pl.when(first.seq < end)
    def _first():
        copies(first).start(first.j0, 0)

    def step(state: tuple) -> tuple:
        seq, j, slot = state
        w = walk(seq)
        # The next (sequence, kv block): this sequence's next block, else the first block
        # of the next sequence with one; its copy starts before this block is computed.
        last = j + 1 >= w.j1
        nxt = walk(jnp.where(last, next_walked(seq + 1), seq))
        nj = jnp.where(last, nxt.j0, j + 1)

        @pl.when(nxt.seq < end)
        def _next():
            copies(nxt).start(nj, 1 - slot)

        copies(w).wait(j, slot)
        _block_step(r, st, slot, j * st.block_kv, w.positions(row), w.kv_len)
        return nxt.seq, nj, 1 - slot

    jax.lax.while_loop(lambda state: state[0] < end, step, (first.seq, first.j0, jnp.int32(0)))

    for h in range(st.kv_heads):
        denom = l_scr[h]
        has_mass = denom > 0
        inv = jnp.where(has_mass, 1.0 / jnp.where(has_mass, denom, 1.0), 0.0)
        out = (acc_scr[h] * inv).astype(r["o"].dtype)
        r["o"][h] = out.reshape(st.group, bq, out.shape[-1])


def _block_step(
    r: dict[str, Any], st: PagedStatic, slot: Any, key0: Any, pos: jax.Array, kv_len: Any
) -> None:
    """One kv block (first key ``key0``) for every kv head: masked online-softmax update.

    ``pos`` ``[G * block_q, 1]``: each row's query position (-1: the row sees nothing).
    """
    keys = st.block_kv
    key_pos = key0 + jax.lax.broadcasted_iota(jnp.int32, (1, keys), 1)
    visible = key_pos <= pos  # bottom-right causal; keys past kv_len sit past every position
    if st.window_left is not None:
        visible &= key_pos >= pos - st.window_left
    # Slots past kv_len may hold anything (NaN in a stale page): 0 * NaN would reach acc.
    held = (key0 + jax.lax.broadcasted_iota(jnp.int32, (keys, 1), 0)) < kv_len
    for h in range(st.kv_heads):
        q = r["q"][h]
        q = q.reshape(st.group * st.block_q, q.shape[-1])
        k = _dequantized_tile(r, "k", slot, h, st, q.dtype)
        v = _dequantized_tile(r, "v", slot, h, st, q.dtype)
        v = jnp.where(held, v, jnp.zeros((), v.dtype))
        s = jnp.where(visible, logits(q, k, st.scale, st.soft_cap)[0], -jnp.inf)
        m_prev = r["m"][h]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # A row with nothing visible yet keeps m = -inf; shift by 0 so exp() gives 0, not NaN.
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m_prev - shift)
        p = jnp.exp(s - shift)
        r["l"][h] = alpha * r["l"][h] + jnp.sum(p, axis=1, keepdims=True)
        r["acc"][h] = alpha * r["acc"][h] + dot(p.astype(v.dtype), v, NN_DIMS)
        r["m"][h] = m_new


def _compiler_params(st: PagedStatic) -> pltpu.CompilerParams | None:
    """The q-block axis is parallel (each step owns its rows; no state crosses steps). The
    single-core interpreter gets none (see `_common.compiler_params`)."""
    if st.interpret is not False and getattr(st.interpret, "num_cores_or_threads", 1) == 1:
        return None
    return pltpu.CompilerParams(dimension_semantics=("parallel",))


@functools.partial(jax.jit, static_argnames=("st",))
def paged_forward(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    cu: jax.Array,
    seq_lo: jax.Array,
    seq_hi: jax.Array,
    sinks: jax.Array | None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    *,
    st: PagedStatic,
) -> jax.Array:
    """The kernel over every query block; the output ``[K, G, R, H]`` in q's dtype.

    Args:
        q: ``[K, G, R, H]``, R a multiple of ``st.block_q``.
        k_pages, v_pages: the pools ``[P, page_size, K, H]`` (left in HBM).
        page_table: int32 ``[B * pages_per_seq]`` (flattened); kv_lens: int32 ``[B]``.
        cu: int32 ``[B + 1]`` row offsets of the sequences.
        seq_lo, seq_hi: int32 ``[R / block_q]``: the sequences ``[lo, hi)`` that may own
            rows of each block.
        sinks: f32 ``[N]`` or None.
        k_scales, v_scales: with ``st.kv_scales`` 2, f32 ``[P, page_size, K]`` (left in
            HBM); with 1, f32 scalars; else None.
        st: the launch's static options.
    """
    kv_heads, group, num_rows, head_dim = q.shape
    bq = st.block_q
    block = pl.BlockSpec((kv_heads, group, bq, head_dim), lambda i, *_: (0, 0, i, 0))
    in_specs = [block, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    names = ["page_table", "kv_lens", "cu", "seq_lo", "seq_hi", "q", "k_hbm", "v_hbm"]
    args = [q, k_pages, v_pages]
    if st.has_sinks:
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        names.append("sinks")
        args.append(sinks)
    slots = (2, st.pages_per_block, st.page_size, kv_heads, head_dim)
    scale_bufs = {}
    if st.kv_scales == 1:
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        names.append("scales")
        args.append(jnp.stack([k_scales, v_scales]).astype(jnp.float32))
    elif st.kv_scales == 2:
        in_specs += [pl.BlockSpec(memory_space=pl.ANY)] * 2
        names += ["ks_hbm", "vs_hbm"]
        args += [k_scales, v_scales]
        scale_bufs = {name: pltpu.VMEM(slots[:-1], jnp.float32) for name in ("ks_buf", "vs_buf")}
    rows = group * bq
    scratch = {
        "k_buf": pltpu.VMEM(slots, k_pages.dtype),
        "v_buf": pltpu.VMEM(slots, v_pages.dtype),
        **scale_bufs,
        "sem": pltpu.SemaphoreType.DMA((4 if st.kv_scales == 2 else 2, 2)),
        "m": pltpu.VMEM((kv_heads, rows, 1), jnp.float32),
        "l": pltpu.VMEM((kv_heads, rows, 1), jnp.float32),
        "acc": pltpu.VMEM((kv_heads, rows, head_dim), jnp.float32),
    }
    names += ["o", *scratch]
    return pl.pallas_call(
        functools.partial(_kernel, st=st, names=names),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_rows // bq,),
            in_specs=in_specs,
            out_specs=block,
            scratch_shapes=list(scratch.values()),
        ),
        compiler_params=_compiler_params(st),
        interpret=st.interpret,
        name="ejk_ragged_paged_attention",
    )(page_table, kv_lens, cu, seq_lo, seq_hi, *args)
