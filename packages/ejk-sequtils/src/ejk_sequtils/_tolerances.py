"""The one table of tolerances every ejk test compares attention results with.

Each entry bounds ``|actual - expected| <= tol + tol·|expected|`` against the float32
reference run on the same (rounded) inputs. A backend that needs more is wrong, or
computes something else: widen an entry here, for every backend, with a reason.
"""

from __future__ import annotations

from types import MappingProxyType

import jax.numpy as jnp
import numpy as np

__all__ = ["ATTENTION_TOLERANCES", "attention_tolerance"]

_QUANTITIES = ("out", "lse", "grad")

ATTENTION_TOLERANCES = MappingProxyType(
    {
        # float32 inputs: kernels accumulate in float32 but sum in another order (and the
        # Pallas interpreter's dots run at default precision).
        "float32": MappingProxyType({"out": 1e-4, "lse": 1e-4, "grad": 2e-4}),
        # 16-bit inputs: probabilities are rounded to the input dtype before p·v (every
        # flash kernel does this), so out and the gradients carry that dtype's rounding.
        "float16": MappingProxyType({"out": 4e-3, "lse": 2e-3, "grad": 2e-2}),
        "bfloat16": MappingProxyType({"out": 3e-2, "lse": 1e-2, "grad": 5e-2}),
    }
)


# A call whose arithmetic runs in a wider dtype than its inputs (Triton's interpreter runs
# bfloat16 calls in float32) rounds to the inputs' dtype only where it stores: each
# quantity is then off the reference on the same rounded inputs by the wider dtype's
# tolerance plus one machine epsilon of the inputs' dtype per rounding it passes through.
# out: its own store. lse: none (stored in float32). Gradients: their own store, the
# output's (delta = rowsum(dO·O) reads it, and dS = P·(dP - delta) cancels) and the
# cotangent's (the output's dtype).
_ROUNDINGS = MappingProxyType({"out": 1, "lse": 0, "grad": 3})


def _name(dtype: object) -> str:
    name = np.dtype(dtype).name
    if name not in ATTENTION_TOLERANCES:
        raise ValueError(f"no attention tolerance for dtype={name!r}")
    return name


def attention_tolerance(
    dtype: object, quantity: str = "out", *, computed_in: object | None = None
) -> float:
    """The tolerance (used as both atol and rtol) for ``quantity`` of a call in ``dtype``.

    Args:
        dtype: the inputs' dtype (anything `numpy.dtype` takes, bfloat16 included).
        quantity: ``"out"``, ``"lse"`` or ``"grad"`` (any of dq, dk, dv, dbias, dsinks).
        computed_in: the dtype the call's arithmetic runs in, where it is wider than
            ``dtype`` (bfloat16 in Triton's interpreter: float32); None: ``dtype``. The
            tolerance is then ``computed_in``'s plus one epsilon of ``dtype`` per rounding
            to ``dtype`` that ``quantity`` passes through (out 1, lse 0, gradients 3), far
            tighter than ``dtype``'s own entry, which allows for 16-bit arithmetic.
    """
    if quantity not in _QUANTITIES:
        raise ValueError(f"quantity must be one of {_QUANTITIES}, got {quantity!r}")
    name = _name(dtype)
    if computed_in is None or _name(computed_in) == name:
        return ATTENTION_TOLERANCES[name][quantity]
    wide = _name(computed_in)
    eps = float(jnp.finfo(name).eps)
    if jnp.finfo(wide).eps >= eps:
        raise ValueError(f"computed_in={wide!r} must be wider than dtype={name!r}")
    return ATTENTION_TOLERANCES[wide][quantity] + _ROUNDINGS[quantity] * eps
