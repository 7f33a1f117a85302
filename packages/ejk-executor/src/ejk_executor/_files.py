"""File-level safety for the persistent cache: bounded reads of regular files only.

A cache path may name anything a user (or another user) put there: a FIFO, a
device, a huge file, a file this process may not read. These helpers read only
regular files up to a size limit, and tell a file by its identity (inode,
mtime, size), so the cache can prove that a file it means to move is the one
it read.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["MAX_FILE_BYTES", "Identity", "identity", "read_regular"]

# A cache of every tuned shape is a few MB; anything larger is not one of ours.
MAX_FILE_BYTES = 64 * 2**20

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
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than the limit of {limit} bytes", str(path))
    return data, (st.st_ino, st.st_mtime_ns, st.st_size)
