"""File-level safety for the persistent cache: bounded reads, atomic writes, temp cleanup.

A cache path may name anything a user (or another user) put there: a FIFO, a
device, a huge file, a file this process may not read. These helpers read only
regular files up to a size limit, and tell a file by its identity (inode,
mtime, size), so the cache can prove that a file it means to move is the one
it read. Writes go to a locked temporary file renamed over the target; the
temporaries of killed writers are removed once stale.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

try:
    import fcntl
except ImportError:  # Windows: an open file cannot be deleted there anyway
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "MAX_FILE_BYTES",
    "STALE_TEMP_SECONDS",
    "Identity",
    "identity",
    "read_regular",
    "remove_stale_temps",
    "write_atomic",
]

# A cache of every tuned shape is a few MB; anything larger is not one of ours.
MAX_FILE_BYTES = 64 * 2**20

# A live writer holds its temporary file for milliseconds; one a minute old was abandoned.
STALE_TEMP_SECONDS = 60.0
TEMP_SUFFIX = ".tmp"

Identity = tuple[int, int, int]  # (inode, mtime in ns, size)


def identity(path: Path) -> Identity | None:
    """``path``'s (inode, mtime, size), or None if nothing is there."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def read_regular(path: Path, limit: int = MAX_FILE_BYTES) -> tuple[bytes, Identity] | None:
    """The bytes of the regular file at ``path`` and the identity of what was read;
    None if there is no file.

    Raises:
        OSError: the file cannot be opened, is not a regular file (a FIFO, a device)
            or holds more than ``limit`` bytes.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block
    except FileNotFoundError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # checked before fdopen, which names a folder by its fd
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than the limit of {limit} bytes", str(path))
    return data, (st.st_ino, st.st_mtime_ns, st.st_size)


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write`` on a temporary file beside ``path``, flush it to disk, then rename it
    over ``path``: readers see the old file or the whole new one, never a part.

    The temporary file is locked while it exists (`remove_stale_temps` leaves it be) and
    removed if anything fails, the exception then re-raised.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove_stale_temps(path: Path, older_than: float = STALE_TEMP_SECONDS) -> None:
    """Remove the temporary files `write_atomic` left beside ``path`` (writers killed mid-write)
    that are older than ``older_than`` seconds and locked by no live writer."""
    now = time.time()
    with contextlib.suppress(OSError), os.scandir(path.parent) as entries:
        for entry in entries:
            if not (entry.name.startswith(path.name) and entry.name.endswith(TEMP_SUFFIX)):
                continue
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and now - st.st_mtime > older_than:
                    if not _in_use(entry.path):
                        os.unlink(entry.path)


def _in_use(file: str) -> bool:
    """Whether a live writer holds ``file``'s lock (taken in `write_atomic`)."""
    if fcntl is None:
        return False
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
