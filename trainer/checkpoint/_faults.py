"""Fault-injection points in a save, for tests only: off unless a test sets both variables.

A test names one point, one step and one global rank in ``RALLYPOINT_TEST_HALT``
(``POINT:STEP:RANK``) and a file in ``RALLYPOINT_TEST_HALT_FILE``. When that rank reaches
that point of that step's save, it writes the file (JSON: the point, step, rank, node and
its pid) and halts: it sleeps until killed (at most :data:`HALT_LIMIT`, then exits). The
test then SIGKILLs the node it wants dead, which is the state of the job at that point,
byte for byte. A point fires once per file: a restarted process that reaches it again
goes on. With ``RALLYPOINT_TEST_HALT_SECONDS`` it goes on by itself after that many
seconds: a save that takes that long at that point (the hang detector must not take it
for a hang).

The points, in the order a save passes them (docs/ARCHITECTURE.md, "Fault points"):

==========  ==========================================================================
staged      the copy of the rank's tensors is scheduled (done, with ``overlap=False``);
            ``save()`` returns next
memory      its data file is written into this node's memory tier
indexed     the version's index (``version.json``) is written beside it: the node's copy
            is readable
peer        the data file is copied to the peer node the coordinator named
uploaded    the data file is in blob storage (persisted versions only)
reported    the coordinator acknowledged the rank's report
committed   rank 0's report committed the version (rank 0 only)
returned    ``dcp.save`` returned on the rank: every rank's report is in
==========  ==========================================================================
"""

from __future__ import annotations

import json
import os
import time
from functools import cache

__all__ = ["HALT_ENV", "HALT_FILE_ENV", "HALT_LIMIT", "HALT_SECONDS_ENV", "POINTS", "reached"]

#: ``POINT:STEP:RANK``: where to halt.
HALT_ENV = "RALLYPOINT_TEST_HALT"
#: The file the halting process writes before it halts.
HALT_FILE_ENV = "RALLYPOINT_TEST_HALT_FILE"
#: Seconds after which a halted process goes on (unset: it waits to be killed).
HALT_SECONDS_ENV = "RALLYPOINT_TEST_HALT_SECONDS"
#: Seconds a halted process waits to be killed before it exits by itself.
HALT_LIMIT = 600.0
POINTS = ("staged", "memory", "indexed", "peer", "uploaded", "reported", "committed", "returned")


@cache
def _armed() -> tuple[str, int, int, str] | None:
    spec, file = os.environ.get(HALT_ENV), os.environ.get(HALT_FILE_ENV)
    if not spec or not file:
        return None
    point, step, rank = spec.split(":")
    if point not in POINTS:
        raise ValueError(f"{HALT_ENV}: unknown point {point!r}; one of {', '.join(POINTS)}")
    return point, int(step), int(rank), file


def reached(point: str, step: int, rank: int) -> None:
    """Marks that ``rank`` passed ``point`` of ``step``'s save: halts there if a test
    asked for it, else returns at once."""
    armed = _armed()
    if armed is None or armed[:3] != (point, step, rank):
        return
    try:
        # Created exclusively: only the first process to get here halts.
        with open(armed[3], "x") as f:
            node, pid = os.environ.get("RALLYPOINT_NODE"), os.getpid()
            f.write(
                json.dumps({"point": point, "step": step, "rank": rank, "node": node, "pid": pid})
            )
    except FileExistsError:
        return
    seconds = os.environ.get(HALT_SECONDS_ENV)
    if seconds:
        time.sleep(float(seconds))
        return
    end = time.monotonic() + HALT_LIMIT
    while time.monotonic() < end:
        time.sleep(1.0)
    os._exit(70)
