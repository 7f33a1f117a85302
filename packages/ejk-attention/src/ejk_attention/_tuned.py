"""Which backend won for a shape: kept in ejk_executor's persistent cache.

``ejk tune`` times every backend that serves a request shape and stores the
fastest as a `BackendChoice` under `backend_key`; ``implementation=None`` then
tries that backend first. The key holds the abstract shapes and dtype, the
features used (they change which kernel path runs), the device fingerprint and
this package's version, never an address; the choice holds a backend name only,
so a stale or foreign entry can change speed, never numerics.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from pathlib import Path
from typing import Any

from ejk_sequtils import AttentionRequest

__all__ = ["BackendChoice", "backend_key", "cache_types", "open_cache", "tuned_backend"]


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """The backend ``ejk tune`` measured fastest for one key (and its time)."""

    implementation: str
    ms: float = 0.0


@functools.cache
def _version() -> str:
    try:
        return importlib.metadata.version("ejk-attention")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - source checkout
        return "0+unknown"


def backend_key(request: AttentionRequest, fingerprint: str) -> str:
    """The persistent-cache key of the backend choice for ``request`` on ``fingerprint``."""
    b, t, s, n, k, h = request.shape
    features = ",".join(sorted(request.features())) or "none"
    return (
        f"ejk_attention.backend@{_version()}|{fingerprint}|{request.q.dtype}"
        f"|B{b}T{t}S{s}N{n}K{k}H{h}Hv{request.v.shape[-1]}|{features}"
    )


def cache_types() -> tuple[type, ...]:
    """Config classes of every installed ejk kernel package, so the cache can decode them."""
    types: list[type] = [BackendChoice]
    for module, name in (
        ("ejk_kernels_gpu", "FlashConfig"),
        ("ejk_kernels_tpu", "BlockSparseConfig"),
    ):
        try:
            types.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(types)


@functools.cache
def _cache_at(path: Path) -> Any:
    from ejk_executor import PersistentCache

    return PersistentCache(path, types=cache_types())


def open_cache(path: str | Path | None = None, *, fresh: bool = False) -> Any:
    """The `ejk_executor.PersistentCache` at ``path`` (default: its default directory).

    The same object is reused per path (it keeps what it read in memory); ``fresh=True``
    opens a new one, which sees entries removed on disk since (the CLI uses it).
    """
    from ejk_executor import PersistentCache, default_cache_dir

    where = Path(path if path is not None else default_cache_dir()).expanduser()
    if fresh:
        _cache_at.cache_clear()
        return PersistentCache(where, types=cache_types())
    return _cache_at(where)


def tuned_backend(request: AttentionRequest) -> str | None:
    """The tuned backend for ``request`` on this machine, or None (no entry, no executor)."""
    try:
        from ejk_config import device_fingerprint
    except ImportError:
        return None
    choice = open_cache().get(backend_key(request, device_fingerprint()))
    return choice.implementation if isinstance(choice, BackendChoice) else None
