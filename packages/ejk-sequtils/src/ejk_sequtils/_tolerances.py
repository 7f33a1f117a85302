"""The one table of tolerances every ejk test compares attention results with.

Each entry bounds ``|actual - expected| <= tol + tol·|expected|`` against the float32
reference run on the same (rounded) inputs. A backend that needs more is wrong, or
computes something else: widen an entry here, for every backend, with a reason.
"""

from __future__ import annotations

from types import MappingProxyType

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


def attention_tolerance(dtype: object, quantity: str = "out") -> float:
    """The tolerance (used as both atol and rtol) for ``quantity`` of a call in ``dtype``.

    Args:
        dtype: the inputs' dtype (anything `numpy.dtype` takes, bfloat16 included).
        quantity: ``"out"``, ``"lse"`` or ``"grad"`` (any of dq, dk, dv, dbias, dsinks).
    """
    if quantity not in _QUANTITIES:
        raise ValueError(f"quantity must be one of {_QUANTITIES}, got {quantity!r}")
    name = np.dtype(dtype).name
    if name not in ATTENTION_TOLERANCES:
        raise ValueError(f"no attention tolerance for dtype={name!r}")
    return ATTENTION_TOLERANCES[name][quantity]
