"""Pieces shared by the forward, dq and dkv kernel bodies: static options, logits (and a flex
score_mod on them), visibility.

Kernel layout: q and the output are ``[B, N, T, H]``, k and v ``[B, K, S, H]`` (heads before
sequence, so a block is a ``[rows, H]`` tile); T and S are padded to whole blocks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ejk_sequtils import DROPOUT_HASH, dropout_threshold

from ._mask_info import FULL, PARTIAL

NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T: contract the last axes of both tiles
NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b


@dataclasses.dataclass(frozen=True)
class Static:
    """Trace-time options of one attention call (hashable: a custom_vjp static argument).

    Attributes:
        heads, kv_heads: query heads N and kv heads K.
        fwd, dq, dkv: ``(block_q, block_kv)`` of each kernel.
        scale: softmax scale; soft_cap: the logits soft cap or None.
        has_segments, has_sinks: whether segment ids / sinks are passed.
        interpret: False on TPU, else the `pltpu.InterpretParams` to run with.
        dropout_rate: probability of dropping a normalised weight (0: no dropout; the seed
            is then not passed).
        mask_fn: the mask's ``f(q_ids, kv_ids)`` (`process_mask`'s mask function): partial
            blocks evaluate it on their query and key positions instead of loading a stored
            tile; None: partial blocks load their tile.
        mask_mod: a `ModMask` (a flex mask_mod split into features and a tile part):
            partial blocks evaluate it on their batch row, head and positions, reading its
            features (kernel inputs ``mod0``, ``mod1``, ...), and hide positions past
            ``lengths``; None: no such mask.
        score_mod: a `ModScore` (a flex score_mod split the same way): every kernel applies
            it to its score tiles (`tile_scores`), reading its features (inputs ``score0``, ...);
            None: none. It comes with a ``mask_mod`` (which hides the padding).
        lengths: ``(T, S)`` before padding, with ``mask_mod``.
        table_batch: batch rows of the block tables (1: one table row per head serves
            every batch row; B: a table row per ``(b, head)``, as a flex `BlockMask` has).
    """

    heads: int
    kv_heads: int
    fwd: tuple[int, int]
    dq: tuple[int, int]
    dkv: tuple[int, int]
    scale: float
    soft_cap: float | None
    has_segments: bool
    has_sinks: bool
    interpret: Any
    dropout_rate: float = 0.0
    mask_fn: Any = None
    mask_mod: Any = None
    score_mod: Any = None
    lengths: tuple[int, int] | None = None
    table_batch: int = 1

    @property
    def has_dropout(self) -> bool:
        return self.dropout_rate > 0.0

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def mods(self) -> list[tuple[str, Any]]:
        """``(input name prefix, split mod)`` of the flex mods the kernels read features of."""
        mods = (("mod", self.mask_mod), ("score", self.score_mod))
        return [(prefix, mod) for prefix, mod in mods if mod is not None]


def div(a: jax.Array, b: int) -> jax.Array:
    """``a // b`` for non-negative grid indices (``lax.div``: no sign fix-up, which Mosaic
    lowers only with a TPU attached)."""
    return jax.lax.div(a, jnp.int32(b)) if b != 1 else a


def rem(a: jax.Array, b: int) -> jax.Array:
    """``a % b`` for non-negative grid indices."""
    return jax.lax.rem(a, jnp.int32(b))


def mask_row(batch: jax.Array, head: jax.Array, st: Static, table_rows: int) -> jax.Array:
    """Row of a block table used by ``(batch, head)``.

    Tables have ``st.table_batch`` (1 or B) groups of 1, shards or N head rows.
    """
    per_batch = table_rows // st.table_batch
    row = jnp.int32(0) if per_batch == 1 else div(head, st.heads // per_batch)
    if st.table_batch == 1:
        return row
    return batch * per_batch + row


def compiler_params(st: Static) -> pltpu.CompilerParams | None:
    """Grid semantics of every kernel here: (batch, heads, outer blocks) parallel, the
    reduction axis sequential.

    The single-core interpreter gets none: it does not need them, and under `jax.vmap`
    Pallas prepends a grid axis the stated semantics would no longer match (jax 0.10).
    """
    if st.interpret is not False and getattr(st.interpret, "num_cores_or_threads", 1) == 1:
        return None
    return pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
    )


def dot(a: jax.Array, b: jax.Array, dims: tuple) -> jax.Array:
    """A tile matmul accumulated in f32; f32 operands at full f32 precision (HIGHEST), as the
    f32 reference, rather than TPU's default bf16 passes."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def logits(
    a: jax.Array, b: jax.Array, scale: float, soft_cap: float | None
) -> tuple[jax.Array, jax.Array | None]:
    """``scale * a @ b.T`` in f32, soft-capped; also ``tanh`` of the capped value (for its gradient)."""
    s = dot(a, b, NT_DIMS) * scale
    if soft_cap is None:
        return s, None
    t = jnp.tanh(s / soft_cap)
    return soft_cap * t, t


def tile_scores(
    st: Static,
    r: dict[str, Any],
    a: jax.Array,
    b: jax.Array,
    origin: tuple,
    transposed: bool,
    slope: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """A tile's scores as the softmax takes them: `logits` soft-capped or under the flex
    score_mod; with ``slope``, also the derivative of that modification w.r.t. the scaled
    score, the backward's chain rule (None: it is 1).

    ``origin`` = (batch, query head, first row, first column) of the tile (rows are keys
    when ``transposed``) places the score_mod's positions; its features come from ``r``.
    The forward and both backward kernels take their scores from here, so the score_mod
    (and its slope, by `jax.jvp` through the tile: the mod is elementwise) is applied
    alike in each.
    """
    s, t = logits(a, b, st.scale, st.soft_cap)
    if t is not None:
        return s, (1.0 - t * t) if slope else None  # d(cap * tanh(x / cap)) / dx
    if st.score_mod is None:
        return s, None
    batch, head = origin[0], origin[1]
    q_ids, kv_ids = _positions(origin, s.shape, transposed)
    values = _feature_values(st, st.score_mod, "score", r, batch, head, s.shape)
    mod = lambda x: st.score_mod.evaluate(x, batch, head, q_ids, kv_ids, values)
    if not slope:
        return mod(s), None
    return jax.jvp(mod, (s,), (jnp.ones_like(s),))


def _positions(origin: tuple, shape: tuple[int, int], transposed: bool) -> tuple[jax.Array, ...]:
    """``(q_ids, kv_ids)``: int32 query and key positions of every element of a tile."""
    row_ids = jax.lax.broadcasted_iota(jnp.int32, shape, 0) + origin[2]
    col_ids = jax.lax.broadcasted_iota(jnp.int32, shape, 1) + origin[3]
    return (col_ids, row_ids) if transposed else (row_ids, col_ids)


def _feature_values(
    st: Static, mod: Any, prefix: str, r: dict[str, Any], batch: Any, head: Any, shape: tuple
) -> list[Any]:
    """A split mod's features on one tile, from its ``<prefix><n>`` inputs: SMEM scalars per
    ``(b, h)``, ``[rows, 1]`` / ``[1, cols]`` blocks broadcast to the tile, tables (SMEM refs)."""
    values = []
    for n, f in enumerate(mod.features):
        ref = r[f"{prefix}{n}"]
        if f.axis == "table":  # SMEM, read element by element (`_mask_mod._lookup`)
            values.append(ref)
        elif f.axis == "scalar":  # SMEM [B' * N']
            index = (batch if f.batch else 0) * (st.heads if f.head else 1)
            values.append(ref[index + (head if f.head else 0)])
        else:  # a [rows, 1] or [1, cols] block
            values.append(jnp.broadcast_to(ref[...], shape))
    return values


def partial_visibility(
    st: Static, r: dict[str, Any], origin: tuple, shape: tuple[int, int], transposed: bool
) -> jax.Array:
    """Which entries of a partial block's score tile the mask lets through, bool ``shape``.

    With a mask function (``st.mask_fn``) it is evaluated on the tile's query and key
    positions, from ``origin`` = (batch, head, first row, first column) of the tile (rows
    are keys when ``transposed``): the positions are ``q_sequence`` = ``arange(T)`` (checked
    when the tables are built), so they come from the grid, and no byte is loaded.
    Otherwise the stored int8 tile ``r["tile"]`` is read.
    """
    if st.mask_mod is not None:
        return _mod_visibility(st, r, origin, shape, transposed)
    if st.mask_fn is None:
        if "tile" not in r:
            # No partial block, so no tile is stored (a mask that every block sees
            # whole, such as a full mask on whole blocks): this branch is traced but
            # `by_block_kind` never runs it.
            return jnp.ones(shape, jnp.bool_)
        # Widen before comparing so the predicate has the f32 tile's layout.
        return r["tile"][...].astype(jnp.int32) != 0
    q_ids, kv_ids = _positions(origin, shape, transposed)
    return jnp.broadcast_to(st.mask_fn(q_ids, kv_ids), shape)


def _mod_visibility(
    st: Static, r: dict[str, Any], origin: tuple, shape: tuple[int, int], transposed: bool
) -> jax.Array:
    """``st.mask_mod`` on a partial tile, its features read from the ``mod<n>`` inputs, and
    positions past the call's lengths hidden (padding)."""
    batch, head = origin[0], origin[1]
    q_ids, kv_ids = _positions(origin, shape, transposed)
    values = _feature_values(st, st.mask_mod, "mod", r, batch, head, shape)
    visible = st.mask_mod.evaluate(batch, head, q_ids, kv_ids, values)
    q_len, kv_len = st.lengths
    return visible & (q_ids < q_len) & (kv_ids < kv_len)


def mod_inputs(
    st: Static, features: Sequence[jax.Array], block: tuple[int, int], transposed: bool, locate: Any
) -> tuple[list[str], list[pl.BlockSpec], list[jax.Array]]:
    """The features of ``st.mask_mod`` as kernel inputs ``mod0``, ``mod1``, ..., then those of
    ``st.score_mod`` as ``score0``, ... (none without the mods).

    Args:
        features: the mods' `feature_arrays`, in that order: ``[B', N', Tp]`` per query,
            ``[B', N', Sp]`` per key, ``[B' * N']`` per ``(b, h)``, a table flattened.
        block: the kernel's ``(block_q, block_kv)``.
        transposed: tiles have keys as rows (dkv): a per-query feature is read as a
            ``[1, block_q]`` row and a per-key one as a ``[block_kv, 1]`` column (the other
            way round otherwise).
        locate: ``locate(*grid_indices, *tables) -> (batch, head, q_block, kv_block)`` of a
            grid step, for the index maps.
    """
    names, specs, args = [], [], []
    named = [(f"{prefix}{n}", f) for prefix, mod in st.mods() for n, f in enumerate(mod.features)]
    for (name, f), x in zip(named, features, strict=True):
        names.append(name)
        if f.axis in ("scalar", "table"):
            specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
            args.append(x)
            continue
        along_q = f.axis == "q"
        size = block[0] if along_q else block[1]
        column = along_q != transposed

        def index_map(*idx, f=f, along_q=along_q, column=column):
            batch, head, q_block, kv_block = locate(*idx)
            at = q_block if along_q else kv_block
            rows = (batch if f.batch else 0, head if f.head else 0)
            return (*rows, at, 0) if column else (*rows, 0, at)

        shape = (None, None, size, 1) if column else (None, None, 1, size)
        specs.append(pl.BlockSpec(shape, index_map))
        args.append(x[..., None] if column else x[..., None, :])
    return names, specs, args


def visibility(partial: jax.Array | None, row_ids_ref: Any, col_ids_ref: Any) -> jax.Array | None:
    """Which entries of a score tile are visible, or None when all are.

    Args:
        partial: the mask's visibility on a partial block (`partial_visibility`), or None
            on a full block.
        row_ids_ref, col_ids_ref: segment ids ``[rows, 1]`` and ``[1, cols]``, or None.
    """
    visible = partial
    if row_ids_ref is not None:
        rows = row_ids_ref[...]
        same = (rows == col_ids_ref[...]) & (rows >= 0)  # negative ids are padding
        visible = same if visible is None else visible & same
    return visible


def _i32(c: int) -> np.int32:
    """A uint32 constant as the int32 with the same bits (int32 multiply wraps like uint32)."""
    return np.uint32(c).view(np.int32)


# ejk_sequtils.DROPOUT_HASH: the constants of the keep-mask hash every ejk backend draws.
_GOLDEN, _MUR1, _MUR2 = (_i32(c) for c in DROPOUT_HASH)


def _srl(x: jax.Array, n: int) -> jax.Array:
    return jax.lax.shift_right_logical(x, jnp.full_like(x, n))


def _mix(h: jax.Array, x: jax.Array) -> jax.Array:
    """One round of the ejk dropout hash (`ejk_sequtils.dropout_keep_mask`), on int32 bits."""
    h = h ^ (x * _GOLDEN)
    h = (h ^ _srl(h, 16)) * _MUR1
    h = (h ^ _srl(h, 13)) * _MUR2
    return h ^ _srl(h, 16)


def dropout_scale(
    st: Static,
    seed_ref: Any,
    batch: jax.Array,
    head: jax.Array,
    row0: jax.Array,
    col0: jax.Array,
    shape: tuple[int, int],
    transposed: bool,
) -> jax.Array:
    """``keep / (1 - rate)`` (0 where dropped) for one score tile, f32 ``shape``.

    The keep bit of (b, n, query i, key j) is ``mix(mix(mix(mix(seed, b), n), i), j) >> 8
    >= dropout_threshold(rate)``, as `ejk_sequtils.dropout_keep_mask` computes it.
    ``row0``/``col0`` are the tile's first row/column; rows are queries, or keys when
    ``transposed`` (dkv tiles).
    """
    rows = jax.lax.broadcasted_iota(jnp.int32, shape, 0) + row0
    cols = jax.lax.broadcasted_iota(jnp.int32, shape, 1) + col0
    q_idx, k_idx = (cols, rows) if transposed else (rows, cols)
    # seed_ref: [seed, b0, n0, i0, j0], a shard's global origin (int32 bits of uint32s;
    # wrapping int32 adds give the same bits).
    h = jnp.full(shape, seed_ref[0], jnp.int32)
    batch, head = batch + seed_ref[1], head + seed_ref[2]
    q_idx, k_idx = q_idx + seed_ref[3], k_idx + seed_ref[4]
    h = _mix(_mix(_mix(_mix(h, batch), head), q_idx), k_idx)
    threshold = dropout_threshold(st.dropout_rate)
    keep = _srl(h, 8) >= threshold  # < 2**24 after the shift: a signed compare is exact
    return jnp.where(keep, jnp.float32(1.0 / (1.0 - st.dropout_rate)), jnp.float32(0.0))


def by_block_kind(kind: jax.Array, step: Any) -> None:
    """Runs ``step(masked=True)`` on a partial block, ``step(masked=False)`` on a full one,
    nothing on an empty one."""
    pl.when(kind == PARTIAL)(lambda: step(True))
    pl.when(kind == FULL)(lambda: step(False))


def split_refs(refs: tuple, names: list[str]) -> dict[str, Any]:
    """Names the kernel's positional refs; a name of None in ``names`` is skipped."""
    if len(refs) != len(names):
        raise RuntimeError(f"kernel got {len(refs)} refs for {len(names)} names: {names}")
    return dict(zip(names, refs, strict=True))


def tiles_of(info: Any) -> jax.Array | None:
    """The partial tiles as int8 ``[P, rows, cols]``, or None when none is stored."""
    if info.partial_mask_blocks is None:
        return None
    tiles = jnp.asarray(info.partial_mask_blocks)
    return tiles.reshape(-1, *tiles.shape[-2:]).astype(jnp.int8)


def kernel_tables(info: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(data_next, block_mask, mask_next)`` as scalar-prefetch arrays; a one-entry
    ``mask_next`` when the tables have none (no tile is stored, so none is indexed)."""
    mask_next = info.mask_next
    if mask_next is None:
        mask_next = jnp.zeros((1, 1, 1), jnp.int8)
    return jnp.asarray(info.data_next), jnp.asarray(info.block_mask), jnp.asarray(mask_next)


def tile_inputs(info: Any, tile_spec: pl.BlockSpec) -> tuple[list[str], list[pl.BlockSpec], list]:
    """The stored partial tiles as the kernel input ``tile``, or no input when none is stored
    (no partial block, or the mask function resolves them)."""
    tiles = tiles_of(info)
    if tiles is None:
        return [], [], []
    return ["tile"], [tile_spec], [tiles]


def q_major_inputs(
    st: Static,
    info: Any,
    block: tuple[int, int],
    head_dim: int,
    q_rows: dict[str, tuple[jax.Array, int]],
    k: jax.Array,
    v: jax.Array,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    features: Sequence[jax.Array] = (),
) -> tuple[list[str], list[pl.BlockSpec], list[jax.Array]]:
    """Names, block specs and arrays of the inputs of a ``(B, N, q_blocks, kv_blocks)`` grid.

    Used by the forward and dq kernels. ``q_rows`` maps a name to a ``[B, N, Tp, width]``
    array read by q block (q, do, lse, di); k, v, the segment ids and the mask tile
    follow the scalar-prefetched tables (``data_next`` picks the kv block, ``mask_next``
    the tile), then the mask_mod's ``features`` (`mod_inputs`).
    """
    block_q, block_kv = block
    rows, group = info.block_mask.shape[0], st.group

    def q_map(b, h, i, j, dn, bm, mn):
        return b, h, i, 0

    def kv_block(b, h, i, j, dn):
        return dn[mask_row(b, h, st, rows), i, j].astype(jnp.int32)

    def kv_map(b, h, i, j, dn, bm, mn):
        return b, div(h, group), kv_block(b, h, i, j, dn), 0

    def tile_map(b, h, i, j, dn, bm, mn):
        return mn[mask_row(b, h, st, rows), i, j].astype(jnp.int32), 0, 0

    names, specs, args = [], [], []
    for name, (array, width) in q_rows.items():
        names.append(name)
        specs.append(pl.BlockSpec((None, None, block_q, width), q_map))
        args.append(array)
    names += ["k", "v"]
    specs += [pl.BlockSpec((None, None, block_kv, head_dim), kv_map)] * 2
    args += [k, v]
    if st.has_segments:
        names += ["q_seg", "kv_seg"]
        specs += [
            pl.BlockSpec((None, block_q, 1), lambda b, h, i, j, dn, bm, mn: (b, i, 0)),
            pl.BlockSpec(
                (None, 1, block_kv), lambda b, h, i, j, dn, bm, mn: (b, 0, kv_block(b, h, i, j, dn))
            ),
        ]
        args += [q_seg, kv_seg]
    extra = tile_inputs(info, pl.BlockSpec((None, block_q, block_kv), tile_map))
    locate = lambda b, h, i, j, dn, bm, mn: (b, h, i, kv_block(b, h, i, j, dn))
    mods = mod_inputs(st, features, block, False, locate)
    return names + extra[0] + mods[0], specs + extra[1] + mods[1], args + extra[2] + mods[2]


def launch(
    kernel: Any,
    name: str,
    st: Static,
    info: Any,
    grid: tuple[int, ...],
    inputs: tuple[list[str], list[pl.BlockSpec], list[jax.Array]],
    outputs: dict[str, tuple[pl.BlockSpec, jax.ShapeDtypeStruct]],
    scratch: dict[str, Any],
    **static: Any,
) -> Sequence[jax.Array]:
    """Runs one of the block-sparse kernels over ``grid``; its outputs, in ``outputs``' order.

    ``info``'s tables (data_next, block_mask, mask_next) are scalar-prefetched: the kernel,
    called as ``kernel(dn, bm, mn, *refs, st=st, names=..., table_rows=..., **static)``,
    and every index map get them first. ``refs`` are the inputs (``(names, block specs,
    arrays)``, as `q_major_inputs` and `smem_inputs` build them), then the outputs
    (name -> (block spec, shape)), then the scratch buffers (name -> VMEM), and
    ``names`` names them all, in that order.
    """
    in_names, in_specs, args = inputs
    body = functools.partial(
        kernel,
        st=st,
        names=[*in_names, *outputs, *scratch],
        table_rows=info.block_mask.shape[0],
        **static,
    )
    tables = kernel_tables(info)
    return pl.pallas_call(
        body,
        out_shape=[shape for _, shape in outputs.values()],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(tables),
            grid=grid,
            in_specs=in_specs,
            out_specs=[spec for spec, _ in outputs.values()],
            scratch_shapes=list(scratch.values()),
        ),
        compiler_params=compiler_params(st),
        interpret=st.interpret,
        name=name,
    )(*tables, *args)


def smem_inputs(names, specs, args, st: Static, **arrays):
    """Appends the whole-array SMEM operands the kernel takes (of ``sinks``, f32 ``[N]``,
    and ``seed``, int32 ``[5]``: `dropout_scale`) when the call uses them."""
    used = {"sinks": st.has_sinks, "seed": st.has_dropout}
    for name, array in arrays.items():
        if used[name]:
            names = [*names, name]
            specs = [*specs, pl.BlockSpec(memory_space=pltpu.SMEM)]
            args = [*args, array]
    return names, specs, args
