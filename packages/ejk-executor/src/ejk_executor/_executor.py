"""The `Executor`: chooses a config for a call, then runs the kernel with it."""

from __future__ import annotations

import enum
import threading
from typing import Any

import jax
import msgspec

from ._cache import active_overlays
from ._kernel import Invocation, Kernel
from ._labels import config_label
from ._registry import record_invocation
from ._selection import _OVERRIDE, ConfigSelectorChain, Selection
from ._tuning import make_body, split_leaves

__all__ = ["Executor"]


class Executor:
    """Runs kernels with the config its chain chooses.

    ``Executor(chain)(kernel, *args, cfg=None, **kwargs)`` builds the call's
    `Invocation`, asks ``chain`` for a config (an explicit ``cfg`` wins), and runs
    the kernel's ``run_<platform>`` (or ``run``) with it, under the HLO label of
    that config and with the kernel's custom backward attached if it has one.

    Eager calls go through a ``jax.jit`` of the kernel kept per call key and
    config; a repeated eager call with the same shapes, dtypes, shardings and
    static arguments skips the key computation (while the memory cache is
    unchanged, no overlay or policy override is active and ``record`` is off). Inside ``jax.jit``
    the selection happens once, at trace time, and the compiled program holds
    only the chosen kernel.

    Args:
        chooser: the selection chain (default: a heuristic-only chain with a memory cache).
        record: record every distinct call (abstractly) with `record_invocation`.
    """

    def __init__(self, chooser: ConfigSelectorChain | None = None, *, record: bool = False):
        if chooser is None:
            chooser = ConfigSelectorChain()
        if not isinstance(chooser, ConfigSelectorChain):
            raise TypeError(f"chooser must be a ConfigSelectorChain, got {type(chooser).__name__}")
        self.chooser = chooser
        self.record = record
        self._lock = threading.Lock()
        self._bodies: dict[tuple[str, str], Any] = {}
        self._fast: dict[Any, tuple[Any, int, Any]] = {}

    def __repr__(self) -> str:
        return f"Executor({self.chooser!r}, record={self.record})"

    def invocation(
        self, kernel: Kernel[Any, Any], *args: Any, **kwargs: Any
    ) -> Invocation[Any, Any]:
        """The `Invocation` of ``kernel(*args, **kwargs)``."""
        return Invocation.make(kernel, args, kwargs)

    def choose(
        self, kernel: Kernel[Any, Any], *args: Any, cfg: Any = None, **kwargs: Any
    ) -> Selection:
        """The config (and its source) a call would use, without running it."""
        return self.chooser.choose(self.invocation(kernel, *args, **kwargs), cfg)

    def __call__(self, kernel: Kernel[Any, Any], *args: Any, cfg: Any = None, **kwargs: Any) -> Any:
        fast = None
        if cfg is None and not self.record and not active_overlays() and not _OVERRIDE.get():
            fast = _fast_key(kernel, args, kwargs)
            if fast is not None:
                hit = self._fast.get(fast[0])
                cache = self.chooser.cache
                if hit is not None and hit[0] is cache and hit[1] == cache.version:
                    return hit[2](*fast[1])
        if not isinstance(kernel, Kernel):
            raise TypeError(f"kernel must be an ejk_executor.Kernel, got {type(kernel).__name__}")
        _, leaves, dyn_index = split_leaves(args, kwargs)
        inv = Invocation.make(kernel, args, kwargs)
        if self.record:
            record_invocation(kernel, inv)
        fn, out = self._run(inv, self.chooser.choose(inv, cfg), [leaves[i] for i in dyn_index])
        if fast is not None:
            with self._lock:
                if len(self._fast) >= _FAST_MAX:  # e.g. NaN statics never hit: stay bounded
                    self._fast.clear()
                cache = self.chooser.cache
                self._fast[fast[0]] = (cache, cache.version, fn)
        return out

    def _run(self, inv: Invocation[Any, Any], chosen: Selection, dyn: list[Any]) -> tuple[Any, Any]:
        """``(body, output)`` of ``inv`` run with ``chosen``; a config from the persistent
        cache that fails at launch is dropped (one CacheWarning) and the next choice runs."""
        fn = self._body(inv, chosen.cfg)
        try:
            return fn, fn(*dyn)
        except Exception as e:
            reason = f"it failed at launch ({type(e).__name__}: {e})"
            if chosen.source != "persistent" or not self.chooser.drop_cached(
                inv, chosen.cfg, reason
            ):
                raise
        fn = self._body(inv, self.chooser.choose(inv).cfg)
        return fn, fn(*dyn)

    def _body(self, inv: Invocation[Any, Any], cfg: Any) -> Any:
        kernel = inv.kernel
        token = config_label(kernel.name, kernel.version, cfg)
        memo_key = (inv.call_key, token, kernel.compiled_apart(inv))
        fn = self._bodies.get(memo_key)
        if fn is not None:
            return fn
        body = make_body(kernel, cfg, inv.platform, inv.args, dict(inv.kwargs))

        def labeled(*dyn: Any) -> Any:
            with jax.named_scope(token):
                return body(*dyn)

        labeled.__name__ = labeled.__qualname__ = token.replace(".", "_").replace("-", "_")
        fn = jax.jit(labeled)
        with self._lock:
            self._bodies[memo_key] = fn
        return fn


_FAST_MAX = 4096
_SCALARS = frozenset({bool, int, float, complex, str, bytes, type(None)})
_CONCRETE: set[type] = set()  # concrete jax array classes seen so far (found lazily)


def _fast_key(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """(a hashable key, the arrays in call order) for an eager call whose arguments are
    each a concrete jax array, a plain scalar, or a tuple/list of those; else None.

    The arrays come in the order ``jax.tree_util`` flattens ``(args, kwargs)`` in
    (positional first, then keywords sorted by name), the order the jitted body takes.
    """
    dyn: list[Any] = []
    parts: list[Any] = [kernel]
    if not _parts(args, parts, dyn):
        return None
    if kwargs:
        for name in sorted(kwargs):
            parts.append(name)
            if not _parts((kwargs[name],), parts, dyn):
                return None
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:
        return None
    return key, dyn


def _parts(values: Any, parts: list[Any], dyn: list[Any]) -> bool:
    parts.append(len(values))  # delimits this sequence in the flat key
    for x in values:
        t = type(x)
        if t in _CONCRETE or (
            isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and _seen(t)
        ):
            dyn.append(x)
            parts.append((x.shape, x.dtype, x.weak_type, x.sharding))
        elif t in _SCALARS:
            parts.append((t, x))
        elif t is tuple or t is list:  # flattened depth-first, as jax.tree_util does
            parts.append(t)
            if not _parts(x, parts, dyn):
                return False
        elif (
            t in _VALUE_TYPES
            or issubclass(t, (msgspec.Struct, enum.Enum))
            or (hasattr(t, "__ejk_stable_key__") and _value_type(t))
        ):
            # static objects compared by value (masks and the like): their __eq__ and
            # __hash__ must agree with their stable key, as for any dict key
            parts.append((t, x))
        else:
            return False
    return True


_VALUE_TYPES: set[type] = set()


def _value_type(t: type) -> bool:
    _VALUE_TYPES.add(t)
    return True


def _seen(t: type) -> bool:
    _CONCRETE.add(t)
    return True
