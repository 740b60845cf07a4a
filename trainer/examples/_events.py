"""What the examples write down: one JSON line an event, appended to ``--events``, and
what a process says about itself in them (when it started, what it holds).

The tests, the benchmarks and ``rallypoint.cli.processes.judge`` read these lines; every
line has ``t`` and ``event``, and a trainer's lines also ``generation``, ``rank`` and
``world_size`` (:func:`events`).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import time
from typing import Protocol


class Event(Protocol):
    """Writes one event of ``kind`` with ``fields`` (a rank's :func:`events`)."""

    def __call__(self, kind: str, **fields: object) -> None: ...


def emit(path: str | None, kind: str, **fields: object) -> None:
    """Appends one event line to ``path``, if there is one (one short append per line:
    atomic, so the ranks of a node can share the file)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"t": time.time(), "event": kind, **fields}) + "\n")


def events(path: str | None, *, generation: int, rank: int, world_size: int) -> Event:
    """What a rank writes its events with: each line says which generation and rank."""
    return functools.partial(emit, path, generation=generation, rank=rank, world_size=world_size)


def process_started() -> float | None:
    """When this process started (Linux), to tell process start-up from the rest."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _malloc() -> dict[str, int]:
    """glibc's heap (``mallinfo2``, KiB): what the program holds (``heap_used``: in use
    plus mmapped chunks) and what malloc keeps free (``heap_free``). A heap whose RSS
    grows while ``heap_used`` stays flat is fragmentation or freed memory not given
    back, not a leak. Empty off glibc >= 2.33."""
    try:
        libc = ctypes.CDLL(None)
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return {}
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    return {
        "heap_used_kib": (info.uordblks + info.hblkhd) >> 10,
        "heap_free_kib": info.fordblks >> 10,
    }


def resources() -> dict[str, int]:
    """This process's resident memory (KiB), in all and by kind, its mappings, threads
    and open file descriptors (Linux): a process that regroups in place must not grow
    them generation after generation."""
    # By kind (anonymous: the heap; file: mapped files; shmem: the memory tier's /dev/shm
    # files), so a growth says where it is; a file mapped and never unmapped adds a mapping.
    fields = {
        "VmRSS:": "rss_kib",
        "RssAnon:": "anon_kib",
        "RssFile:": "file_kib",
        "RssShmem:": "shmem_kib",
    }
    try:
        found: dict[str, int] = {}
        with open("/proc/self/status") as f:
            for line in f:
                words = line.split()
                if words and words[0] in fields:
                    found[fields[words[0]]] = int(words[1])
        with open("/proc/self/maps") as f:
            found["maps"] = sum(1 for _ in f)
        found["threads"] = len(os.listdir("/proc/self/task"))
        found["fds"] = len(os.listdir("/proc/self/fd"))
        found.update(_malloc())
        return found if "rss_kib" in found else {}
    except (OSError, ValueError):
        return {}
