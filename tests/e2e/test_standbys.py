"""Standbys end to end: real torchrun agents with ``--rdzv-conf standbys=1``, the DDP
example with two worker processes a node, a real coordinator, and node SIGKILLs.

A fifth node parks beside a full 4-node generation without ending it, and takes copies
of the members' checkpoint files into its memory tier; when an active node is killed,
the standby takes its node rank (so its global ranks) and restores from its own memory
(0 bytes from storage or peers), the world keeps its size and every other node its
rank; a second kill, with no standby left, falls back
to the elastic rules (the world shrinks). ``judge`` checks that every rank of every
generation loaded the checkpoint the coordinator named for it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from rallypoint.cli.processes import Cluster, Coordinator

from .._support import (
    cli,
    committed,
    ends,
    judged,
    saved_since,
    small_cluster,
    status,
    status_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NPROC = 2


def step_at(cluster: Cluster, step: int, **where: Any) -> dict[str, Any]:
    return cluster.wait_for(
        lambda e: (
            e["event"] == "step" and e["step"] >= step and all(e[k] == v for k, v in where.items())
        ),
        timeout=180,
    )


def two_and_a_standby(
    cluster: Cluster,
    coordinator: Coordinator,
    step: int,
    env: dict[str, str] | None = None,
    standby_env: dict[str, str] | None = None,
) -> None:
    """Nodes a and b train to ``step``, then s parks beside them (with ``standby_env``
    added to ``env``)."""
    cluster.start("a", "b", env=env)
    step_at(cluster, step, world_size=2)
    cluster.add("s", env={**(env or {}), **(standby_env or {})})
    status_until(coordinator, cluster.job, lambda body: any(w["standby"] for w in body["waiting"]))


def node_ranks(coordinator: Coordinator, job: str) -> dict[str, int]:
    return {m["node_id"]: m["rank"] for m in status(coordinator, job)["members"]}


def test_a_standby_takes_a_killed_nodes_ranks_and_the_world_keeps_its_size(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    cluster = small_cluster(
        coordinator,
        "spare",
        tmp_path,
        nnodes="3:4",
        standbys=1,
        nproc=NPROC,
        steps=120,
    )
    try:
        cluster.start("a", "b", "c", "d")
        step_at(cluster, 10, world_size=4 * NPROC)
        before = node_ranks(coordinator, "spare")
        cluster.add("s")
        # The standby parks: shown as one, and the running generation goes on.
        parked = status_until(
            coordinator,
            "spare",
            lambda body: any(w["standby"] for w in body["waiting"]),
            what="a standby",
        )
        assert [(w["node_id"], w["round"]) for w in parked["waiting"]] == [("s", 2)]
        at = max(e["step"] for e in cluster.events() if e["event"] == "step")
        step_at(cluster, at + 10, generation=1)
        # A version begun since it parked (every 10th step) is one it holds copies of.
        committed(coordinator, "spare", (at // 10 + 1) * 10)
        assert len(status(coordinator, "spare")["history"]) == 1

        victim = next(n for n, r in before.items() if r == 2)
        cluster.kill(victim)
        step_at(cluster, 0, generation=2)
        after = node_ranks(coordinator, "spare")
        # The standby has the victim's node rank, so its global ranks 2*2 and 2*2+1;
        # every other node kept its own.
        # A survivor missing here was not back by the seal: in one e2e run (1 of 8 runs of
        # this test), c's agent had stopped its workers (SIGTERM) and not rejoined 4 s
        # after the end, its last beat from before it, so the seal (heartbeat_timeout
        # 3 s) left it out. Agents now beat on while their workers stop, and the round
        # waits for them (_seal.restarting). The message says what the coordinator saw.
        assert after == {**{n: r for n, r in before.items() if n != victim}, "s": 2}, (
            after,
            cluster.said(),
        )
        assert status(coordinator, "spare")["world_size"] == 4
        # It held copies of the victim's files (and rank 0's, whose DCP metadata every
        # rank reads): its ranks restored from its own memory alone.
        taken = [
            e
            for e in cluster.events()
            if e["event"] == "resumed" and e["generation"] == 2 and e["rank"] // NPROC == 2
        ]
        assert len(taken) == NPROC, taken
        for e in taken:
            read = e["bytes_from"]
            assert read["storage"] == read["peer"] == 0 and read["memory"] > 0, e

        # No standby left: a second kill shrinks the world, as without standbys.
        second = next(n for n, r in after.items() if r == 1)
        cluster.kill(second)
        step_at(cluster, 0, generation=3, world_size=3 * NPROC)
        codes = cluster.wait(timeout=240)
    finally:
        cluster.stop()
    history = judged(coordinator, cluster, 120)
    assert [g["world_size"] for g in history] == [4, 4, 3]
    assert (
        "missed heartbeats" in history[0]["ended_reason"]
        or "dropped" in (history[0]["ended_reason"])
    )
    assert {n: c for n, c in codes.items() if n not in {victim, second}} == dict.fromkeys(
        [n for n in ("a", "b", "c", "d", "s") if n not in {victim, second}], 0
    ), codes


def test_a_hot_standbys_worker_waits_built_and_takes_the_lost_rank_in_place(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """``hot_standby=1`` and workers that regroup in place: the standby's worker starts
    as soon as it parks and waits in ``join()``, its model built; the kill promotes it,
    and that same process trains in the lost rank from its own memory."""
    cluster = small_cluster(
        coordinator,
        "hot",
        tmp_path,
        nnodes="1:2",
        standbys=1,
        hot_standby=True,
        in_place=True,
        steps=400,
    )
    try:
        two_and_a_standby(cluster, coordinator, 10)
        # Its worker, started at the park, has built its model and waits in join().
        waiting = cluster.wait_for(lambda e: e["event"] == "standing_by", timeout=120)
        assert waiting["node"] == "s"
        saved_since(coordinator, "hot", time.time())
        before = node_ranks(coordinator, "hot")
        victim = next(n for n, r in before.items() if r == 1)
        cluster.kill(victim)
        step_at(cluster, 0, generation=2)
        assert node_ranks(coordinator, "hot") == {
            **{n: r for n, r in before.items() if n != victim},
            "s": 1,
        }
        codes = cluster.wait(timeout=240)
    finally:
        cluster.stop()
    history = judged(coordinator, cluster, 400)
    assert [g["world_size"] for g in history] == [2, 2]
    (taken,) = [
        e
        for e in cluster.events()
        if e["event"] == "resumed" and e["generation"] == 2 and e["rank"] == 1
    ]
    # The process that stood by trains in the lost rank.
    assert taken["pid"] == waiting["pid"], (taken, waiting)
    read = taken["bytes_from"]
    assert read["storage"] == read["peer"] == 0 and read["memory"] > 0, taken
    assert {n: c for n, c in codes.items() if n != victim} == {
        "a" if victim == "b" else "b": 0,
        "s": 0,
    }


#: A module the standby's warm server imports (``RALLYPOINT_WARM_MODULES``) that holds
#: it until the test opens the gate: its workers fork only then.
GATED_IMPORT = """
import os, time
deadline = time.monotonic() + 150
while not os.path.exists(os.environ["WARM_GATE"]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def test_a_hot_standby_whose_workers_fork_after_its_promotion_trains_in_the_lost_rank(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """A hot standby's workers start when its warm server has imported torch: seconds,
    in which the node may already be promoted. torchrun gave them the placeholder
    world's variables; they must still wait for the round (it sealed: at once), so that
    ``join()`` sets the generation's. Told the generation alone, they built their group
    at the placeholder master and failed, and the node re-joined: one more generation."""
    cluster = small_cluster(
        coordinator,
        "late",
        tmp_path,
        nnodes="1:2",
        standbys=1,
        hot_standby=True,
        steps=400,
    )
    (tmp_path / "gated.py").write_text(GATED_IMPORT)
    gate = tmp_path / "gate"
    try:
        two_and_a_standby(
            cluster,
            coordinator,
            10,
            standby_env={
                "RALLYPOINT_WARM_MODULES": "gated",
                "PYTHONPATH": str(tmp_path),
                "WARM_GATE": str(gate),
            },
        )
        before = node_ranks(coordinator, "late")
        victim = next(n for n, r in before.items() if r == 1)
        cluster.kill(victim)
        # Promoted while its warm server still imports: then its workers fork.
        status_until(coordinator, "late", lambda body: body["generation"] == 2)
        assert node_ranks(coordinator, "late")["s"] == 1
        gate.touch()
        step_at(cluster, 0, generation=2)
        codes = cluster.wait(timeout=240)
    finally:
        cluster.stop()
    history = judged(coordinator, cluster, 400)
    assert [g["world_size"] for g in history] == [2, 2], ends(history)
    taken = [
        e
        for e in cluster.events()
        if e["event"] == "resumed" and e["generation"] == 2 and e["rank"] == 1
    ]
    assert len(taken) == 1, taken
    assert {n: c for n, c in codes.items() if n != victim} == {
        "a" if victim == "b" else "b": 0,
        "s": 0,
    }


@pytest.mark.parametrize("hot", [False, True], ids=["cold", "hot"])
def test_a_standby_never_needed_exits_0_when_the_job_finishes(
    coordinator: Coordinator, tmp_path: Path, hot: bool
) -> None:
    # 150 steps (7.5 s and more): two agents started at once here first joined 6.5 s
    # after their start, and under four xdist workers the 60 steps this ran before ended
    # before s had joined (the test then waited out its 150 s for a standby).
    cluster = Cluster(
        coordinator.url,
        "done",
        tmp_path,
        nnodes="1:2",
        standbys=1,
        hot_standby=hot,
        steps=150,  # with the example's full images: the slack above was measured with them
    )
    try:
        # torchrun's own INFO lines (its exit barrier's among them): in one CI run of
        # 580a772 the [hot] case's a and b never exited after training, and their logs
        # said nothing.
        two_and_a_standby(cluster, coordinator, 5, env={"LOGLEVEL": "INFO"})
        # min_nodes 1: sealing the standby alone would start a run of its own.
        codes = cluster.wait(timeout=120)
    finally:
        cluster.stop()
    assert codes == {"a": 0, "b": 0, "s": 0}
    history = status(coordinator, "done")["history"]
    assert len(history) == 1 and history[0]["ended_reason"].endswith("left: finished")
    assert "this standby exits" in cluster.agents["s"].log.read_text()


def test_a_quarantined_node_is_refused_and_never_stands_by(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """The operator quarantines node s before it starts: its agent is refused (it neither
    parks nor joins) and exits non-zero, its log naming the command that clears it; a and
    b train to the end in their one generation."""
    cluster = Cluster(coordinator.url, "bad", tmp_path, nnodes="1:2", standbys=1, steps=60)
    try:
        cluster.start("a", "b")
        step_at(cluster, 5, world_size=2)
        done = cli(
            "nodes", "quarantine", "bad", "s", "--reason", "ECC errors", "--url", coordinator.url
        )
        assert done.returncode == 0, done.stderr
        refused = cluster.add("s")
        assert refused.proc.wait(timeout=120) != 0
        codes = cluster.wait(timeout=120)
    finally:
        cluster.stop()
    assert (codes["a"], codes["b"]) == (0, 0), codes
    assert "rallypoint nodes unquarantine bad s" in refused.log.read_text()
    body = status(coordinator, "bad")
    assert not body["waiting"] and len(body["history"]) == 1, body
