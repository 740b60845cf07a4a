"""Recovery with the shipped defaults (``RALLYPOINT_HEARTBEAT_RECONNECT`` 0.25 s): a node
that dies just after a held heartbeat, or while its join is held (before its first held
heartbeat), is found by its cut connection, not at the heartbeat timeout; and live nodes
on saturated CPUs end no generation. (A replica's SIGKILL behind the balancer and a 30 s
storage freeze, with the same defaults: tests/e2e/test_failover.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from rallypoint.cli import processes
from rallypoint.client import ElasticClient, JobStatus

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

# Joins, beats one held heartbeat, and dies by SIGKILL 10 ms after sending it: well
# before the coordinator writes that beat (a pass, 0.1 s), which used to hide the cut.
DIES_AFTER_A_BEAT = """
import os, signal, sys, threading, time
from datetime import timedelta
from rallypoint.client import ElasticClient
c = ElasticClient(sys.argv[1], sys.argv[2], sys.argv[3])
c.join("127.0.0.1")
print("joined", flush=True)
sys.stdin.readline()
threading.Thread(target=c.heartbeat, kwargs={"wait": timedelta(seconds=20)}).start()
time.sleep(0.01)
os.kill(os.getpid(), signal.SIGKILL)
"""

# A member as the torchrun plugin is one: joins, holds heartbeats until its generation
# ends, and joins again, until stdin closes.
MEMBER = """
import sys, threading
from datetime import timedelta
from rallypoint.client import ElasticClient
c = ElasticClient(sys.argv[1], sys.argv[2], sys.argv[3])
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
while not done.is_set():
    c.join("127.0.0.1")
    print("joined", c.assignment.generation, flush=True)
    while not done.is_set() and c.heartbeat(wait=timedelta(seconds=0.75)).action == "continue":
        pass
c.leave("done", fenced=False)
"""

# Burns one CPU until killed.
HOG = "while True: pass"


def node(url: str, job: str, node_id: str, script: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, url, job, node_id],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def ended_by_a_live_node(status: JobStatus, dead: set[str]) -> list[str]:
    """The reasons of generations that ended for a node lost (a cut connection, missed
    heartbeats) or re-joined, naming a node that was alive."""
    out = []
    for g in status.history:
        reason = g.ended_reason or ""
        lost = "dropped its heartbeat" in reason or "missed heartbeats" in reason
        if (lost or "re-joined" in reason) and not any(f"node {d} " in reason for d in dead):
            out.append(f"generation {g.generation}: {reason}")
    return out


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def test_a_member_killed_just_after_its_held_beat_is_found_by_the_cut(
    coordinator: processes.Coordinator, procs: list[subprocess.Popen[str]]
) -> None:
    url = coordinator.url
    ElasticClient(url, "beat", "x").create_job(2, 2, heartbeat_timeout=timedelta(seconds=60))
    procs += [node(url, "beat", n, DIES_AFTER_A_BEAT) for n in ("a", "b")]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "joined"
    assert procs[1].stdin is not None
    killed = time.monotonic()
    procs[1].stdin.write("\n")
    procs[1].stdin.flush()
    client = ElasticClient(url, "beat", "x")
    while client.membership().status == "sealed":
        # Found at the 60 s timeout, the cut went unseen.
        assert time.monotonic() - killed < 10, "b's cut watch was not seen"
        time.sleep(0.05)
    print(f"b died 10 ms after its beat: generation over in {time.monotonic() - killed:.2f} s")
    status = client.membership()
    assert status.history[-1].ended_reason == "node b dropped its heartbeat connection"
    assert ended_by_a_live_node(status, {"b"}) == []


def test_a_node_killed_while_its_join_is_held_is_left_out_of_the_round(
    coordinator: processes.Coordinator, procs: list[subprocess.Popen[str]]
) -> None:
    """Before its first held heartbeat, a node's held join is its watch: a node that died
    in it is not sealed (sealed, it was found at the heartbeat timeout, ending the
    generation of the nodes that were alive)."""
    url = coordinator.url
    ElasticClient(url, "held", "x").create_job(
        2, 3, last_call=timedelta(seconds=2), heartbeat_timeout=timedelta(seconds=60)
    )
    doomed = subprocess.Popen(
        [sys.executable, "-c", MEMBER, url, "held", "c"], stdin=subprocess.PIPE, text=True
    )
    procs.append(doomed)
    client = ElasticClient(url, "held", "x")
    deadline = time.monotonic() + 30
    while not any(w.node_id == "c" for w in client.membership().waiting):
        assert time.monotonic() < deadline, "c never waited in its join"
        time.sleep(0.02)
    os.kill(doomed.pid, signal.SIGKILL)
    killed = time.monotonic()
    procs += [node(url, "held", n, MEMBER) for n in ("a", "b")]
    for p in procs[1:]:
        assert p.stdout is not None and p.stdout.readline().split() == ["joined", "1"]
    status = client.membership()
    assert sorted(m.node_id for m in status.members) == ["a", "b"]
    print(f"sealed without the dead c {time.monotonic() - killed:.2f} s after its kill")
    assert ended_by_a_live_node(status, {"c"}) == [] and status.history[-1].ended_at is None


@pytest.mark.alone  # twice as many spinners as CPUs
def test_members_on_saturated_cpus_end_no_generation(
    coordinator: processes.Coordinator, procs: list[subprocess.Popen[str]]
) -> None:
    """Three members and a fourth that joins and leaves, five times, with every CPU of
    the machine (coordinator's too) kept busy by twice as many spinning processes: every
    generation ends for the join or the leave, none for a live node's lost watch."""
    url = coordinator.url
    ElasticClient(url, "busy", "x").create_job(
        3, 4, last_call=timedelta(0), heartbeat_timeout=timedelta(seconds=3)
    )
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        members = [node(url, "busy", n, MEMBER) for n in ("a", "b", "c")]
        procs += members
        for p in members:
            assert p.stdout is not None and p.stdout.readline().split()[0] == "joined"
        for i in range(5):
            extra = node(url, "busy", f"d{i}", MEMBER)
            procs.append(extra)
            assert extra.stdout is not None and extra.stdout.readline().split()[0] == "joined"
            time.sleep(1)  # the generation of four runs: its held heartbeats are the test
            assert extra.stdin is not None
            extra.stdin.close()  # it leaves
            assert extra.wait(60) == 0
        client = ElasticClient(url, "busy", "x")
        deadline = time.monotonic() + 30
        while (status := client.membership()).world_size != 3 or status.status != "sealed":
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert len(status.history) >= 10, status.history  # each join and leave ended one
    assert ended_by_a_live_node(status, set()) == []
