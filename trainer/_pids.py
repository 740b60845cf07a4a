"""Whether a process of this machine still runs (the memory tier sweeps the files of
dead workers; the agent keeps workers in place only while they live)."""

from __future__ import annotations

import os

from rallypoint.client.models import ProcessState

__all__ = ["alive", "run_delay", "state"]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs. A worker that died but that its parent (torchrun's agent)
    has not reaped yet is a zombie: dead, though its pid exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # "pid (comm) S ...": the state follows the last ')' (comm may hold any).
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel whether the pid exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


#: ``/proc/PID/stat``'s state letters, as a person reads them.
_STATES: dict[str, ProcessState] = {
    "R": "running",
    "S": "sleeping",
    "D": "blocked",
    "T": "stopped",
    "t": "stopped",
}


def state(pid: int) -> ProcessState | None:
    """What ``pid``'s main thread is doing as the kernel says (``running``, ``sleeping``,
    ``blocked``, ``stopped``), None where it cannot be read (gone, no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return _STATES.get(f.read().rsplit(")", 1)[1].split()[0])
    except (OSError, IndexError):
        return None


def run_delay(pid: int) -> float | None:
    """Seconds ``pid``'s main thread has spent runnable but waiting for a CPU, over its
    life, as the kernel's scheduler counts them (``/proc/PID/schedstat``); None where it
    cannot be read (gone, no ``/proc``, a kernel without scheduler statistics)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None
