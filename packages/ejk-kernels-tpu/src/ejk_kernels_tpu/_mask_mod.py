"""A user's flex mod split for the kernels: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (`ModMask`)
and ``score_mod(score, b, h, q_idx, kv_idx)`` (`ModScore`).

The splash mask function (`Mask.mask_function`) is ``f(q_ids, kv_ids)`` of positions only.
A user's mod also reads the batch row and head and the arrays it captures (document ids,
prefix lengths, ALiBi slopes), usually as ``ids[b, q_idx]`` or ``slopes[h]``: a gather,
which Mosaic cannot lower on a tile. The mod is traced once on scalars and its jaxpr split
by what each value depends on:

- *features*: scalar values that depend on the query but not the key (``ids[b, q_idx]``),
  on the key but not the query, or on neither (``lengths[b]``, ``slopes[h]``, a captured
  scalar), and that the rest of the mod combines. They are computed outside the kernel,
  once per position (``[B', N', T]``, ``[B', N', S]``) or per ``(b, h)``, by running the
  mod's own equations vmapped; the kernels read them as ``[rows, 1]`` / ``[1, cols]``
  blocks (as splash reads segment ids) or SMEM scalars.
- the *tile part*: the equations that depend on both ``q_idx`` and ``kv_idx``, or on the
  score (which has a value per element): comparisons, ``&``, arithmetic, ``tanh``,
  evaluated in the kernel on a tile's iota grids (and score tile), each equation vmapped
  over the tile.

A captured array read at an element that depends on both positions has no such split. One
read at a single such position (a relative-position table, ``table[h, kv_idx - q_idx + c]``:
a ``dynamic_slice`` of one element) becomes a *table* feature, passed whole (flattened, in
SMEM, at most `MAX_TABLE` entries), and the tile part looks it up (`_lookup`: a loop over
the values the varying index takes on the tile, a compare and a select each, as Mosaic has
no gather on a tile). Other reads (along two such axes, as a dense ``[T, S]`` bias; from an
array that depends on ``b`` or ``h`` before the read; a slice of more elements) are refused
by `ModMask.trace` / `ModScore.trace`, naming the mod and the operation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

__all__ = ["Feature", "ModMask", "ModScore"]

# The index arguments of a mod, in order, and the dependency each one introduces.
_ARGS = ("b", "h", "q", "kv")
_INDEX = jax.ShapeDtypeStruct((), jnp.int32)
_SCORE = jax.ShapeDtypeStruct((), jnp.float32)
# The score has a value per element: what depends on it is evaluated on the tile.
_ELEMENT = frozenset({"q", "kv"})


@dataclasses.dataclass(frozen=True, eq=False)
class Feature:
    """A scalar value of the mod computed outside the kernel.

    Attributes:
        var: the jaxpr variable it binds.
        axis: ``"q"`` (one value per query), ``"kv"`` (per key), ``"scalar"`` (per ``(b, h)``)
            or ``"table"`` (a captured array, the same for every ``(b, h)``, that the tile
            part reads at positions depending on both ``q_idx`` and ``kv_idx``; it travels
            flattened, in SMEM).
        batch, head: whether it depends on ``b`` / ``h`` (else one row serves all).
        dtype: its own dtype; it travels as int32 (bool, integers) or float32 (floats).
    """

    var: Any
    axis: str
    batch: bool
    head: bool
    dtype: np.dtype

    @property
    def carrier(self) -> np.dtype:
        """The dtype the kernels receive it in (32-bit, as SMEM and the tiles hold)."""
        if jnp.issubdtype(self.dtype, jnp.floating):
            return np.dtype(np.float32)
        return np.dtype(np.int32)


# The most entries of a table the tile part reads at a position depending on both q_idx and
# kv_idx (a relative-position table): it sits in SMEM (64 KiB of 32-bit words).
MAX_TABLE = 1 << 14


def _lookup_refusal(eqn: Any, table: Any, deps: dict[Any, frozenset[str]]) -> str | None:
    """None where ``eqn`` reads one element of ``table`` the kernels can look up (`_lookup`):
    a ``dynamic_slice`` of size 1 along every axis, of a table that is the same for every
    ``(b, h)`` and has at most `MAX_TABLE` entries, at a start of which one component
    depends on both positions (the others on neither, or on ``b`` / ``h``); else why not."""
    if eqn.primitive.name != "dynamic_slice" or eqn.invars[0] is not table:
        return ""
    if any(size != 1 for size in eqn.params["slice_sizes"]) or table in eqn.invars[1:]:
        return ", a slice of more than one element"
    if deps[table]:
        return f", and the array itself depends on {', '.join(sorted(deps[table]))}"
    size = int(np.prod(table.aval.shape))
    if size > MAX_TABLE:
        return f" ({size} entries)"
    both = [a for a in eqn.invars[1:] if not isinstance(a, jcore.Literal) and "q" in deps[a]]
    both = [a for a in both if "kv" in deps[a]]
    if len(both) != 1:
        return " along two axes"
    if np.dtype(table.aval.dtype).itemsize > 4:
        return f", of dtype {table.aval.dtype}"
    return None


def _lookup(eqn: Any, table: Any, starts: Sequence[Any], shape: tuple[int, ...], dtype: Any) -> Any:
    """The element of ``table`` (``eqn``'s operand flattened, in its carrier dtype: an SMEM
    ref in the kernels) that ``eqn`` (`_lookup_refusal`) reads at every element of a tile,
    as an array of ``shape`` in ``dtype``.

    Each start is clamped into its axis, as ``dynamic_slice`` clamps; the per-tile ones
    (scalars, or ``b`` / ``h`` features) give a base offset, and the one that varies over the
    tile is looked up by a loop over the values it takes on this tile, each a compare and a
    select (Mosaic has no gather on a tile).
    """
    dims = eqn.invars[0].aval.shape
    strides = [int(np.prod(dims[i + 1 :])) for i in range(len(dims))]
    base, varying, stride = jnp.int32(0), None, 1
    for start, dim, step in zip(starts, dims, strides, strict=True):
        start = jnp.clip(jnp.asarray(start, jnp.int32), 0, dim - 1)
        if jnp.ndim(start) == len(shape):
            varying, stride = start, step
        else:
            base = base + start * step
    lo, hi = jnp.min(varying), jnp.max(varying)

    def body(j: Any, acc: Any) -> Any:
        return jnp.where(varying == j, table[base + j * stride], acc)

    found = jax.lax.fori_loop(lo, hi + 1, body, jnp.zeros(shape, table.dtype))
    return found != 0 if dtype == np.bool_ else found.astype(dtype)


def _name(fn: Any) -> str:
    func = getattr(fn, "func", fn)
    return getattr(func, "__name__", type(func).__name__)


def _bind(eqn: Any, args: Sequence[Any]) -> list[Any]:
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _read(env: dict[Any, Any], atom: Any) -> Any:
    return atom.val if isinstance(atom, jcore.Literal) else env[atom]


@dataclasses.dataclass(frozen=True, eq=False)
class _SplitMod:
    """A traced mod, split into features (outside) and a tile part (in the kernel).

    Hashable by identity (a static option of the kernels). Build with ``trace``; its
    captured arrays (the jaxpr's constants, concrete or traced) are returned beside it and
    passed back to `feature_arrays`.

    Attributes:
        jaxpr: the mod's scalar jaxpr (constants are its captured arrays).
        outer: the equations computed outside the kernel (features and what they need).
        tile: the equations evaluated on a tile, in order.
        features: the values the tile part reads from outside, in input order.
        name: the mod's name, for messages.
    """

    jaxpr: Any
    outer: tuple[Any, ...]
    tile: tuple[Any, ...]
    features: tuple[Feature, ...]
    name: str

    # The mod's role (for messages), its scalar arguments and the dependency of each.
    _ROLE: ClassVar[str]
    _AVALS: ClassVar[tuple[jax.ShapeDtypeStruct, ...]]
    _DEPS: ClassVar[tuple[frozenset[str], ...]]

    @classmethod
    def trace(cls, mod: Callable[..., Any]) -> tuple[Any, list[Any]]:
        """``(split mod, captured arrays)`` of ``mod`` on scalars.

        Raises:
            NotImplementedError: the mod reads a captured array (or a slice of one) at a
                position that depends on both ``q_idx`` and ``kv_idx``, so it has no
                per-query / per-key split (the message names the mod and the operation).
        """
        closed = jax.make_jaxpr(mod)(*cls._AVALS)
        jaxpr, name = closed.jaxpr, _name(mod)
        deps: dict[Any, frozenset[str]] = {v: frozenset() for v in jaxpr.constvars}
        deps.update(zip(jaxpr.invars, cls._DEPS, strict=True))
        outer, tile, frontier, lookups = [], [], {}, {}

        def dep(atom: Any) -> frozenset[str]:
            return frozenset() if isinstance(atom, jcore.Literal) else deps[atom]

        def refuse(what: Any, shape: tuple[int, ...], why: str) -> NotImplementedError:
            return NotImplementedError(
                f"the Pallas flex kernel cannot evaluate {cls._ROLE} {name!r}: its {what} "
                f"reads an array of shape {shape} (a captured array) at a position that "
                f"depends on both q_idx and kv_idx{why}; the kernel takes captured values per "
                "query, per key or per (b, h), and reads a table of at most "
                f"{MAX_TABLE} entries at one such position per element (use "
                "implementation='xla')"
            )

        for eqn in jaxpr.eqns:
            d = frozenset().union(*(dep(a) for a in eqn.invars))
            for v in eqn.outvars:
                deps[v] = d
            if not {"q", "kv"} <= d:
                outer.append(eqn)
                continue
            tile.append(eqn)
            for atom in eqn.invars:
                if isinstance(atom, jcore.Literal) or atom in jaxpr.invars:
                    continue
                if not {"q", "kv"} <= deps[atom]:
                    frontier[atom] = eqn
                    if atom.aval.shape != ():
                        why = _lookup_refusal(eqn, atom, deps)
                        if why is not None:
                            raise refuse(eqn.primitive, atom.aval.shape, why)
                        lookups[eqn.outvars[0]] = eqn
        for atom in jaxpr.outvars:  # a mod that ignores q_idx or kv_idx is itself a feature
            if not isinstance(atom, jcore.Literal) and atom not in jaxpr.invars:
                if not {"q", "kv"} <= deps[atom]:
                    if atom.aval.shape != ():
                        raise refuse("result", atom.aval.shape, "")
                    frontier[atom] = None
        for eqn in jaxpr.eqns:  # a table's element is read only as the scalar it is
            for atom in eqn.invars:
                if isinstance(atom, jcore.Literal):
                    continue
                if atom in lookups and eqn.primitive.name != "squeeze":
                    why = f", then {eqn.primitive} of the slice"
                    raise refuse(lookups[atom].primitive, lookups[atom].invars[0].aval.shape, why)
        sliced = [a for a in jaxpr.outvars if not isinstance(a, jcore.Literal) and a in lookups]
        if sliced:
            eqn = lookups[sliced[0]]
            raise refuse(eqn.primitive, eqn.invars[0].aval.shape, ", returned as a slice")
        features = []
        for var in frontier:
            d = deps[var]
            if var.aval.shape != ():
                axis = "table"
            else:
                axis = "q" if "q" in d else "kv" if "kv" in d else "scalar"
            features.append(Feature(var, axis, "b" in d, "h" in d, np.dtype(var.aval.dtype)))
        mod = cls(jaxpr, tuple(outer), tuple(tile), tuple(features), name)
        return mod, list(closed.consts)

    def _outer_values(self, consts: Sequence[Any], b: Any, h: Any, q: Any, kv: Any) -> list[Any]:
        """The features at one scalar ``(b, h, q, kv)``, each in its carrier dtype."""
        env = dict(zip(self.jaxpr.constvars, consts, strict=True))
        # A score_mod's score is only read by the tile part: a zero stands in for it.
        score = (jnp.float32(0),) * (len(self.jaxpr.invars) - 4)
        env.update(zip(self.jaxpr.invars, (*score, b, h, q, kv), strict=True))
        for eqn in self.outer:
            env.update(
                zip(eqn.outvars, _bind(eqn, [_read(env, a) for a in eqn.invars]), strict=True)
            )
        return [jnp.asarray(env[f.var]).astype(f.carrier) for f in self.features]

    def feature_arrays(
        self,
        consts: Sequence[Any],
        batch: int,
        heads: int,
        q_len: int,
        kv_len: int,
        q_pad: int,
        kv_pad: int,
    ) -> list[jax.Array]:
        """The features for a call, each in its carrier dtype.

        A per-query feature is ``[B', N', q_pad]``, a per-key one ``[B', N', kv_pad]`` and a
        per-``(b, h)`` one ``[B' * N']``, with ``B' = batch`` when it depends on ``b`` else 1
        (``N'`` likewise). Padding positions repeat the last real one, so captured arrays
        are read in bounds (the kernels hide them with the length check).
        """
        out = []
        for index, f in enumerate(self.features):
            value = lambda b, h, q, kv, index=index: self._outer_values(consts, b, h, q, kv)[index]
            axes = {
                "b": jnp.arange(batch if f.batch else 1, dtype=jnp.int32),
                "h": jnp.arange(heads if f.head else 1, dtype=jnp.int32),
                "q": jnp.zeros((1,), jnp.int32),
                "kv": jnp.zeros((1,), jnp.int32),
            }
            if f.axis == "q":
                axes["q"] = jnp.minimum(jnp.arange(q_pad, dtype=jnp.int32), max(q_len - 1, 0))
            if f.axis == "kv":
                axes["kv"] = jnp.minimum(jnp.arange(kv_pad, dtype=jnp.int32), max(kv_len - 1, 0))
            for axis in (3, 2, 1, 0):  # innermost first: kv, q, h, b
                value = jax.vmap(value, in_axes=tuple(0 if i == axis else None for i in range(4)))
            grid = value(*(axes[a] for a in _ARGS))
            if f.axis == "q":
                out.append(grid[:, :, :, 0])
            elif f.axis == "kv":
                out.append(grid[:, :, 0, :])
            else:
                out.append(grid.reshape(-1))
        return out

    def _on_tile(self, args: Sequence[Any], shape: tuple[int, ...], values: Sequence[Any]) -> Any:
        """The mod's result on one tile (a scalar, or an array of ``shape``).

        Args:
            args: the mod's arguments on the tile (the score tile, ``b``, ``h``, the
                int32 positions of every element).
            shape: the tile's shape.
            values: per feature, its value broadcast to the tile (per-position features)
                or a scalar, in its carrier dtype.
        """
        env: dict[Any, Any] = dict(zip(self.jaxpr.invars, args, strict=True))
        for f, value in zip(self.features, values, strict=True):
            if f.axis == "table":  # read by `_lookup` (the ref itself, in the kernels)
                env[f.var] = value
                continue
            if f.dtype == np.bool_:
                value = value != 0
            elif f.dtype != f.carrier:
                value = value.astype(f.dtype)
            env[f.var] = value
        tables = {f.var for f in self.features if f.axis == "table"}
        looked_up = set()
        for eqn in self.tile:
            args = [_read(env, a) for a in eqn.invars]
            if eqn.primitive.name == "dynamic_slice" and eqn.invars[0] in tables:
                dtype = eqn.invars[0].aval.dtype
                env[eqn.outvars[0]] = _lookup(eqn, args[0], args[1:], shape, dtype)
                looked_up.add(eqn.outvars[0])
                continue
            if eqn.primitive.name == "squeeze" and eqn.invars[0] in looked_up:
                env[eqn.outvars[0]] = args[0]  # `_lookup` gave the element, not a slice
                continue
            axes = tuple(0 if jnp.ndim(x) == len(shape) else None for x in args)
            fn = lambda *xs, eqn=eqn: tuple(_bind(eqn, xs))
            outs = jax.vmap(jax.vmap(fn, in_axes=axes), in_axes=axes)(*args)
            env.update(zip(eqn.outvars, outs, strict=True))
        return _read(env, self.jaxpr.outvars[0])


class ModMask(_SplitMod):
    """A traced ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (`trace`), split for the kernels."""

    _ROLE = "mask_mod"
    _AVALS = (_INDEX,) * 4
    _DEPS = tuple(frozenset({a}) for a in _ARGS)

    def evaluate(
        self, b: Any, h: Any, q_ids: jax.Array, kv_ids: jax.Array, values: Sequence[Any]
    ) -> jax.Array:
        """The mask on one tile: bool of ``q_ids``' shape.

        Args:
            b, h: the tile's batch row and query head (int32 scalars).
            q_ids, kv_ids: int32 positions of every element of the tile (same shape).
            values: per feature, its value broadcast to the tile (per-position features)
                or a scalar, in its carrier dtype.
        """
        result = self._on_tile((b, h, q_ids, kv_ids), q_ids.shape, values)
        return jnp.broadcast_to(jnp.asarray(result, jnp.bool_), q_ids.shape)


class ModScore(_SplitMod):
    """A traced ``score_mod(score, b, h, q_idx, kv_idx)`` (`trace`), split for the kernels."""

    _ROLE = "score_mod"
    _AVALS = (_SCORE, *(_INDEX,) * 4)
    _DEPS = (_ELEMENT, *(frozenset({a}) for a in _ARGS))

    def evaluate(
        self,
        scores: jax.Array,
        b: Any,
        h: Any,
        q_ids: jax.Array,
        kv_ids: jax.Array,
        values: Sequence[Any],
    ) -> jax.Array:
        """The modified scores of one tile, float32 of ``scores``' shape.

        Args:
            scores: the tile's float32 scores (``softmax_scale * q·k``).
            b, h, q_ids, kv_ids, values: as in `ModMask.evaluate`.
        """
        result = self._on_tile((scores, b, h, q_ids, kv_ids), scores.shape, values)
        return jnp.broadcast_to(jnp.asarray(result, jnp.float32), scores.shape)
