"""Reusing the files of collected objects for new ones (local storage only).

On thin-provisioned or discard-mounted disks (cloud VMs, this project's machines), a
file system block the disk has never held, or has been told is free, costs a
provisioning round trip on first write: a new 1 GiB file went to disk at 200 MiB/s
here, the same bytes over an existing file's blocks at 2,000 MiB/s. A checkpoint's
shards are the same size save after save and retention deletes one version per save,
so the local storage moves a collected object's file into ``ROOT/recycle`` instead of
unlinking it, and the next write of a large object renames one from there and writes
over its blocks (as PostgreSQL recycles WAL segments).

A reader mapping an object (``read_object``) holds a shared ``flock`` on it for as long
as the mapping lives; a file so held is never written over, only unlinked, so tensors
restored from a checkpoint never change under the training process that holds them.
Recycled files unused for an hour, and those beyond 64, are deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import time
from pathlib import Path

__all__ = ["RECYCLE_DIR", "RECYCLE_MIN", "claim", "pin", "retire"]

RECYCLE_DIR = "recycle"
#: Smaller objects (manifests, say) are unlinked: nothing to gain.
RECYCLE_MIN = 1 << 20
_MAX_FILES = 64
_MAX_AGE_S = 3600.0


def pin(fd: int) -> None:
    """Marks an open object as read (shared lock, kept while a mapping of it lives)."""
    fcntl.flock(fd, fcntl.LOCK_SH)


def _exclusive(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def retire(root: Path, path: Path) -> None:
    """Removes an object's name, keeping a large, unread file for reuse.

    Raises:
        FileNotFoundError: The object does not exist.
        OSError: The file system failed.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        path.unlink()  # raises what a plain delete would
        return
    try:
        size = os.fstat(fd).st_size
        if size < RECYCLE_MIN or not _exclusive(fd):
            path.unlink()  # small, or mapped by a reader: its inode must stay as it is
            return
        pool = root / RECYCLE_DIR
        pool.mkdir(exist_ok=True)
        os.utime(fd)  # its age in the pool counts from now
        os.rename(path, pool / f"{size:012x}-{secrets.token_hex(6)}")
    finally:
        os.close(fd)
    _trim(pool)


def _entries(pool: Path) -> list[tuple[int, float, Path]]:
    """(size, mtime, path) of the pool's files; an unreadable name is skipped."""
    found = []
    with contextlib.suppress(FileNotFoundError), os.scandir(pool) as it:
        for entry in it:
            size_hex = entry.name.split("-", 1)[0]
            with contextlib.suppress(ValueError, FileNotFoundError):
                found.append((int(size_hex, 16), entry.stat().st_mtime, Path(entry.path)))
    return found


def _trim(pool: Path) -> None:
    entries = sorted(_entries(pool), key=lambda e: e[1], reverse=True)  # newest first
    now = time.time()
    for i, (_, mtime, path) in enumerate(entries):
        if i >= _MAX_FILES or now - mtime > _MAX_AGE_S:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def claim(root: Path, size: int, target: Path) -> int | None:
    """Moves a recycled file to ``target`` and opens it for writing from offset 0.

    Picks the smallest file that holds ``size`` bytes, else the largest. The caller
    writes, truncates to ``size`` and closes (which drops the lock that keeps other
    claimers off).

    Returns:
        A descriptor open for writing, or None if no file suits (write a new one).
    """
    if size < RECYCLE_MIN:
        return None
    pool = root / RECYCLE_DIR
    entries = _entries(pool)
    fits = sorted(e for e in entries if e[0] >= size)
    rest = sorted((e for e in entries if e[0] < size), reverse=True)
    for _, _, path in fits + rest:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            continue  # another writer took it
        if not _exclusive(fd):
            # Mapped by a reader who opened it before it was collected, or being
            # claimed: never written over.
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            continue
        try:
            os.rename(path, target)
        except FileNotFoundError:
            os.close(fd)
            continue
        os.utime(fd)  # in use again: not aged out by _trim while being written
        return fd
    return None
