"""Stable, typed, collision-free keys for configs and call arguments.

``stable_json`` turns a value into canonical JSON in which every node carries
its type: ``1``, ``1.0``, ``True`` and ``"1"`` encode differently, a dict with
``None`` under a key differs from one without the key, struct fields are keyed
by name, and sets are sorted by their encoding, so the text (and every hash of
it) is the same in every process whatever ``PYTHONHASHSEED`` is. Values that
have no stable identity (arbitrary objects whose only description is their
memory address) are rejected with a ``TypeError`` rather than keyed by
``id()`` or a ``repr``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import types
from typing import Any

import jax
import msgspec
import numpy as np

__all__ = ["get_safe_hash_int", "hash_fn", "short_hash", "stable_json"]


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def _dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def _sharding(sharding: Any) -> Any:
    """A stable description of a jax sharding; single-device placement counts as none."""
    if sharding is None:
        return None
    kind = type(sharding).__name__
    if kind == "SingleDeviceSharding":
        return None
    mesh = getattr(sharding, "mesh", None)
    spec = getattr(sharding, "spec", None)
    if mesh is not None and spec is not None:
        axes = [[str(name), int(size)] for name, size in mesh.shape.items()]
        return ["named", axes, _encode(tuple(spec))]
    return ["sharding", kind, str(sharding)]


def _is_scalar_type(obj: Any) -> bool:
    """NumPy scalar types and jnp's (``jnp.float32``, ``jnp.bfloat16``), which are classes."""
    if not isinstance(obj, type):
        return False
    return issubclass(obj, np.generic) or isinstance(getattr(obj, "dtype", None), np.dtype)


def _is_array_like(obj: Any) -> bool:
    return hasattr(obj, "shape") and hasattr(obj, "dtype") and not isinstance(obj, np.generic)


def _code(code: types.CodeType) -> str:
    """A digest of a code object: bytecode, names and constants (nested code included)."""
    h = hashlib.sha256(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        h.update(
            _code(const).encode() if isinstance(const, types.CodeType) else repr(const).encode()
        )
    return h.hexdigest()[:16]


def _callable(obj: Any) -> list[Any]:
    """Functions are keyed by module and qualified name, plus their code and defaults
    when the name alone is ambiguous (lambdas and functions defined inside functions)."""
    name = _qualname(obj)
    node: list[Any] = ["callable", name]
    code = getattr(obj, "__code__", None)
    if isinstance(code, types.CodeType) and ("<lambda>" in name or "<locals>" in name):
        node.append(_code(code))
        closure = getattr(obj, "__closure__", None) or ()
        cells = [cell.cell_contents for cell in closure]
        node.append([["self"] if c is obj else _encode(c) for c in cells])
    defaults = getattr(obj, "__defaults__", None)
    if defaults:
        node.append(_encode(tuple(defaults)))
    return node


def _encode(obj: Any) -> Any:
    """The typed JSON tree of ``obj`` (see the module docstring)."""
    if obj is None:
        return ["none"]
    if isinstance(obj, bool):
        return ["bool", obj]
    if isinstance(obj, enum.Enum):
        return ["enum", _qualname(type(obj)), obj.name]
    if isinstance(obj, int):
        return ["int", str(obj)]
    if isinstance(obj, float):
        return ["float", repr(obj)]
    if isinstance(obj, complex):
        return ["complex", repr(obj)]
    if isinstance(obj, str):
        return ["str", obj]
    if isinstance(obj, bytes):
        return ["bytes", obj.hex()]
    if isinstance(obj, np.generic):
        return ["scalar", obj.dtype.name, repr(obj.item())]
    if isinstance(obj, np.dtype) or _is_scalar_type(obj):
        return ["dtype", _dtype_name(obj)]
    if isinstance(obj, msgspec.Struct):
        fields = [[name, _encode(getattr(obj, name))] for name in obj.__struct_fields__]
        return ["struct", _qualname(type(obj)), fields]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [[f.name, _encode(getattr(obj, f.name))] for f in dataclasses.fields(obj)]
        return ["dataclass", _qualname(type(obj)), fields]
    stable_key = getattr(type(obj), "__ejk_stable_key__", None)
    if stable_key is not None:
        return ["keyed", _qualname(type(obj)), _encode(stable_key(obj))]
    if isinstance(obj, dict):
        items = [[_encode(k), _encode(v)] for k, v in obj.items()]
        items.sort(key=lambda kv: _dumps(kv[0]))
        return ["dict", items]
    if isinstance(obj, list):
        return ["list", [_encode(x) for x in obj]]
    if isinstance(obj, tuple):
        tag = "tuple" if type(obj) is tuple else _qualname(type(obj))
        return ["tuple", tag, [_encode(x) for x in obj]]
    if isinstance(obj, set | frozenset):
        return ["set", sorted((_encode(x) for x in obj), key=_dumps)]
    if isinstance(obj, jax.sharding.PartitionSpec):
        return ["pspec", [_encode(x) for x in obj]]
    if isinstance(obj, jax.sharding.Mesh):
        return ["mesh", [[str(name), int(size)] for name, size in obj.shape.items()]]
    if isinstance(obj, jax.sharding.Sharding):
        return ["sharding", _sharding(obj)]
    if isinstance(obj, functools.partial):
        return ["partial", _encode(obj.func), _encode(obj.args), _encode(obj.keywords)]
    if _is_array_like(obj):
        try:
            sharding = _sharding(getattr(obj, "sharding", None))
        except Exception:  # tracers may refuse to report a sharding
            sharding = None
        return ["array", [int(d) for d in obj.shape], _dtype_name(obj.dtype), sharding]
    if isinstance(obj, type) or (callable(obj) and hasattr(obj, "__qualname__")):
        return _callable(obj)
    raise TypeError(
        f"stable_json cannot key a value of type {_qualname(type(obj))}: give the class a "
        "__ejk_stable_key__(self) method returning plain data, or pass plain data instead"
    )


def _dumps(tree: Any) -> str:
    return json.dumps(tree, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def stable_json(obj: Any) -> str:
    """Canonical, typed JSON text of ``obj``, identical in every process.

    Handles None, bools, ints, floats, strings, bytes, enums, NumPy scalars and
    dtypes, msgspec Structs and dataclasses (class name and every field, set or
    not), dicts (any hashable keys), lists, tuples (named tuples by class), sets,
    ``functools.partial`` (function plus bound arguments), functions and classes
    (module and qualified name; lambdas and local functions also by their code,
    defaults and closure values), arrays, tracers and ``jax.ShapeDtypeStruct``
    (shape, dtype and a non-trivial sharding, never the values), and any class
    with a ``__ejk_stable_key__(self)`` method.

    Raises:
        TypeError: for a value with no stable identity, naming its type.
    """
    try:
        return _dumps(_encode(obj))
    except RecursionError:
        raise TypeError("stable_json cannot key a self-referencing value") from None


def short_hash(obj: Any, length: int = 16) -> str:
    """The first ``length`` hex digits of the SHA-256 of :func:`stable_json`."""
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= 64:
        raise ValueError(f"length must be an int in [1, 64], got {length=!r}")
    return hashlib.sha256(stable_json(obj).encode()).hexdigest()[:length]


def get_safe_hash_int(obj: Any, algorithm: str = "sha256") -> int:
    """An integer digest of :func:`stable_json` under a hashlib ``algorithm``."""
    if algorithm not in hashlib.algorithms_available:
        raise ValueError(f"unknown hash algorithm {algorithm=!r}")
    digest = hashlib.new(algorithm, stable_json(obj).encode()).digest()
    return int.from_bytes(digest, "big")


def hash_fn(self: Any) -> int:
    """A ``__hash__`` for config classes: 63 bits of :func:`get_safe_hash_int`,
    the same in every process."""
    return get_safe_hash_int(self) & ((1 << 63) - 1)
