"""What a test session leaves behind on the machine, checked at its end (``conftest.py``):
processes of its test clusters, and semaphores they held.

A session marks itself in its environment (:data:`SESSION_ENV`), so every process its
tests start carries the mark; a cluster's processes also carry their cluster's
(``CLUSTER_MARK``, from ``rallypoint.cli.processes``). Another session on the same machine
(another run, or another xdist worker: each runs a session of its own) has another mark,
so no session sees another's processes as its own. Semaphores are those that the
harness's SIGKILLs found open in the processes they stopped, in this process
(``leftover_semaphores``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from rallypoint.cli.processes import CLUSTER_MARK, kill_processes, leftover_semaphores

__all__ = ["SESSION_ENV", "cluster_processes", "leftovers"]

#: This session's mark, in the environment of every process its tests start.
SESSION_ENV = "RP_TEST_SESSION"


def cluster_processes(session: str) -> list[tuple[int, str]]:
    """The live processes of ``session`` that belong to a test cluster, with their
    command lines (Linux ``/proc``; a zombie has exited and shows no environment)."""
    mine = f"{SESSION_ENV}={session}".encode()
    marked = f"{CLUSTER_MARK}=".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            if mine not in environ or not any(v.startswith(marked) for v in environ):
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out.append((int(entry.name), command.strip()))
    return out


def leftovers(session: str, timeout: float = 10) -> list[str]:
    """What ``session`` left: its clusters' processes still running ``timeout`` s from
    now (a process SIGKILLed a moment ago may still be exiting) and the semaphores they
    held that remain, each described in a line. Whatever is found is then removed, so
    that it does not pile up run after run."""
    end = time.monotonic() + timeout
    while (processes := cluster_processes(session)) and time.monotonic() < end:
        time.sleep(0.1)
    found = [f"process {pid}: {command[:300]}" for pid, command in processes]
    kill_processes([pid for pid, _ in processes])
    semaphores = leftover_semaphores()
    found += [f"semaphore {path}" for path in semaphores]
    for path in semaphores:
        Path(path).unlink(missing_ok=True)
    return found
