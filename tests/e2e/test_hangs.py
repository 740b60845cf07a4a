"""A job never stalls silently: real torchrun agents (CPU, gloo), the DDP example, a real
coordinator, and ranks that hang or straggle.

A worker stopped by SIGSTOP (a process stuck in a kernel call or on a hung GPU looks like
this) or whose main thread sleeps for good while its other threads run (a deadlock in
Python) is found by the coordinator from its node's progress reports, named with its
node and rank, its stacks taken before its agent stops it, and the others train on. A
throttled rank is named a straggler and, with ``straggler=replace``, swapped for a
standby. And the detector ends no generation for what only looks slow: saturated CPUs,
a first step that compiles, an evaluation, a slow save.

The figures (how soon, against stock torchrun) are bench/hangs.py's; these tests check
what happens.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from rallypoint.cli.processes import Cluster, Coordinator, judge
from rallypoint.tls import ssl_context

from .._support import ended, gone, hang_report, small_cluster, status, status_until, throttled

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

HOG = "while True: pass"


def worker(coordinator: Coordinator, cluster: Cluster, node: str) -> tuple[int, int, int]:
    """The generation running now, and the pid and global rank of ``node``'s worker in it
    (its ``resumed`` event; one worker per node)."""
    now = status(coordinator, cluster.job)
    generation = now["generation"]
    rank = next(m["rank"] for m in now["members"] if m["node_id"] == node)
    found = cluster.wait_for(
        lambda e: e["event"] == "resumed" and e["generation"] == generation and e["rank"] == rank
    )
    return generation, int(found["pid"]), rank


def stepped(cluster: Cluster, *, after: int, world: int, step: int = 0) -> dict[str, Any]:
    """The first step at ``step`` or later of a generation after ``after`` of ``world``
    (0: of any)."""
    return cluster.wait_for(
        lambda e: (
            e["event"] == "step"
            and e["generation"] > after
            and world in (0, e["world_size"])
            and e["step"] >= step
        )
    )


def standing_by(coordinator: Coordinator, cluster: Cluster, node: str) -> None:
    """Adds ``node``, which parks beside the full generation, and waits until it does."""
    cluster.add(node)
    status_until(
        coordinator,
        cluster.job,
        lambda s: any(w["node_id"] == node and w["standby"] for w in s["waiting"]),
        60,
        f"{node} standing by",
    )


def hung_and_found(
    coordinator: Coordinator, cluster: Cluster, node: str, stop: str = "sigstop"
) -> tuple[int, int, int, str]:
    """Makes ``node``'s worker hang (SIGSTOP, or its main thread asleep for good through
    the example's ``--hang-file``) and waits for the coordinator to end its generation.
    The generation, the worker's pid and rank, and the reason it ended with."""
    generation, pid, rank = worker(coordinator, cluster, node)
    if stop == "sigstop":
        os.kill(pid, signal.SIGSTOP)
    else:
        (cluster.workdir / "hang").write_text(str(pid))
    reason = ended(coordinator, cluster.job, generation, timeout=60)
    return generation, pid, rank, reason


def finish(cluster: Cluster, coordinator: Coordinator, steps: int) -> list[dict[str, Any]]:
    cluster.wait(timeout=200)
    history: list[dict[str, Any]] = status(coordinator, cluster.job)["history"]
    verdict = judge(cluster.events(), history)
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == steps
    return history


@pytest.mark.parametrize(
    "launch",
    [
        pytest.param("run", id="rallypoint-run"),
        pytest.param("in-place", id="in-place"),
        pytest.param("torchrun", id="stock-torchrun"),
    ],
)
def test_a_stopped_worker_is_named_its_stacks_kept_and_the_others_train_on(
    coordinator: Coordinator, tmp_path: Path, launch: str
) -> None:
    cluster = small_cluster(
        coordinator, "hang", tmp_path, nnodes="2:3", steps=400, step_time=0.1,
        in_place=launch == "in-place",
    )  # fmt: skip
    # Stock torchrun's workers: fresh interpreters at every restart, as without rallypoint run.
    env = {"RALLYPOINT_WARM_START": "0"} if launch == "torchrun" else {}
    try:
        cluster.start("a", "b", "c", env=env)
        stepped(cluster, after=0, world=3, step=20)
        generation, pid, rank, reason = hung_and_found(coordinator, cluster, "b")
        assert reason.startswith(f"rank {rank} on node b hung: no progress for "), reason
        # The limit: 10 times the job's slowest p95 step interval, 3 s at least (a
        # loaded machine's steps may make it more).
        limit = re.search(r" in train at step \d+ \(limit (\d+\.\d) s\)$", reason)
        assert limit is not None and float(limit[1]) >= 3.0, reason

        report = hang_report(coordinator, cluster.job, generation)
        assert (report["node_id"], report["rank"], report["pid"]) == ("b", rank, pid)
        assert report["phase"] == "train" and report["idle"] > report["limit"] >= 3.0
        assert round(report["limit"], 1) == float(limit[1]), report
        # py-spy could not suspend a stopped process, and read it as it stood.
        assert report["taken_by"].startswith("py-spy") and "(not suspended)" in report["taken_by"]
        assert "train_ddp.py" in report["stacks"], report["stacks"]
        assert gone(pid), "the hung worker was not stopped"

        # The next round sealed without b (its node is not waited for): the others train
        # on, and b comes back. (b's warm worker may be ready again before the others'
        # first step on a slow machine: its hot join then ends their generation, and they
        # first train with b back. Stock torchrun's workers start afresh at every restart,
        # the survivors' as slowly as b's: its next round may hold b already.)
        stepped(cluster, after=generation, world=0)
        if launch != "torchrun":
            after = status(coordinator, cluster.job)["history"][generation]
            assert after["world_size"] == 2, after
        stepped(cluster, after=generation, world=3)
        listed = httpx.get(f"{coordinator.url}/v1/jobs/hang/hangs", verify=ssl_context()).json()
        assert [(h["generation"], h["node_id"]) for h in listed] == [(generation, "b")]
        if launch == "run":
            # A second hang of the same node within the hour: it is quarantined.
            again, _, _, reason = hung_and_found(coordinator, cluster, "b")
            assert reason.startswith("rank ") and " on node b hung" in reason, reason
            quarantined = status(coordinator, cluster.job)["quarantined_nodes"]
            assert [(q["node_id"], q["by"]) for q in quarantined] == [("b", "hangs")]
            stepped(cluster, after=again, world=2)
        history = finish(cluster, coordinator, 400)
    finally:
        cluster.stop()
    causes = [h["ended_reason"] for h in history if h["ended_reason"]]
    assert causes[0].startswith(f"rank {rank} on node b hung: "), causes
    assert sum(" hung: " in c for c in causes) == (2 if launch == "run" else 1), causes


def test_a_python_level_hang_is_found_and_a_standby_takes_the_hung_node_s_place(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """A rank whose main thread sleeps for good while its other threads (heartbeats,
    saves, the preemption watcher) run on: alive, and stuck. With a standby parked, it
    takes the hung node's rank at once, so the world keeps its size."""
    cluster = small_cluster(
        coordinator, "asleep", tmp_path, nnodes="2:3", steps=300, step_time=0.1, standbys=1
    )
    cluster.script += ["--hang-file", str(tmp_path / "hang")]
    try:
        cluster.start("a", "b", "c")
        stepped(cluster, after=0, world=3, step=10)
        standing_by(coordinator, cluster, "d")
        generation, pid, rank, reason = hung_and_found(coordinator, cluster, "b", "asleep")
        assert reason.startswith(f"rank {rank} on node b hung: no progress for "), reason
        report = hang_report(coordinator, cluster.job, generation)
        # A process that still runs is suspended for a consistent read.
        assert report["taken_by"].startswith("py-spy") and "not suspended" not in report["taken_by"]
        assert "pause" in report["stacks"] and "rallypoint-" in report["stacks"], report["stacks"]
        assert gone(pid)
        after = stepped(cluster, after=generation, world=3)
        members = status(coordinator, cluster.job)["members"]
        assert {m["node_id"]: m["rank"] for m in members}["d"] == rank  # b's rank
        history = finish(cluster, coordinator, 300)
    finally:
        cluster.stop()
    assert history[after["generation"] - 1]["world_size"] == 3


def test_a_throttled_rank_is_named_a_straggler_and_a_standby_replaces_it(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    cluster = small_cluster(
        coordinator, "slow", tmp_path, nnodes="2:3", steps=100000, step_time=0.05, standbys=1
    )
    cluster.conf += ",straggler=replace"
    try:
        cluster.start("a", "b", "c")
        stepped(cluster, after=0, world=3, step=30)
        standing_by(coordinator, cluster, "d")
        generation, pid, rank = worker(coordinator, cluster, "b")
        with throttled(pid):
            reason = ended(coordinator, cluster.job, generation, timeout=90)
        assert reason.startswith(f"node b quarantined: straggler: rank {rank}'s score "), reason
        now = status(coordinator, cluster.job)
        assert [(q["node_id"], q["by"]) for q in now["quarantined_nodes"]] == [("b", "straggler")]
        stepped(cluster, after=generation, world=3)
        members = {m["node_id"]: m["rank"] for m in status(coordinator, cluster.job)["members"]}
        assert members["d"] == rank and "b" not in members
    finally:
        cluster.stop()
    named = [line for line in coordinator.log_tail(400).splitlines() if "is a straggler" in line]
    assert len(named) == 1 and f"rank {rank} on node b is a straggler" in named[0], named


@pytest.mark.alone  # twice as many spinners as CPUs
def test_what_only_looks_slow_ends_no_generation(coordinator: Coordinator, tmp_path: Path) -> None:
    """Every CPU kept busy by twice as many spinning processes, a first step that takes
    20 times the others (a compile), an evaluation of 10 s, and a save that takes 6 s on
    the training thread of one rank: the job runs to its end in one generation."""
    cluster = small_cluster(coordinator, "busy", tmp_path, nnodes="3:3", steps=120, step_time=0.1)
    cluster.script += ["--first-step-extra", "3", "--eval-every", "60", "--eval-seconds", "10"]
    halt = {
        "RALLYPOINT_TEST_HALT": "staged:30:0",
        "RALLYPOINT_TEST_HALT_FILE": str(tmp_path / "halted"),
        "RALLYPOINT_TEST_HALT_SECONDS": "6",
    }
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        cluster.start("a", "b", "c", env=halt)
        history = finish(cluster, coordinator, 120)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        cluster.stop()
    assert len(history) == 1, history
    assert (tmp_path / "halted").exists(), "the save never took its 6 s"
    assert any(e["event"] == "evaluated" for e in cluster.events())
    hangs = httpx.get(f"{coordinator.url}/v1/jobs/busy/hangs", verify=ssl_context()).json()
    assert hangs == []
