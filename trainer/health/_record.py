"""A worker's progress record: one small file per local rank, which its agent reads.

Workers and their agent are separate processes on one machine. Each worker keeps its
progress in a file of its own under ``RALLYPOINT_PROGRESS_DIR`` (the agent makes the
folder and exports it), named by its local rank, and rewrites the record in place at
every optimizer step: one ``pwrite`` of a few dozen bytes, no collective, no request.
The agent reads every record when it beats (:func:`read_node`) and sends the node's
processes' progress with its heartbeat.

Times are ``time.monotonic()``, which on Linux is the machine's one ``CLOCK_MONOTONIC``:
the agent's reading of "seconds since the last step" needs no clock of the worker's.
A record names its writer's pid and generation: one of a dead worker, or of an earlier
generation's, is not reported (the next worker rewrites it). A checksum lets a read that
races a write be told apart and retried.

Both sides are here so that the format has one definition.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rallypoint.client.models import Phase, ProcessState, RankProgress

from .._pids import alive, run_delay, state

__all__ = [
    "PHASES",
    "PROGRESS_ENV",
    "SIZE",
    "Record",
    "Starvation",
    "read_node",
    "read_record",
    "records",
    "write_record",
]

#: The folder of a node's progress records (set by the agent for its workers).
PROGRESS_ENV = "RALLYPOINT_PROGRESS_DIR"
#: The phases, by their code in a record.
PHASES: tuple[Phase, ...] = ("start", "train", "save", "load", "eval")
_MAGIC = 0x52505031  # "RPP1"
# magic, pid, rank, phase, waiting, generation, step, last (monotonic), interval, own,
# written.
_LAYOUT = struct.Struct("<IIiB?xxqqdddd")
_CRC = struct.Struct("<I")
SIZE = _LAYOUT.size + _CRC.size


@dataclass(frozen=True)
class Record:
    """What one worker says of itself.

    Attributes:
        pid: The worker's process.
        rank: Its global rank.
        generation: The generation it works in (0: it waits to join one).
        step: The training step it reached.
        phase: What it does.
        last: When it last showed progress (``time.monotonic()``): its last step, or
            its entry into ``phase``, whichever came later.
        interval: The 95th percentile of the seconds between its recent steps.
        own: The mean of its recent steps' own time.
        waiting: Whether it waits for its peers (see ``RankProgress.waiting``).
    """

    pid: int
    rank: int
    generation: int
    step: int
    phase: Phase
    last: float
    interval: float | None = None
    own: float | None = None
    waiting: bool = False

    def progress(
        self, now: float, process: ProcessState | None = None, starved: float | None = None
    ) -> RankProgress:
        """The record as a heartbeat carries it, ``idle`` as of ``now`` (monotonic), with
        its process's state (``process``) and the seconds of ``idle`` it waited for a CPU
        (``starved``) where its reader knows them."""
        # The worker may step after ``now`` was read and before its record was: its
        # last progress is then after ``now``, and it was idle for none of it.
        idle = max(0.0, now - self.last)
        return RankProgress(
            rank=self.rank,
            step=self.step,
            phase=self.phase,
            idle=round(idle, 3),
            interval=None if self.interval is None else round(self.interval, 4),
            own=None if self.own is None else round(self.own, 4),
            waiting=self.waiting,
            process=process,
            starved=None if starved is None else round(max(0.0, min(starved, idle)), 3),
        )


class Starvation:
    """How long each worker waited for a CPU since its last progress: its main thread's
    run delay (the kernel's count) at the first read that saw that progress, against the
    delay now. What passed between the progress and that read is not counted, so a
    figure is at most the truth: a read at every beat (a second apart) misses at most a
    beat's worth."""

    def __init__(self) -> None:
        self._since: dict[tuple[int, float], float] = {}

    def __call__(self, records: Sequence[Record]) -> dict[int, float | None]:
        """Each of ``records``' seconds starved since its last progress, by pid."""
        seen: dict[tuple[int, float], float] = {}
        out: dict[int, float | None] = {}
        for record in records:
            delay = run_delay(record.pid)
            if delay is None:
                out[record.pid] = None
                continue
            key = (record.pid, record.last)
            seen[key] = self._since.get(key, delay)
            out[record.pid] = max(0.0, delay - seen[key])
        self._since = seen  # a worker's earlier progress, or a gone worker's, is dropped
        return out


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def _opt(value: float) -> float | None:
    return None if math.isnan(value) else value


def write_record(fd: int, record: Record) -> None:
    """Rewrites the record in the open file ``fd`` (one ``pwrite``)."""
    body = _LAYOUT.pack(
        _MAGIC,
        record.pid,
        record.rank,
        PHASES.index(record.phase),
        record.waiting,
        record.generation,
        record.step,
        record.last,
        _nan(record.interval),
        _nan(record.own),
        time.monotonic(),
    )
    os.pwrite(fd, body + _CRC.pack(zlib.crc32(body)), 0)


def read_record(path: Path, tries: int = 3) -> Record | None:
    """The record in ``path``; None if there is none, or no whole one in ``tries`` reads
    (each read that races a write fails its checksum, and the next one is whole)."""
    for _ in range(tries):
        try:
            raw = path.read_bytes()
        except OSError:
            return None
        if len(raw) < SIZE:
            return None
        body, (crc,) = raw[: _LAYOUT.size], _CRC.unpack(raw[_LAYOUT.size : SIZE])
        if zlib.crc32(body) != crc:
            continue
        magic, pid, rank, phase, waiting, generation, step, last, interval, own, _ = _LAYOUT.unpack(
            body
        )
        if magic != _MAGIC or phase >= len(PHASES):
            return None
        return Record(
            pid, rank, generation, step, PHASES[phase], last, _opt(interval), _opt(own), waiting
        )
    return None


def read_node(
    folder: Path,
    generation: int,
    now: float | None = None,
    starvation: Starvation | None = None,
) -> list[RankProgress]:
    """The progress of a node's live workers of ``generation``, by rank: what the node's
    heartbeat carries. A record of a worker that exited, or of another generation (an
    earlier one's, or a hot standby's worker that waits to join), is left out. With
    ``starvation`` (the reader's, kept from read to read), each says how long it waited
    for a CPU since its last progress."""
    now = time.monotonic() if now is None else now
    live: list[Record] = []
    with contextlib.suppress(OSError):
        for entry in folder.iterdir():
            if not entry.name.isdigit():
                continue
            record = read_record(entry)
            if record is None or record.generation != generation or not alive(record.pid):
                continue
            live.append(record)
    starved = starvation(live) if starvation is not None else {}
    out = {r.rank: r.progress(now, state(r.pid), starved.get(r.pid)) for r in live}
    return [out[rank] for rank in sorted(out)]


def records(folder: Path) -> dict[int, Record]:
    """Every readable record in ``folder``, by local rank (the file's name)."""
    out: dict[int, Record] = {}
    with contextlib.suppress(OSError):
        for entry in folder.iterdir():
            if entry.name.isdigit() and (record := read_record(entry)) is not None:
                out[int(entry.name)] = record
    return out
