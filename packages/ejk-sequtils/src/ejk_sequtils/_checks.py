"""Argument checks shared by the public functions.

Checks on shapes and dtypes always run (they are static under ``jax.jit``).
Checks on values run only when the value is concrete: a traced value cannot be
inspected, so those functions document what they return for bad traced input.
Messages show what the user passed by `describe_value`: an array (or a nested list)
by its type, shape and dtype, never its elements, so a bad call cannot flood a terminal.
"""

import reprlib
from typing import Any

import jax
import numpy as np

# A value that is not an array is shown by a repr this short at most.
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_SHORT = 4  # a flat list or tuple up to this long is shown by its values (a window pair)


def describe_value(x: Any) -> str:
    """``x`` as an error message shows it: its shape and dtype, never an array's values.

    Arrays and tracers give ``"<type> of shape (...) and dtype <dtype>"``; a nested or long
    list or tuple its type and shape (a ragged one its length); a short flat one (a window
    pair) and anything else a bounded repr and its type.
    """
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{type(x).__name__} of shape {tuple(x.shape)} and dtype {x.dtype}"
    short = isinstance(x, list | tuple) and len(x) <= _SHORT
    if short and not any(isinstance(e, list | tuple) or hasattr(e, "shape") for e in x):
        return f"{_REPR.repr(x)} of type {type(x).__name__}"
    if isinstance(x, list | tuple):
        try:
            shape = np.shape(x)
        except ValueError:  # ragged nesting
            return f"{type(x).__name__} of length {len(x)}"
        return f"{type(x).__name__} of shape {shape}"
    return f"{_REPR.repr(x)} of type {type(x).__name__}"


def concrete_or_none(x) -> np.ndarray | None:
    """``x`` as a host NumPy array when it is concrete, None when it is traced."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def static_int(x, *, fn: str, name: str, static_arg: str) -> int:
    """A value-dependent length as a Python int, or a clear error when it is traced."""
    try:
        return int(x)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        raise ValueError(
            f"{fn}: the output length depends on the values of {name}, which is traced "
            f"(inside jax.jit, vmap or grad); pass the static length as {static_arg}="
        ) from None


def check_positive_int(value, name: str) -> int:
    """``value`` as an int when it is a positive integer (not a bool), else an error."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be a Python int, got {describe_value(value)}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {name}={value}")
    return int(value)


def check_optional_length(value, name: str) -> int | None:
    """A static length argument: None, or an int >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be a Python int or None, got {describe_value(value)}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {name}={value}")
    return int(value)


def check_integer_array(x, name: str, ndim: int | None = None) -> None:
    """An integer array, with ``ndim`` dimensions when given."""
    dtype = np.dtype(x.dtype)
    if not np.issubdtype(dtype, np.integer):
        raise TypeError(f"{name} must have an integer dtype, got {name}.dtype={dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {name}.shape={tuple(x.shape)}")


def check_non_decreasing(values: np.ndarray, name: str) -> None:
    """A concrete offsets array never decreases; the error shows the first drop only."""
    drops = np.flatnonzero(np.diff(values) < 0)
    if drops.size:
        i = int(drops[0])
        raise ValueError(
            f"{name} must be non-decreasing, got {name}[{i}]={values[i]} > "
            f"{name}[{i + 1}]={values[i + 1]}"
        )


def check_cu_seqlens(cu_seqlens, total_length: int | None = None) -> None:
    """``cu_seqlens`` as `validate_attention` accepts ``cu_seqlens_q``, and within ``total_length``.

    A jax or NumPy integer array of rank 1 with at least 2 entries (one sequence, which
    may be empty); when concrete, its values start at exactly 0, never decrease and, when
    ``total_length`` is given, end at or before it. The rules and messages are those of
    ``ejk_sequtils._request._validate_cu_seqlens``, so a ``cu_seqlens`` these helpers
    take is one the attention call takes (a test holds the two to the same table).
    """
    if isinstance(cu_seqlens, np.generic):
        cu_seqlens = np.asarray(cu_seqlens)
    if not isinstance(cu_seqlens, jax.Array | np.ndarray):
        raise TypeError(
            f"cu_seqlens must be an integer jax or NumPy array, got {describe_value(cu_seqlens)}"
        )
    check_integer_array(cu_seqlens, "cu_seqlens")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(
            "cu_seqlens must be rank 1 [num_seqs + 1] with >= 2 entries, got "
            f"cu_seqlens.shape={tuple(cu_seqlens.shape)}"
        )
    values = concrete_or_none(cu_seqlens)
    if values is None:
        return
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0]={int(values[0])}")
    check_non_decreasing(values, "cu_seqlens")
    if total_length is not None and values[-1] > total_length:
        raise ValueError(
            f"cu_seqlens ends at cu_seqlens[-1]={int(values[-1])}, past {total_length=}: "
            "pass a total_length of at least cu_seqlens[-1]"
        )
