"""Whether a process of this machine still runs (the memory tier sweeps the files of
dead workers; the agent keeps workers in place only while they live)."""

from __future__ import annotations

import os

__all__ = ["alive"]


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
