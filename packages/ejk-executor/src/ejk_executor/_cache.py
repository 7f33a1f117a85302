"""The in-memory config cache and the overlay context."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["ConfigCache", "active_overlays", "overlay_cache"]


class ConfigCache:
    """A thread-safe in-memory map from call keys to configs.

    ``version`` grows on every change, so callers can tell a memoised answer
    went stale.
    """

    def __init__(self, entries: Mapping[str, Any] | None = None):
        self._lock = threading.Lock()
        self._data: dict[str, Any] = dict(entries or {})
        self.version = 0

    def get(self, key: str, default: Any = None) -> Any:
        """The config stored under ``key``, or ``default``."""
        with self._lock:
            return self._data.get(key, default)

    def put(self, key: str, cfg: Any) -> None:
        """Store ``cfg`` under ``key``."""
        if not isinstance(key, str):
            raise TypeError(f"cache keys are str, got key={key!r}")
        if cfg is None:
            raise ValueError(f"cannot cache cfg=None under key={key!r}")
        with self._lock:
            self._data[key] = cfg
            self.version += 1

    def discard(self, key: str) -> None:
        """Remove ``key``'s entry, if any."""
        with self._lock:
            if self._data.pop(key, None) is not None:
                self.version += 1

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def items(self) -> list[tuple[str, Any]]:
        """A snapshot of the entries."""
        with self._lock:
            return list(self._data.items())

    def clear(self) -> None:
        """Remove every entry."""
        with self._lock:
            self._data.clear()
            self.version += 1


_OVERLAYS: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
    "ejk_executor_overlays", default=()
)


def active_overlays() -> tuple[Any, ...]:
    """The overlay caches in effect, innermost first."""
    return _OVERLAYS.get()


@contextlib.contextmanager
def overlay_cache(cache: ConfigCache | Mapping[str, Any]) -> Iterator[ConfigCache]:
    """Within the block, configs in ``cache`` win over every cache of every chain.

    Overlays nest (the innermost wins) and are local to the thread or task.

    Args:
        cache: a ConfigCache or a mapping from call key to config.

    Yields:
        The overlay as a ConfigCache.
    """
    if isinstance(cache, Mapping):
        cache = ConfigCache(cache)
    if not isinstance(cache, ConfigCache):
        raise TypeError(
            f"overlay_cache expects a ConfigCache or a mapping, got {type(cache).__name__}"
        )
    token = _OVERLAYS.set((cache, *_OVERLAYS.get()))
    try:
        yield cache
    finally:
        _OVERLAYS.reset(token)
