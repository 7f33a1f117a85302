"""Recording invocations (abstractly) to tune them later."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from ._kernel import Invocation, Kernel

__all__ = ["autotune_recorded", "clear_invocations", "get_invocations", "record_invocation"]

_lock = threading.Lock()
_recorded: dict[str, Invocation[Any, Any]] = {}


def record_invocation(kernel: Kernel[Any, Any], inv: Invocation[Any, Any]) -> None:
    """Remember ``inv`` (once per call key), keeping only its abstract form: no arrays,
    no tracers, so recording inside ``jax.jit`` leaks nothing. Thread-safe."""
    if not isinstance(inv, Invocation):
        raise TypeError(f"inv must be an Invocation, got {type(inv).__name__}")
    if inv.kernel is not kernel:
        raise ValueError(f"inv is an invocation of {inv.kernel!r}, not of kernel={kernel!r}")
    with _lock:
        if inv.call_key not in _recorded:
            _recorded[inv.call_key] = inv.abstract()


def get_invocations() -> list[Invocation[Any, Any]]:
    """The recorded invocations, in order of first recording."""
    with _lock:
        return list(_recorded.values())


def clear_invocations() -> None:
    """Forget every recorded invocation."""
    with _lock:
        _recorded.clear()


def autotune_recorded(
    invocations: Iterable[Invocation[Any, Any]] | None = None, chain: Any = None
) -> dict[str, Any]:
    """Tune each invocation (default: every recorded one) and fill ``chain``'s caches.

    Args:
        invocations: the invocations to tune; default: `get_invocations()`.
        chain: the `ConfigSelectorChain` whose memory (and persistent) cache receives
            the winners; default: a new chain (then only the returned dict has them).

    Returns:
        {call key: best config}.
    """
    from ._selection import ConfigSelectorChain

    if chain is None:
        chain = ConfigSelectorChain()
    if not isinstance(chain, ConfigSelectorChain):
        raise TypeError(f"chain must be a ConfigSelectorChain, got {type(chain).__name__}")
    invs = get_invocations() if invocations is None else list(invocations)
    return {inv.call_key: chain.tune(inv.abstract()) for inv in invs}
