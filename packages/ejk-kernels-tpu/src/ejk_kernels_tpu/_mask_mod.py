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

A non-scalar value read at an element that depends on both positions (a captured table
indexed by ``q_idx - kv_idx``) has no such split: `ModMask.trace` / `ModScore.trace`
refuse it.
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
        axis: ``"q"`` (one value per query), ``"kv"`` (per key) or ``"scalar"`` (per ``(b, h)``).
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
        outer, tile, frontier = [], [], {}

        def dep(atom: Any) -> frozenset[str]:
            return frozenset() if isinstance(atom, jcore.Literal) else deps[atom]

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
        for atom in jaxpr.outvars:  # a mod that ignores q_idx or kv_idx is itself a feature
            if not isinstance(atom, jcore.Literal) and atom not in jaxpr.invars:
                if not {"q", "kv"} <= deps[atom]:
                    frontier[atom] = None
        features = []
        for var, eqn in frontier.items():
            if var.aval.shape != ():
                raise NotImplementedError(
                    f"the Pallas flex kernel cannot evaluate {cls._ROLE} {name!r}: its "
                    f"{eqn.primitive if eqn is not None else 'result'} reads an array of shape "
                    f"{var.aval.shape} (a captured array) at a position that depends on both "
                    "q_idx and kv_idx; the kernel takes captured values per query, per key or "
                    "per (b, h) only (use implementation='xla')"
                )
            d = deps[var]
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
            if f.dtype == np.bool_:
                value = value != 0
            elif f.dtype != f.carrier:
                value = value.astype(f.dtype)
            env[f.var] = value
        for eqn in self.tile:
            args = [_read(env, a) for a in eqn.invars]
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
