"""A node's reading of its workers' progress records (trainer/health/_record.py): how long
a worker waited for a CPU since its last progress, as the kernel counts it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rallypoint.trainer.health import Record, Starvation, read_node, write_record


def spin(seconds: float) -> None:
    """Keeps this thread runnable for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.e2e  # a spinning process shares this one's CPU
def test_a_worker_starved_of_its_cpu_says_so_and_one_that_sleeps_does_not(
    tmp_path: Path,
) -> None:
    # This process stands for a worker: its record, its main thread's run delay.
    fd = os.open(tmp_path / "0", os.O_RDWR | os.O_CREAT, 0o600)
    write_record(fd, Record(os.getpid(), 0, 1, 12, "train", time.monotonic()))
    starvation = Starvation()
    (first,) = read_node(tmp_path, 1, starvation=starvation)
    assert first.starved == 0.0

    # Asleep: it waits for no CPU, however long it shows no progress.
    time.sleep(0.5)
    (asleep,) = read_node(tmp_path, 1, starvation=starvation)
    assert asleep.idle >= 0.5 and asleep.starved is not None and asleep.starved < 0.1

    # Runnable on a CPU that another process keeps busy: about half its time waits.
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        os.sched_setaffinity(0, {cpu})
        spin(1.5)
    finally:
        os.sched_setaffinity(0, before)
        hog.kill()
        hog.wait()
    (starved,) = read_node(tmp_path, 1, starvation=starvation)
    assert starved.starved is not None and 0.3 < starved.starved <= starved.idle, starved

    # A new step starts the count again.
    write_record(fd, Record(os.getpid(), 0, 1, 13, "train", time.monotonic()))
    (stepped,) = read_node(tmp_path, 1, starvation=starvation)
    assert stepped.step == 13 and stepped.starved == 0.0
    os.close(fd)


def test_a_record_read_just_before_its_worker_stepped_reads_as_no_wait() -> None:
    # The reader took ``now``, then the worker stepped, then the reader read its record:
    # its last progress is after ``now``. Nothing of it was idle, nor starved (a negative
    # starved time once failed the model, and with it the node's heartbeats).
    now = time.monotonic()
    said = Record(os.getpid(), 0, 1, 12, "train", now + 0.002).progress(now, "running", 0.5)
    assert (said.idle, said.starved) == (0.0, 0.0)
    later = Record(os.getpid(), 0, 1, 12, "train", now - 2.0).progress(now, "running", 0.5)
    assert (later.idle, later.starved) == (2.0, 0.5)
