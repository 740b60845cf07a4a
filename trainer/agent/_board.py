"""The board: how a Rallypoint agent tells its workers about generations, in one folder.

A worker that regroups in place (:mod:`._regroup`) keeps its process across membership
changes, so the environment torchrun gave it goes stale at the first one. The agent's
rendezvous plugin owns a folder (``RALLYPOINT_REGROUP_DIR``) and keeps in it:

- ``generation.json``: the generation the node is in and whether it ended, with the
  node's assignment once the next one sealed. Written whole and renamed into place, so a
  reader never sees half of it; workers poll its change time (a ``stat`` every few ms).
- ``workers/LOCAL_RANK``: a worker that regroups in place writes its pid and the
  node's number of workers there. The agent regroups in place only while every local
  rank has one naming a live process; otherwise it restarts its workers, as torchrun
  does.

Both sides are here so that the format has one definition.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from rallypoint.client import Assignment

from .._pids import alive

__all__ = ["REGROUP_ENV", "Board", "Posted"]

#: The folder the agent's plugin and its workers share (set by the plugin).
REGROUP_ENV = "RALLYPOINT_REGROUP_DIR"
_POSTED = "generation.json"
_WORKERS = "workers"


@dataclass(frozen=True)
class Posted:
    """What the agent last posted.

    Attributes:
        generation: The generation the node is in, or the one that ended.
        ended: Whether it ended (the next one has not sealed yet).
        reason: Why it ended, when it did.
        assignment: The node's assignment in ``generation`` (while it runs).
        failed: The agent gave up regrouping in place (it restarts its workers).
        credential: The node's credential from the agent's join of ``generation``.
    """

    generation: int
    ended: bool
    reason: str = ""
    assignment: Assignment | None = None
    failed: str = ""
    credential: str | None = None


class Board:
    """One agent's board (see the module's docstring).

    Args:
        folder: The shared folder; created if missing.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        (folder / _WORKERS).mkdir(parents=True, exist_ok=True)
        self._stamp: tuple[int, int] | None = None
        self._last: Posted | None = None

    # --- the agent's side ---------------------------------------------------------------

    def post(self, posted: Posted) -> None:
        """Replaces what the board says (atomically)."""
        body = {
            "generation": posted.generation,
            "ended": posted.ended,
            "reason": posted.reason,
            "failed": posted.failed,
            "credential": posted.credential,
            "assignment": None
            if posted.assignment is None
            else posted.assignment.model_dump(mode="json"),
        }
        partial = self.folder / f".{_POSTED}.{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        # It holds the node's credential: for this user's eyes only.
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
        os.replace(partial, self.folder / _POSTED)

    def registered(self) -> bool:
        """Whether any worker registered since :meth:`forget_workers`."""
        return any((self.folder / _WORKERS).glob("[0-9]*"))

    def workers_in_place(self) -> bool:
        """Whether every local rank of the node is a live process that regroups in place."""
        pids: dict[int, int] = {}
        of = set()
        for entry in (self.folder / _WORKERS).glob("[0-9]*"):
            with contextlib.suppress(ValueError, OSError, KeyError):
                body = json.loads(entry.read_text())
                pids[int(entry.name)] = int(body["pid"])
                of.add(int(body["of"]))
        if len(of) != 1 or set(pids) != set(range(of.pop())):
            return False
        return all(alive(pid) for pid in pids.values())

    def local_world_size(self) -> int | None:
        """The node's number of workers, as its registered workers said (None: none did)."""
        for entry in (self.folder / _WORKERS).glob("[0-9]*"):
            with contextlib.suppress(ValueError, OSError, KeyError):
                return int(json.loads(entry.read_text())["of"])
        return None

    def forget_workers(self) -> None:
        """Clears the registrations (the agent is about to start new workers)."""
        for entry in (self.folder / _WORKERS).glob("*"):
            entry.unlink(missing_ok=True)

    # --- a worker's side ----------------------------------------------------------------

    def register(self, local_rank: int, local_world_size: int) -> None:
        """Says that this process, local rank ``local_rank`` of ``local_world_size``,
        regroups in place."""
        path = self.folder / _WORKERS / str(local_rank)
        partial = path.with_name(f".{local_rank}.{os.getpid()}")
        partial.write_text(json.dumps({"pid": os.getpid(), "of": local_world_size}))
        os.replace(partial, path)

    def read(self) -> Posted | None:
        """What the board says now (None before the agent posted anything); cheap when
        nothing changed (one ``stat``)."""
        try:
            st = os.stat(self.folder / _POSTED)
        except FileNotFoundError:
            return None
        stamp = (st.st_mtime_ns, st.st_ino)
        if stamp == self._stamp:
            return self._last
        try:
            body = json.loads((self.folder / _POSTED).read_text())
        except (FileNotFoundError, ValueError):
            return self._last  # replaced while read: the next read sees the new one
        raw = body.get("assignment")
        self._last = Posted(
            generation=int(body["generation"]),
            ended=bool(body["ended"]),
            reason=str(body.get("reason") or ""),
            assignment=None if raw is None else Assignment.model_validate(raw),
            failed=str(body.get("failed") or ""),
            credential=body.get("credential") or None,
        )
        self._stamp = stamp
        return self._last
