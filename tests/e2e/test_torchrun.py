"""Elastic training end to end: real torchrun agents (CPU, gloo) with
``--rdzv-backend=rallypoint``, a real coordinator, the DDP example, and failures.

Each test drives one job through several failures; ``judge`` checks that every rank of
every generation loaded the checkpoint the coordinator named for that generation.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from rallypoint.cli.fake_imds import FakeImds
from rallypoint.cli.processes import Cluster, Coordinator, judge

from .._support import IMAGE_SIZE, ended, pids_of, standing_still, status

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def node_of_rank(coordinator: Coordinator, job: str, rank: int) -> str:
    members = status(coordinator, job)["members"]
    return next(m["node_id"] for m in members if m["rank"] == rank)


def step_at(cluster: Cluster, step: int, **where: Any) -> dict[str, Any]:
    return cluster.wait_for(
        lambda e: (
            e["event"] == "step" and e["step"] >= step and all(e[k] == v for k, v in where.items())
        )
    )


def finish(cluster: Cluster, coordinator: Coordinator, steps: int) -> tuple[Any, list[Any]]:
    """Waits for the job to end; the verdict and the generation history."""
    codes = cluster.wait(timeout=200)
    history = status(coordinator, cluster.job)["history"]
    verdict = judge(cluster.events(), history)
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == steps, codes
    assert verdict.first_loss is not None and verdict.last_loss is not None
    assert verdict.last_loss < verdict.first_loss / 4  # it trained across the restarts
    return verdict, history


def kill_rank_0_then_add_a_node(
    cluster: Cluster, coordinator: Coordinator
) -> tuple[str, Any, list[Any]]:
    """Three nodes train; rank 0's node is SIGKILLed (the first generation's store and
    rank 0 live on it); a late node joins; the job runs to its end. The killed node, the
    verdict and the generation history."""
    # The survivors stand still on purpose below: no hang detection for them.
    cluster.conf += ",hang_limit=0"
    try:
        cluster.start("a", "b", "c")
        step_at(cluster, 25, world_size=3)
        rank0 = node_of_rank(coordinator, cluster.job, 0)
        cluster.kill(rank0)
        step_at(cluster, 0, world_size=2)
        # The survivors stand still while the late node's agent starts, so that it joins
        # mid-run on a machine of any speed (at full speed the run ends in seconds).
        with standing_still(pids_of(cluster, 2)):
            cluster.add("late")
            assert "joined" in ended(coordinator, cluster.job, 2)
        step_at(cluster, 0, world_size=3, generation=3)
        verdict, history = finish(cluster, coordinator, 150)
    finally:
        cluster.stop()
    return rank0, verdict, history


def test_sigkill_of_rank_0_then_a_late_node_scales_back_up(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    cluster = Cluster(
        coordinator.url, "kill0", tmp_path, nnodes="2:3", steps=150, image_size=IMAGE_SIZE
    )
    rank0, verdict, history = kill_rank_0_then_add_a_node(cluster, coordinator)
    reasons = [(g["world_size"], g.get("ended_reason")) for g in history]
    assert [g["world_size"] for g in history] == [3, 2, 3], reasons
    assert "joined" in history[1]["ended_reason"]
    # Survivors kept their order: the old rank 1 is rank 0 now.
    assert rank0 not in {m["node_id"] for m in status(coordinator, "kill0")["members"]}
    # A checkpoint every 10 steps, saved asynchronously: one still uploading when the
    # generation ends never commits, so a restart loses fewer than two intervals.
    assert all(lost < 20 for lost in verdict.steps_lost.values()), verdict.steps_lost


def test_survives_a_coordinator_restart_and_the_sigkill_of_a_nonzero_rank(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    cluster = Cluster(
        coordinator.url, "restart", tmp_path, nnodes="2:3", steps=150, image_size=IMAGE_SIZE
    )
    try:
        cluster.start("a", "b", "c")
        step_at(cluster, 20, world_size=3)
        coordinator.kill()  # SIGKILL: nothing flushed
        coordinator.start()
        step_at(cluster, 60, world_size=3)  # checkpoints and heartbeats carried on
        cluster.kill(node_of_rank(coordinator, "restart", 2))
        _, history = finish(cluster, coordinator, 150)
    finally:
        cluster.stop()
    # One generation until the kill: the restart itself cost no restart of training.
    assert [g["world_size"] for g in history] == [3, 2]


def test_a_preemption_notice_and_a_sigterm_lose_no_steps(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    with FakeImds() as imds:
        # Checkpoints to memory every 10 steps, to storage every 1,000th: the notice
        # must put the emergency version in storage.
        cluster = Cluster(
            coordinator.url,
            "preempt",
            tmp_path,
            nnodes="1:3",
            steps=150,
            imds_url=imds.url,
            persist_every=100,
            image_size=IMAGE_SIZE,
        )
        try:
            cluster.start("a", "b", "c")
            step_at(cluster, 20, world_size=3)
            event_id = imds.schedule("b")
            step_at(cluster, 0, world_size=2)
            assert imds.acknowledged == [event_id]
            cluster.terminate("c")  # as a platform evicting a node does
            step_at(cluster, 0, world_size=1)
            verdict, history = finish(cluster, coordinator, 150)
            codes = cluster.wait()
        finally:
            cluster.stop()
    assert codes["b"] == 0  # the preempted node left cleanly
    # The evicted one too: its worker ended after its emergency checkpoint, as SIGTERM
    # would have, and its agent said so in a line (its worker, exiting 0, once waited
    # for the stopping agent to read its result: 30 s, until torch's SIGKILL).
    assert codes["c"] == 128 + signal.SIGTERM, codes
    log = cluster.agents["c"].log.read_text()
    assert "rallypoint run: stopped by SIGTERM; its workers ended" in log, log[-3000:]
    assert "forcefully exiting" not in log and "Traceback" not in log, log[-3000:]
    assert [g["world_size"] for g in history] == [3, 2, 1]
    assert "preempted (Preempt)" in history[0]["ended_reason"]
    assert "preempted (SIGTERM)" in history[1]["ended_reason"]
    emergency = [e for e in cluster.events() if e["event"] == "emergency"]
    assert {e["generation"] for e in emergency} == {1, 2}
    assert verdict.steps_lost == {2: 0, 3: 0}
    # Each regrouped generation resumed from its emergency version, in storage.
    resumed = [g["checkpoint"] for g in history[1:]]
    saved = sorted({(e["generation"], e["version"]) for e in emergency})
    assert [(c["version"], c["durable"]) for c in resumed] == [(v, True) for _, v in saved]
    versions = httpx.get(f"{coordinator.url}/v1/jobs/preempt/checkpoints", timeout=10).json()
    assert "memory" in {v["durability"] for v in versions}  # routine ones stayed in memory


def test_in_place_survivors_keep_their_processes_through_a_kill_and_a_join(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    cluster = Cluster(
        coordinator.url,
        "inplace",
        tmp_path,
        nnodes="2:3",
        steps=150,
        in_place=True,
        persist_every=100,  # memory only, but the first version
        image_size=IMAGE_SIZE,
        memory=tmp_path / "shm",
    )
    rank0, verdict, history = kill_rank_0_then_add_a_node(cluster, coordinator)
    reasons = [(g["world_size"], g.get("ended_reason")) for g in history]
    assert [g["world_size"] for g in history] == [3, 2, 3], reasons
    assert history[0]["ended_reason"] == f"node {rank0} dropped its heartbeat connection"
    # The survivors' workers told the coordinator that their collectives failed (what
    # lets a cut count without the reconnect window: generations() sends it).
    metrics = httpx.get(f"{coordinator.url}/metrics", timeout=10).text
    assert 'rallypoint_collective_faults_total{job="inplace"}' in metrics, metrics[-2000:]
    resumed = [e for e in cluster.events() if e["event"] == "resumed"]
    first = {e["pid"] for e in resumed if e["generation"] == 1}
    by_generation = {g: [e for e in resumed if e["generation"] == g] for g in (1, 2, 3)}
    # The two survivors went into generations 2 and 3 as the processes they were; only
    # the late node's worker started anew.
    assert len(by_generation[2]) == 2 and all(e["in_place"] for e in by_generation[2])
    assert {e["pid"] for e in by_generation[2]} <= first
    assert sorted(e["in_place"] for e in by_generation[3]) == [False, True, True]
    assert {e["pid"] for e in by_generation[3] if e["in_place"]} <= first
    # In place, a restore reads nothing from storage: this node's memory, then a peer's.
    assert all(e["bytes_from"]["storage"] == 0 for e in resumed if e["in_place"]), resumed
    assert all(lost < 20 for lost in verdict.steps_lost.values()), verdict.steps_lost


def test_a_resume_is_bit_identical_to_an_uninterrupted_run(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """The README's loop, as the example runs it, with dropout: a job of 2 nodes whose
    rank-1 node is SIGKILLed mid-run and replaced ends with the model and the optimizer
    bit-identical to the same job run without a failure. Each rank restores its RNG from
    ``rank_state``, and the DataLoader's generator is its own (without it, the iterator
    made after the restore draws from the restored RNG, and every dropout mask after it
    differs)."""

    def run(job: str, kill: bool) -> tuple[list[dict[str, Any]], list[Any]]:
        cluster = Cluster(
            coordinator.url, job, tmp_path, nnodes="2:2", steps=60, image_size=IMAGE_SIZE
        )
        cluster.script += ["--dropout", "0.25", "--seed", "3"]
        lost = None
        try:
            cluster.start("a", "b")
            if kill:
                step_at(cluster, 25, world_size=2)
                lost = node_of_rank(coordinator, job, 1)
                cluster.kill(lost)
                cluster.add("c")  # the replacement: the same world size
            codes = cluster.wait(timeout=200)
        finally:
            cluster.stop()
        assert all(code == 0 for node, code in codes.items() if node != lost), codes
        return cluster.events(), status(coordinator, job)["history"]

    plain, plain_history = run("plain", kill=False)
    killed, killed_history = run("killed", kill=True)
    assert len(plain_history) == 1 and len(killed_history) == 2, killed_history
    resumed = [e for e in killed if e["event"] == "resumed" and e["generation"] == 2]
    assert len(resumed) == 2 and all(e["version"] is not None for e in resumed), resumed
    assert 10 <= resumed[0]["step"] <= 30  # mid-run, some steps re-done
    finished = {e["digest"] for e in plain if e["event"] == "finished"}
    assert len(finished) == 1  # replicated: every rank the same
    assert {e["digest"] for e in killed if e["event"] == "finished"} == finished

    def losses(events: list[dict[str, Any]]) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in events if e["event"] == "step"}  # the last

    assert losses(killed) == losses(plain)
