"""The flex backends and the fall-through between them (the facade's `Backend` pattern).

Each backend is a `ejk_attention._backends.Backend` taking a `FlexRequest`. The XLA one
serves every call on every platform; the Pallas one (`_pallas`: the TPU block-sparse
kernels, their interpreter elsewhere) serves mask_mods without a score_mod; the Triton one
(`_triton`: ``ejk_kernels_gpu``'s flex kernels, Triton's interpreter off GPU) serves both
mods where it can translate them. ``implementation=None`` tries ``triton`` then ``xla``
on GPUs, ``pallas`` then ``xla`` on TPU, ``xla`` elsewhere.
"""

from __future__ import annotations

from typing import Any

from .._backends import Backend, platform_of, resolve_implementation, run_first
from ._pallas import PallasFlexBackend
from ._request import FlexRequest
from ._triton import TritonFlexBackend
from ._xla import xla_flex_attention

__all__ = ["FLEX_BACKENDS", "FLEX_IMPLEMENTATIONS", "run_flex"]


class XlaFlexBackend(Backend):
    """The definition in chunked jnp (`_xla`): every mod, every platform."""

    name = "xla"

    def run(self, request: FlexRequest, config: Any, bwd_config: Any) -> Any:
        del config, bwd_config  # no performance knobs
        return xla_flex_attention(request)


class Unavailable(Backend):
    """A backend name ``flex_attention`` knows but has no kernel for: it refuses every call."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason

    def supported(self, request: Any, platform: str) -> str | None:
        del request, platform
        return self.reason


FLEX_BACKENDS: dict[str, Backend] = {
    "xla": XlaFlexBackend(),
    "triton": TritonFlexBackend(),
    "pallas": PallasFlexBackend(),
    "cudnn": Unavailable("cudnn", "cuDNN (through jax.nn) takes no mask_mod or score_mod"),
}
FLEX_IMPLEMENTATIONS: tuple[str, ...] = tuple(FLEX_BACKENDS)


def _default_order(platform: str) -> tuple[str, ...]:
    """What ``implementation=None`` tries, in order, on ``platform``."""
    if platform in ("gpu", "cuda", "rocm"):
        return ("triton", "xla")
    if platform == "tpu":
        return ("pallas", "xla")
    return ("xla",)


def run_flex(request: FlexRequest, implementation: Any, config: Any) -> Any:
    """``request`` on the first backend of ``implementation`` (None: the platform's order)
    that serves it.

    Raises:
        ValueError, TypeError: an unknown or malformed ``implementation``.
        NotImplementedError: none of the named backends can serve the call (each reason given).
    """
    names = resolve_implementation(implementation, FLEX_IMPLEMENTATIONS)
    if names is None:
        names = _default_order(platform_of(request))
    return run_first(request, names, config, None, backends=FLEX_BACKENDS)[1]
