"""A hung process's stacks, taken from outside it before it is stopped.

A process that is stuck may not run a line of its own: a thread blocked in a kernel call
or on a GPU, a process stopped by a signal, an interpreter whose main thread holds the
GIL. So its stacks are read from outside, by py-spy, which reads the interpreter's memory
(``py-spy dump``), a tool made for this: it sees every thread, native waits included,
and needs nothing of the process. py-spy first suspends the process for a consistent
read; one that cannot be suspended (a process stopped by SIGSTOP answers ptrace with its
stop) is read without (``--nonblocking``). Where py-spy is not installed, or may not
trace the process (ptrace refused: a container without ``CAP_SYS_PTRACE``), the process
is asked for them itself: ``faulthandler``, which the worker's reporter registers on
:data:`STACKS_SIGNAL` (it writes from its C signal handler, so a main thread stuck in C
code does not stop it; a stopped process does). What gives no stacks is reported so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["STACKS_SIGNAL", "Stacks", "stacks_file", "take_stacks"]

#: The signal a worker's reporter registers ``faulthandler`` on (the fallback).
STACKS_SIGNAL = signal.SIGUSR2
#: The most characters of stacks kept (the coordinator keeps as much).
_MAX = 256 * 1024


@dataclass(frozen=True)
class Stacks:
    """What was taken of a process's stacks.

    Attributes:
        text: The stacks of its threads (None: none could be taken).
        error: Why none could be, or what the first way that failed said.
        tool: What took them (``py-spy 0.4.3``, ``faulthandler``).
    """

    text: str | None
    error: str | None = None
    tool: str | None = None


def stacks_file(folder: Path, pid: int) -> Path:
    """Where the worker of ``pid`` writes its stacks when asked (the fallback)."""
    return folder / f"stacks-{pid}.txt"


def _py_spy() -> str | None:
    return shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))


def _run(command: list[str], timeout: float) -> tuple[str | None, str]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if done.returncode == 0 and done.stdout.strip():
        return done.stdout, ""
    said = (done.stderr or done.stdout).strip().splitlines()
    return None, " / ".join(line.strip() for line in said[:4]) or f"exit {done.returncode}"


def take_stacks(pid: int, folder: Path | None = None, timeout: float = 10.0) -> Stacks:
    """Takes the stacks of every thread of process ``pid``.

    Args:
        pid: The process (it is left running: stopping it is the caller's).
        folder: Where the worker writes its own stacks when signalled (the fallback);
            None: no fallback.
        timeout: Seconds for each way tried.
    """
    errors: list[str] = []
    spy = _py_spy()
    if spy is not None:
        version, _ = _run([spy, "--version"], timeout)
        tool = (version or "py-spy").strip()
        for extra in ([], ["--nonblocking"]):
            text, error = _run([spy, "dump", "--pid", str(pid), *extra], timeout)
            if text is not None:
                return Stacks(text[:_MAX], None, tool + (" (not suspended)" if extra else ""))
            errors.append(f"py-spy dump{' --nonblocking' if extra else ''}: {error}")
    else:
        errors.append("py-spy is not installed")
    if folder is not None:
        text = _ask(pid, stacks_file(folder, pid), timeout)
        if text is not None:
            return Stacks(text[:_MAX], "; ".join(errors) or None, "faulthandler")
        errors.append(f"faulthandler: process {pid} wrote no stacks within {timeout:g} s")
    return Stacks(None, "; ".join(errors))


def _ask(pid: int, path: Path, timeout: float) -> str | None:
    """Signals the worker to write its stacks (faulthandler) and waits for them."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    try:
        os.kill(pid, STACKS_SIGNAL)
    except OSError:
        return None
    deadline = time.monotonic() + timeout
    size = -1
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            now = path.stat().st_size
            if now > 0 and now == size:  # written, and not growing any more
                return path.read_text(errors="replace")
            size = now
        time.sleep(0.05)
    return None
