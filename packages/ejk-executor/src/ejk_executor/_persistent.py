"""A config cache kept in a JSON file, safe under several writer processes.

Format (msgspec JSON, never pickle)::

    {"format": 1, "entries": {"<call key>": {"type": "<module>:<qualname>", "cfg": {...}}}}

Every write takes a file lock beside the file, re-reads it, merges its own
new entries in, writes a temporary file in the same directory and renames it
over the old one, so readers never see half a file and concurrent writers lose
nothing. A file that cannot be decoded is moved aside (``*.corrupt-*``) under
the lock, if it is still the file that was read, with one warning, and the
cache starts empty; a file that cannot be read (or is no regular file, or too
large: `_files`) and a location that cannot be written turn the cache into a
memory-only one, with one warning, and the file is left as it is. The table of
promises is in the package README.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import filelock
import msgspec

from ejk_config import BwdParams, FwdParams

from ._files import Identity, identity, read_regular, remove_stale_temps, write_atomic

__all__ = ["CacheWarning", "PersistentCache", "config_type_name", "default_cache_dir"]

ENV_VAR = "EJK_CACHE_DIR"
FILE_NAME = "configs-v1.json"
_FORMAT = 1


class CacheWarning(UserWarning):
    """A persistent cache file was damaged or its location could not be written."""


class _Entry(msgspec.Struct, frozen=True):
    type: str
    cfg: msgspec.Raw


class _File(msgspec.Struct):
    format: int
    entries: dict[str, _Entry]


def config_type_name(cls: type) -> str:
    """The name a config class is stored under: ``module:qualname``."""
    return f"{cls.__module__}:{cls.__qualname__}"


def default_cache_dir() -> Path:
    """``$EJK_CACHE_DIR``, else ``$XDG_CACHE_HOME/ejk``, else ``~/.cache/ejk``."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "ejk"


class PersistentCache:
    """Configs on disk, keyed by call key, shared between processes and sessions.

    Args:
        path: a JSON file, or a directory to hold ``configs-v1.json``; default:
            `default_cache_dir`. Nothing is created before the first ``put``.
        types: config classes this cache may store (FwdParams and BwdParams
            always may); more can be added with ``register``.
        strict: for a file the user names (``ejk cache import``/``export``): a file that
            cannot be read raises OSError, a damaged one ValueError (it is never moved
            aside), and a failed write raises OSError, instead of a warning and memory only.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        types: tuple[type, ...] = (),
        strict: bool = False,
    ):
        if path is None:
            path = default_cache_dir()
        elif not isinstance(path, str | os.PathLike):
            raise TypeError(f"path must be a str or path, got path={path!r}")
        p = Path(path).expanduser()
        self.path = p if p.suffix == ".json" else p / FILE_NAME
        self._lock = threading.RLock()
        # one lock object per cache: re-entered when a write finds damage to move aside
        self._file_lock = filelock.FileLock(str(self.path) + ".lock", timeout=60)
        self._types: dict[str, type] = {}
        self._warned_read = False
        for cls in (FwdParams, BwdParams, *types):
            self.register(cls)
        self._raw: dict[str, _Entry] = {}
        self._decoded: dict[str, Any] = {}
        self._stamp: Identity | None = None  # of the file last read
        self._set_aside = False  # we moved a damaged file aside: write back what we hold
        self._loaded = False
        self._memory_only = False
        self._strict = strict

    def __repr__(self) -> str:
        mode = ", memory only" if self._memory_only else ""
        return f"PersistentCache({str(self.path)!r}{mode})"

    @property
    def memory_only(self) -> bool:
        """True once a write failed and the cache keeps its entries in memory only."""
        return self._memory_only

    def register(self, cls: type) -> None:
        """Allow configs of class ``cls`` (a msgspec Struct or dataclass) in this cache."""
        if not isinstance(cls, type):
            raise TypeError(f"register expects a config class, got {cls!r}")
        if self._types.get(config_type_name(cls)) is cls:
            return
        try:
            msgspec.json.Decoder(cls)
        except TypeError as e:
            raise TypeError(
                f"config class {cls.__qualname__} cannot be decoded from JSON: {e}"
            ) from None
        with self._lock:
            self._types[config_type_name(cls)] = cls

    # reading

    def _read_file(self) -> dict[str, _Entry] | None:
        """The entries on disk. A damaged file is moved aside (one warning) and gives None
        (what this process holds is written back at its next put); a file that cannot be read
        is left alone and the cache keeps to memory."""
        try:
            found = read_regular(self.path)
        except OSError as e:  # unreadable, a FIFO or device, too large: not ours to replace
            if self._strict:
                raise
            self._memory_only = True
            self._warn_once(
                f"cannot read config cache {self.path} ({e}); leaving it alone and keeping "
                "configs in memory only for this process"
            )
            return {}
        if found is None:
            return {}
        data, read = found
        try:
            parsed = msgspec.json.decode(data, type=_File)
            if parsed.format != _FORMAT:
                raise ValueError(f"unknown format {parsed.format}")
        except (msgspec.DecodeError, ValueError, RecursionError) as e:  # deep nesting: Recursion
            if self._strict:
                raise ValueError(f"{self.path} is not a config cache file: {e}") from None
            where = self._move_aside(read)
            if where is not None:
                warnings.warn(
                    f"config cache {self.path} is damaged ({e}); {where}, starting empty",
                    CacheWarning,
                    stacklevel=4,
                )
            return None
        return parsed.entries

    def _move_aside(self, read: Identity) -> str | None:
        """Move the damaged file aside under the file lock if it is still the file that was
        read; None if another process replaced it meanwhile (its file is read next)."""
        aside = self.path.with_name(
            f"{self.path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        )
        try:
            with self._file_lock:
                if identity(self.path) != read:
                    return None
                os.replace(self.path, aside)
                self._set_aside = True
        except OSError:  # no lock (read-only folder, timeout) or no rename: keep it
            return "left in place"
        return f"moved to {aside}"

    def _refresh(self, force: bool = False) -> None:
        stamp = identity(self.path)
        if self._loaded and not force and stamp == self._stamp:
            return
        entries = self._read_file() if stamp is not None else {}
        # the stamp taken before reading: a file replaced meanwhile differs from it
        # and is read again at the next miss
        self._stamp = stamp
        if entries is None or (stamp is None and self._set_aside):
            entries = {}  # the file was damaged: keep what we hold, to write it back
        elif not self._memory_only:
            # Every confirmed put is on disk, so a key missing there was removed by another
            # process (discard, clear): forgetting it keeps our next write from restoring it.
            for key in self._raw.keys() - entries.keys():
                del self._raw[key]
                self._decoded.pop(key, None)
        for key, entry in entries.items():
            if self._raw.get(key) != entry:
                self._raw[key] = entry
                self._decoded.pop(key, None)
        self._loaded = True

    def _decode(self, key: str) -> Any:
        if key in self._decoded:
            return self._decoded[key]
        entry = self._raw.get(key)
        if entry is None:
            return None
        cls = self._types.get(entry.type)
        if cls is None:  # written by a process that knew a class this one does not
            return None
        try:
            cfg = msgspec.json.decode(entry.cfg, type=cls)
        except (msgspec.DecodeError, ValueError, TypeError):
            return None  # a stale entry of a class whose fields changed: a miss
        self._decoded[key] = cfg
        return cfg

    def get(self, key: str, default: Any = None) -> Any:
        """The config stored under ``key`` (by any process), or ``default``."""
        with self._lock:
            if not self._loaded:
                self._refresh()
            cfg = self._decode(key)
            if cfg is None and not self._memory_only:
                self._refresh()  # another process may have written it since
                cfg = self._decode(key)
            return default if cfg is None else cfg

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    def __len__(self) -> int:
        with self._lock:
            if not self._memory_only:
                self._refresh()
            return len(self._raw)

    def keys(self) -> list[str]:
        """The keys stored (by any process)."""
        with self._lock:
            if not self._memory_only:
                self._refresh()
            return list(self._raw)

    # writing

    def _encode(self, key: str, cfg: Any) -> _Entry:
        name = config_type_name(type(cfg))
        cls = self._types.get(name)
        if cls is not type(cfg):
            raise TypeError(
                f"PersistentCache cannot store a config of type {name} under key={key!r}: "
                "register the class first (PersistentCache(types=...), .register, or the "
                "kernel's config_type)"
            )
        try:
            raw = msgspec.json.encode(cfg, order="deterministic")
            back = msgspec.json.decode(raw, type=cls)
        except (TypeError, msgspec.DecodeError, ValueError) as e:
            raise TypeError(f"config {cfg!r} does not round-trip through JSON: {e}") from None
        if back != cfg:
            raise TypeError(f"config {cfg!r} does not round-trip through JSON: got {back!r}")
        return _Entry(name, msgspec.Raw(raw))

    def put(self, key: str, cfg: Any) -> None:
        """Store ``cfg`` under ``key`` in memory and on disk (atomically, merged).

        Raises:
            TypeError: if ``cfg``'s class is not registered or does not round-trip.
            OSError: a strict cache could not write (others warn and keep to memory).
        """
        if not isinstance(key, str):
            raise TypeError(f"cache keys are str, got key={key!r}")
        entry = self._encode(key, cfg)
        with self._lock:
            self._raw[key] = entry
            self._decoded[key] = cfg
            if not self._memory_only:
                self._store({key: entry})

    def discard(self, key: str) -> None:
        """Remove ``key``'s entry, in memory and on disk (merged under the lock, like ``put``)."""
        with self._lock:
            self._raw.pop(key, None)
            self._decoded.pop(key, None)
            if not self._memory_only and self.path.exists():
                self._store({}, drop=key)

    def clear(self) -> int:
        """Remove every entry, in memory and on disk; the number of entries the file held.

        The file is read and deleted under the writers' file lock: a concurrent write lands
        wholly before (its entry is cleared, and counted) or after (its entry is kept). A
        file this cache cannot read is left alone (`memory_only` turns true, one warning).
        """
        with self._lock:
            self._raw.clear()
            self._decoded.clear()
            if self._memory_only or not self.path.exists():
                return 0
            try:
                with self._file_lock:
                    self._refresh(force=True)  # what the file holds now, a writer's last entry too
                    if self._memory_only:  # unreadable: not ours to delete
                        self._raw.clear()
                        self._decoded.clear()
                        return 0
                    removed = len(self._raw)
                    self.path.unlink(missing_ok=True)
                    self._raw.clear()
                    self._decoded.clear()
                    self._stamp = None
                    self._set_aside = False
                    return removed
            except OSError as e:
                if self._strict:
                    raise
                self._memory_only = True
                warnings.warn(
                    f"cannot clear config cache {self.path} ({e}); keeping configs in "
                    "memory only for this process",
                    CacheWarning,
                    stacklevel=2,
                )
                return 0

    def _store(self, new: dict[str, _Entry], drop: str | None = None) -> None:
        try:
            self._write(new, drop)
        except OSError as e:
            if self._strict:
                raise
            self._memory_only = True
            warnings.warn(
                f"cannot write config cache {self.path} ({e}); keeping configs in "
                "memory only for this process",
                CacheWarning,
                stacklevel=3,
            )

    def _write(self, new: dict[str, _Entry], drop: str | None = None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._file_lock:
            self._refresh(force=True)
            if self._memory_only:  # the file could not be read: never replace what was not merged
                return
            self._raw.update(new)
            if drop is not None:
                self._raw.pop(drop, None)
            payload = msgspec.json.encode(
                _File(_FORMAT, dict(sorted(self._raw.items()))), order="deterministic"
            )
            remove_stale_temps(self.path)
            write_atomic(self.path, lambda f: f.write(payload))
            self._stamp = identity(self.path)
            self._set_aside = False

    def _warn_once(self, message: str) -> None:
        if not self._warned_read:
            self._warned_read = True
            warnings.warn(message, CacheWarning, stacklevel=4)
