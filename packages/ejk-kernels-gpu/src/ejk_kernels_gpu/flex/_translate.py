"""A user's mod, traced to a jaxpr, written out as the source of an elementwise `@triton.jit` function.

``mask_mod(b, h, q_idx, kv_idx)`` and ``score_mod(score, b, h, q_idx, kv_idx)`` are written
for scalars; traced once on abstract scalars (`jax.make_jaxpr`), every value of the jaxpr
is a scalar, except the arrays the mod captures and, at most, short index vectors. The
generated function takes tiles instead (``q_idx`` a column, ``kv_idx`` a row, the score a
``[BLOCK_M, BLOCK_N]`` tile, ``b`` and ``h`` scalars): Triton broadcasts each scalar
operation over them, so one line of source serves a whole tile.

Captured arrays are never materialised: a capture is a *view* (`_View`) of a flat buffer
(the int32 one for integer and bool captures, the float32 one for floating ones), which
``dynamic_slice``, ``slice``, ``gather`` and ``squeeze`` narrow with the computed indices
(clamped into bounds, as JAX clamps them), until a scalar view is read with one
``tl.load`` per element. Operations on literals alone are folded here (by running the
primitive on them). Anything else, or an operation on a whole captured array, raises
`Unsupported` naming the primitive: the backend refuses rather than computing something
else.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

__all__ = ["Capture", "Unsupported", "mod_function_source"]


class Unsupported(Exception):
    """A mod uses something the translation cannot express (the message says what)."""


@dataclasses.dataclass(frozen=True)
class Capture:
    """Where one captured array lives: ``buffer`` (``"ints"`` or ``"floats"``) from element
    ``offset``, row-major ``shape``; ``dtype`` is the capture's own (bool and integers are
    stored as int32, floats as float32)."""

    buffer: str
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class _Const:
    """A value known now (a literal, or one folded from literals)."""

    value: np.ndarray


@dataclasses.dataclass(frozen=True)
class _Expr:
    """A scalar (per element: a tile) computed in the kernel: a name of the generated source."""

    name: str
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class _Vec:
    """A short 1-D vector of scalars (an index vector of a gather)."""

    items: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class _View:
    """Part of a captured array: ``shape`` elements of ``capture``'s buffer from ``offset``
    (an int or an int32 `_Expr`), ``strides`` apart."""

    capture: Capture
    offset: Any
    shape: tuple[int, ...]
    strides: tuple[int, ...]


_TL_DTYPES = {"float32": "tl.float32", "int32": "tl.int32", "bool": "tl.int1"}
_BINARY = {
    "add": "({} + {})",
    "add_any": "({} + {})",
    "sub": "({} - {})",
    "mul": "({} * {})",
    "eq": "({} == {})",
    "ne": "({} != {})",
    "lt": "({} < {})",
    "le": "({} <= {})",
    "gt": "({} > {})",
    "ge": "({} >= {})",
    "and": "({} & {})",
    "or": "({} | {})",
    "xor": "({} ^ {})",
    "max": "tl.maximum({}, {})",
    "min": "tl.minimum({}, {})",
}
_FLOAT_UNARY = {
    "exp": "tl.exp({})",
    "exp2": "tl.math.exp2({})",
    "log": "tl.log({})",
    "log1p": "tl.log(1.0 + {})",
    "sqrt": "tl.sqrt({})",
    "rsqrt": "(1.0 / tl.sqrt({}))",
    "tanh": "flex_tanh({})",
    "logistic": "(1.0 / (1.0 + tl.exp(-{})))",
    "sin": "tl.sin({})",
    "cos": "tl.cos({})",
    "floor": "tl.floor({})",
    "ceil": "tl.ceil({})",
    "erf": "tl.math.erf({})",
}
# Calls whose body is another jaxpr: inlined (the param holding it differs across jax versions).
_INLINED = {
    "pjit": ("jaxpr",),
    "jit": ("jaxpr",),
    "closed_call": ("call_jaxpr",),
    "core_call": ("call_jaxpr",),
    "custom_jvp_call": ("call_jaxpr",),
    "custom_vjp_call": ("call_jaxpr", "fun_jaxpr"),
    "custom_vjp_call_jaxpr": ("fun_jaxpr",),
    "remat": ("jaxpr",),
    "checkpoint": ("jaxpr",),
}


_NAME = re.compile(r"\b[A-Za-z_]\w*\b")


def _dtype(aval: Any) -> np.dtype:
    return np.dtype(aval.dtype)


class _Writer:
    """Lines of one generated function, and the translation of each primitive into them."""

    def __init__(self, where: str):
        self.where = where
        self.lines: list[str] = []
        self.count = 0
        self.loads: dict[tuple[str, str], _Expr] = {}  # each element is read once
        # The tile axes each name varies along ("q": a column, "kv": a row): a value of
        # both is a whole [BLOCK_M, BLOCK_N] tile (see `load`).
        self.axes: dict[str, frozenset[str]] = {
            "score": frozenset({"q", "kv"}), "q_idx": frozenset({"q"}),
            "kv_idx": frozenset({"kv"}),
        }  # fmt: skip

    def refuse(self, what: str) -> Unsupported:
        return Unsupported(f"{self.where}: {what}")

    # -- values -----------------------------------------------------------------------
    def new(self, code: str, dtype: Any) -> _Expr:
        name = f"v{self.count}"
        self.count += 1
        self.lines.append(f"    {name} = {code}")
        used = (self.axes.get(word, frozenset()) for word in _NAME.findall(code))
        self.axes[name] = frozenset().union(*used)
        return _Expr(name, np.dtype(dtype))

    def code(self, x: Any) -> str:
        """Source of a scalar operand (a view of one element is loaded first)."""
        if isinstance(x, _View):
            x = self.load(x)
        if isinstance(x, _Expr):
            return x.name
        if isinstance(x, _Const):
            return _literal(x.value)
        raise self.refuse(f"a vector or array value {x!r} used as a scalar")

    def load(self, view: _View) -> _Expr:
        if view.shape:
            raise self.refuse(
                f"a captured array of shape {view.capture.shape} is used whole (shape "
                f"{view.shape}); only its elements, read at computed indices, can be"
            )
        cap = view.capture
        key = (cap.buffer, self.code_int(view.offset))
        if key not in self.loads:
            # A gather at a whole tile of indices (a relative-position table) reads through
            # `flex_load`, outside the loop's software pipeline; a row or column of them
            # (document ids) is a small pipelined load.
            tile = self.axes.get(key[1], frozenset()) == {"q", "kv"}
            load = "flex_load" if tile else "tl.load"
            loaded = self.new(f"{load}({key[0]} + {key[1]})", _stored(cap.dtype))
            if cap.dtype == np.bool_:
                loaded = self.new(f"({loaded.name} != 0)", np.bool_)
            self.loads[key] = loaded
        return self.loads[key]

    def code_int(self, x: Any) -> str:
        return str(int(x)) if isinstance(x, int | np.integer) else self.code(x)

    # -- views ------------------------------------------------------------------------
    def narrow(self, view: _View, starts: Sequence[Any], sizes: Sequence[int]) -> _View:
        """``view[starts : starts + sizes]``, each start clamped into ``[0, dim - size]``."""
        offset: Any = view.offset
        for start, size, dim, stride in zip(starts, sizes, view.shape, view.strides, strict=True):
            hi = dim - size
            if isinstance(start, _Const):
                start = int(np.clip(int(start.value), 0, hi))
                if start:
                    offset = self.offset_add(offset, start * stride)
                continue
            start = self.int_scalar(start)
            clamped = self.new(f"tl.minimum(tl.maximum({start.name}, 0), {hi})", np.int32)
            scaled = clamped if stride == 1 else self.new(f"({clamped.name} * {stride})", np.int32)
            offset = self.offset_add(offset, scaled)
        return _View(view.capture, offset, tuple(sizes), view.strides)

    def offset_add(self, offset: Any, extra: Any) -> Any:
        if isinstance(offset, int) and isinstance(extra, int):
            return offset + extra
        if isinstance(offset, int) and offset == 0:
            return extra
        return self.new(f"({self.code_int(offset)} + {self.code_int(extra)})", np.int32)

    def int_scalar(self, x: Any) -> _Expr:
        if isinstance(x, _View):
            x = self.load(x)
        if not isinstance(x, _Expr) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise self.refuse(f"an index that is not an integer scalar: {x!r}")
        return x


def _stored(dtype: np.dtype) -> np.dtype:
    """The dtype a capture of ``dtype`` has in its buffer."""
    return np.dtype(np.float32) if jnp.issubdtype(dtype, jnp.floating) else np.dtype(np.int32)


def _literal(value: np.ndarray) -> str:
    value = np.asarray(value)
    if value.shape != ():
        raise Unsupported(f"a constant array of shape {value.shape} used as a scalar")
    if value.dtype == np.bool_:
        return "True" if bool(value) else "False"
    if jnp.issubdtype(value.dtype, jnp.integer):
        return str(int(value))
    x = float(value)
    if math.isnan(x):
        return 'float("nan")'
    if math.isinf(x):
        return 'float("inf")' if x > 0 else 'float("-inf")'
    return repr(x)


def _read(env: dict[Any, Any], atom: Any) -> Any:
    if isinstance(atom, jcore.Literal):
        return _Const(np.asarray(atom.val, _dtype(atom.aval)))
    return env[atom]


def _fold(eqn: Any, args: list[Any]) -> list[Any] | None:
    """The outputs of ``eqn`` if every input is known now (the primitive run on them)."""
    if not all(isinstance(a, _Const) for a in args) or eqn.primitive.name in _INLINED:
        return None
    with jax.ensure_compile_time_eval():
        outs = eqn.primitive.bind(*(jnp.asarray(a.value) for a in args), **eqn.params)
    outs = outs if eqn.primitive.multiple_results else [outs]
    return [_Const(np.asarray(o)) for o in outs]


def _run(w: _Writer, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}
    for var, val in zip(jaxpr.constvars, consts, strict=True):
        env[var] = (
            val if isinstance(val, _Const | _Expr | _View | _Vec) else _Const(np.asarray(val))
        )
    for var, val in zip(jaxpr.invars, args, strict=True):
        env[var] = val
    for eqn in jaxpr.eqns:
        ins = [_read(env, a) for a in eqn.invars]
        outs = _fold(eqn, ins)
        if outs is None:
            outs = _primitive(w, eqn, ins)
        for var, val in zip(eqn.outvars, outs, strict=True):
            env[var] = val
    return [_read(env, a) for a in jaxpr.outvars]


def _primitive(w: _Writer, eqn: Any, ins: list[Any]) -> list[Any]:
    """The values of one equation whose inputs are not all known now."""
    name = eqn.primitive.name
    params = eqn.params
    out_aval = eqn.outvars[0].aval
    dtype = _dtype(out_aval)
    if name in _INLINED:
        for key in _INLINED[name]:
            if key in params:
                sub = params[key]
                inner = getattr(sub, "jaxpr", sub)
                return _run(w, inner, getattr(sub, "consts", ()), ins)
    if name in ("dynamic_slice", "slice", "gather", "squeeze", "reshape", "broadcast_in_dim",
                "concatenate", "copy", "copy_p", "convert_element_type", "stop_gradient",
                "optimization_barrier"):  # fmt: skip
        return [_structural(w, name, params, ins, out_aval)]
    if any(isinstance(x, _Vec) for x in ins):
        raise w.refuse(f"primitive {name!r} on an index vector")
    args = [w.code(x) for x in ins]
    if name in _BINARY:
        return [w.new(_BINARY[name].format(*args), dtype)]
    if name == "div":
        if jnp.issubdtype(dtype, jnp.integer):  # rounds towards zero, as lax.div
            return [w.new(f"flex_trunc_div({args[0]}, {args[1]})", dtype)]
        return [w.new(f"({args[0]} / {args[1]})", dtype)]
    if name == "rem":
        if jnp.issubdtype(dtype, jnp.integer):  # the dividend's sign, as lax.rem
            return [w.new(f"flex_trunc_rem({args[0]}, {args[1]})", dtype)]
        return [w.new(f"({args[0]} - {args[1]} * flex_trunc({args[0]} / {args[1]}))", dtype)]
    if name == "neg":
        return [w.new(f"(-{args[0]})", dtype)]
    if name == "not":
        op = "({} == 0)" if dtype == np.bool_ else "(~{})"
        return [w.new(op.format(args[0]), dtype)]
    if name == "abs":
        return [w.new(f"tl.abs({args[0]})", dtype)]
    if name == "sign":
        x = args[0]
        return [w.new(f"tl.where({x} > 0, 1, tl.where({x} < 0, -1, 0)).to({_tl(dtype)})", dtype)]
    if name == "square":
        return [w.new(f"({args[0]} * {args[0]})", dtype)]
    if name == "one_minus_square":  # tanh's slope in jax >= 0.12
        return [w.new(f"(1.0 - {args[0]} * {args[0]})", dtype)]
    if name == "polynomial":  # coefficients in ascending powers (jax >= 0.12's erf slope)
        value = args[-1]
        for coefficient in reversed(args[1:-1]):
            value = f"({value} * {args[0]} + {coefficient})"
        return [w.new(value, dtype)]
    if name == "bitcast_convert_type":
        if {_dtype(eqn.invars[0].aval).itemsize, dtype.itemsize} != {4}:
            raise w.refuse("primitive 'bitcast_convert_type' between types of other sizes")
        return [w.new(f"{args[0]}.to({_tl(dtype)}, bitcast=True)", dtype)]
    if name == "integer_pow":
        return [w.new(_integer_pow(args[0], int(params["y"])), dtype)]
    if name == "select_n":
        if len(args) != 3 or _dtype(eqn.invars[0].aval) != np.bool_:
            raise w.refuse("primitive 'select_n' with an integer predicate or more than two cases")
        return [w.new(f"tl.where({args[0]}, {args[2]}, {args[1]})", dtype)]
    if name == "clamp":
        return [w.new(f"tl.minimum(tl.maximum({args[1]}, {args[0]}), {args[2]})", dtype)]
    if name == "is_finite":
        return [w.new(f"(tl.abs({args[0]}) < float('inf'))", dtype)]
    if name in _FLOAT_UNARY and jnp.issubdtype(dtype, jnp.floating):
        return [w.new(_FLOAT_UNARY[name].format(args[0]), dtype)]
    raise w.refuse(f"primitive {name!r} has no Triton translation")


def _tl(dtype: np.dtype) -> str:
    try:
        return _TL_DTYPES[np.dtype(dtype).name]
    except KeyError:
        raise Unsupported(f"values of dtype {np.dtype(dtype).name} (the kernels compute in "
                          "float32, int32 and bool)") from None  # fmt: skip


def _integer_pow(x: str, y: int) -> str:
    if y == 0:
        return f"({x} * 0 + 1)"
    power = " * ".join([x] * abs(y))
    return f"({power})" if y > 0 else f"(1.0 / ({power}))"


def _structural(w: _Writer, name: str, params: dict[str, Any], ins: list[Any], aval: Any) -> Any:
    """Indexing of captured arrays, index vectors, conversions: what is not elementwise."""
    x = ins[0]
    shape = tuple(aval.shape)
    if name in ("dynamic_slice", "slice", "gather") and isinstance(x, _Const):
        raise w.refuse(
            f"primitive {name!r} of an array made inside the mod (its values are constants "
            "of the trace): make it outside and let the mod capture it"
        )
    if name in ("copy", "copy_p", "stop_gradient", "optimization_barrier"):
        return x
    if name == "convert_element_type":
        return _convert(w, x, np.dtype(params["new_dtype"]))
    if name == "dynamic_slice":
        if not isinstance(x, _View):
            raise w.refuse("primitive 'dynamic_slice' of a value that is not a captured array")
        return w.narrow(x, ins[1:], params["slice_sizes"])
    if name == "slice":
        if not isinstance(x, _View) or (params.get("strides") or None) not in (
            None,
            (1,) * len(shape),
        ):
            raise w.refuse("primitive 'slice' of a value that is not a captured array, or strided")
        starts = [_Const(np.int32(s)) for s in params["start_indices"]]
        sizes = [
            hi - lo for lo, hi in zip(params["start_indices"], params["limit_indices"], strict=True)
        ]
        return w.narrow(x, starts, sizes)
    if name == "gather":
        return _gather(w, x, ins[1], params, shape)
    if name in ("squeeze", "reshape", "broadcast_in_dim"):
        return _reshape(w, name, x, shape)
    if name == "concatenate":
        items: list[Any] = []
        for part in ins:
            items += _as_items(w, part)
        return _Vec(tuple(items))
    raise w.refuse(f"primitive {name!r} has no Triton translation")


def _convert(w: _Writer, x: Any, new: np.dtype) -> Any:
    if isinstance(x, _View):
        x = w.load(x)
    if isinstance(x, _Vec):
        return _Vec(tuple(_convert(w, i, new) for i in x.items))
    old = x.dtype if isinstance(x, _Expr) else np.asarray(x.value).dtype
    if jnp.issubdtype(new, jnp.floating) and new != np.float32:
        raise w.refuse(f"a conversion to {new.name} (the kernels compute scores in float32)")
    if jnp.issubdtype(new, jnp.integer) and new != np.int32:
        raise w.refuse(f"a conversion to {new.name} (the kernels compute indices in int32)")
    if old == new:
        return x
    if new == np.bool_:
        return w.new(f"({w.code(x)} != 0)", new)
    return w.new(f"({w.code(x)}).to({_tl(new)})", new)


def _reshape(w: _Writer, name: str, x: Any, shape: tuple[int, ...]) -> Any:
    """Reshapes that only add or drop axes of size 1 (a scalar to ``[1]``, a ``[1, 1]``
    slice of a capture to a scalar)."""
    if isinstance(x, _View):
        kept = [(d, s) for d, s in zip(x.shape, x.strides, strict=True) if d != 1]
        if tuple(d for d, _ in kept) != tuple(d for d in shape if d != 1):
            raise w.refuse(f"primitive {name!r} reshaping a captured array {x.shape} -> {shape}")
        strides = iter(s for _, s in kept)
        return _View(
            x.capture, x.offset, shape, tuple(1 if d == 1 else next(strides) for d in shape)
        )
    items = _as_items(w, x)
    size = int(np.prod(shape, dtype=np.int64))
    if len(items) == 1 and size >= 1 and len(shape) <= 1:
        return items[0] if shape == () else _Vec(tuple(items) * size)
    if len(items) == size and len(shape) <= 1:
        return items[0] if shape == () else _Vec(tuple(items))
    raise w.refuse(f"primitive {name!r} to shape {shape} on a computed value")


def _as_items(w: _Writer, x: Any) -> list[Any]:
    if isinstance(x, _Vec):
        return list(x.items)
    if isinstance(x, _Const) and np.ndim(x.value) == 1:
        return [_Const(np.asarray(v)) for v in x.value]
    if isinstance(x, _Const) and np.ndim(x.value) == 0:
        return [x]
    if isinstance(x, _Expr) or (isinstance(x, _View) and not x.shape):
        return [x]
    raise w.refuse(f"a value of unexpected shape in an index vector: {x!r}")


def _gather(
    w: _Writer, x: Any, indices: Any, params: dict[str, Any], shape: tuple[int, ...]
) -> Any:
    """``lax.gather`` of a captured array at one index vector (no batch dimensions), as
    jnp's indexing by scalars emits it: a `narrow` with the vector's entries."""
    if not isinstance(x, _View):
        raise w.refuse("primitive 'gather' of a value that is not a captured array")
    mode = str(params.get("mode", ""))
    if "FILL" in mode.upper():
        raise w.refuse(
            "primitive 'gather' with mode='fill' (out-of-bounds reads give a fill value; "
            "index in bounds or use mode='clip')"
        )
    dn = params["dimension_numbers"]
    if getattr(dn, "operand_batching_dims", ()) or getattr(dn, "start_indices_batching_dims", ()):
        raise w.refuse("primitive 'gather' with batching dimensions")
    items = _as_items(w, indices)
    if len(items) != len(dn.start_index_map):
        raise w.refuse("primitive 'gather' with more than one index vector")
    starts: list[Any] = [_Const(np.int32(0))] * len(x.shape)
    for dim, item in zip(dn.start_index_map, items, strict=True):
        starts[dim] = item
    view = w.narrow(x, starts, params["slice_sizes"])
    kept = tuple(d for i, d in enumerate(view.shape) if i not in dn.collapsed_slice_dims)
    if kept != shape:
        raise w.refuse(f"primitive 'gather' giving shape {shape}")
    strides = tuple(s for i, s in enumerate(view.strides) if i not in dn.collapsed_slice_dims)
    return _View(view.capture, view.offset, kept, strides)


def _live(lines: list[str], result: str) -> list[str]:
    """``lines`` without those whose value nothing returned depends on (the derivative's
    jaxpr keeps the primal's computation; the interpreter would run it)."""
    needed = set(re.findall(r"\bv\d+\b", result))
    kept = []
    for line in reversed(lines):
        name, code = line.strip().split(" = ", 1)
        if name in needed:
            needed |= set(re.findall(r"\bv\d+\b", code))
            kept.append(line)
    return kept[::-1]


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))


def mod_function_source(
    name: str,
    jaxpr: Any,
    captures: Sequence[Capture],
    arg_names: Sequence[str],
    where: str,
    result: Callable[[str, np.dtype], str] | None = None,
) -> str:
    """Source of ``@triton.jit def name(*arg_names, ints, floats)`` computing ``jaxpr``.

    Args:
        name: the function's name.
        jaxpr: a closed jaxpr whose invars are the captures, then one per ``arg_names``
            (scalars of the mod's signature).
        captures: where each captured array lives (`Capture`).
        arg_names: the generated function's tile arguments, in the mod's order.
        where: the mod, for messages.
        result: how the one output is returned (default: as it is).

    Raises:
        Unsupported: a primitive or a use of a capture without a translation (named).
    """
    w = _Writer(where)
    views = [_View(c, c.offset, c.shape, _strides(c.shape)) for c in captures]
    invars = jaxpr.jaxpr.invars[len(views) :]
    args = [_Expr(a, np.dtype(v.aval.dtype)) for a, v in zip(arg_names, invars, strict=True)]
    (out,) = _run(w, jaxpr.jaxpr, jaxpr.consts, [*views, *args])
    out_dtype = np.dtype(jaxpr.jaxpr.outvars[0].aval.dtype)
    code = w.code(out)
    body = "\n".join(_live(w.lines, code))
    ret = code if result is None else result(code, out_dtype)
    params = ", ".join([*arg_names, "ints", "floats"])
    return f"@triton.jit\ndef {name}({params}):\n{body}\n    return {ret}\n"
