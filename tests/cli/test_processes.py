"""The test harness's own rules (``rallypoint.cli.processes``): with no process started,
the one that starts a coordinator where a checkout's folder could hide the package, what
a cluster that never ends says of where it waits, and that a node's SIGKILL leaves no
semaphore behind."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from rallypoint.cli.processes import (
    START_GATE_ENV,
    Cluster,
    Coordinator,
    Event,
    descendants,
    judge,
    leftover_semaphores,
)


def line(step: int) -> str:
    return json.dumps({"event": "step", "step": step}) + "\n"


def steps(cluster: Cluster) -> list[int]:
    return [e["step"] for e in cluster.events()]


def resumed(generation: int, rank: int, world: int, version: str | None = "v1") -> Event:
    return {
        "event": "resumed",
        "generation": generation,
        "rank": rank,
        "world_size": world,
        "version": version,
        "step": 6,
    }


def step(generation: int, number: int) -> Event:
    return {"event": "step", "generation": generation, "step": number, "loss": 0.5}


HISTORY = [{"generation": g, "checkpoint": {"version": "v1"}} for g in (1, 2)]


def test_judge_wants_every_rank_resumed_in_a_generation_that_trained() -> None:
    whole = [resumed(1, 0, 2), resumed(1, 1, 2), step(1, 6)]
    assert judge(whole, HISTORY).consistent
    verdict = judge([resumed(1, 0, 2), step(1, 6)], HISTORY)
    assert verdict.problems == ["generation 1: ranks [0] resumed"]


def test_judge_takes_fewer_ranks_where_a_change_ended_the_generation_before_a_step() -> None:
    # Generation 1 ended (a node joined) while rank 1 still loaded; 2 trained whole.
    log = [resumed(1, 0, 2), *(resumed(2, r, 3) for r in range(3)), step(2, 6)]
    assert judge(log, HISTORY).consistent


@pytest.mark.parametrize(
    "ranks", [[0, 0], [0, 2], [0, 1, 2]], ids=["twice", "beyond-the-world", "too-many"]
)
def test_judge_refuses_ranks_that_cannot_be_even_where_no_step_trained(ranks: list[int]) -> None:
    log = [resumed(1, r, 2) for r in ranks]
    assert judge(log, HISTORY).problems == [f"generation 1: ranks {ranks} resumed"]


def test_judge_wants_the_version_the_coordinator_named_from_each_rank_that_resumed() -> None:
    log = [resumed(1, 0, 2), resumed(1, 1, 2, "v0"), step(1, 6)]
    assert judge(log, HISTORY).problems == [
        "generation 1: ranks loaded versions ['v0', 'v1']",
        "generation 1: loaded ['v0', 'v1'], the coordinator named v1",
    ]


def test_events_are_read_on_from_the_last_call_a_whole_line_at_a_time(tmp_path: Path) -> None:
    cluster = Cluster("http://127.0.0.1:1", "job", tmp_path)
    assert cluster.events() == []  # no file yet
    with open(cluster.events_file, "a") as f:
        f.write(line(1) + line(2))
    assert steps(cluster) == [1, 2]
    with open(cluster.events_file, "a") as f:
        f.write(line(3)[:10])  # a line being written
    assert steps(cluster) == [1, 2]
    with open(cluster.events_file, "a") as f:
        f.write(line(3)[10:] + line(4))
    assert steps(cluster) == [1, 2, 3, 4]
    assert steps(cluster) == [1, 2, 3, 4]  # nothing new: nothing twice


def test_events_follow_the_file_they_are_pointed_at_and_a_file_put_in_its_place(
    tmp_path: Path,
) -> None:
    cluster = Cluster("http://127.0.0.1:1", "job", tmp_path)
    cluster.events_file.write_text(line(1) + line(2) + line(3))
    assert steps(cluster) == [1, 2, 3]
    other = tmp_path / "other.jsonl"
    other.write_text(line(7))
    cluster.events_file = other  # as tests with their own script do
    assert steps(cluster) == [7]
    replaced = tmp_path / "replaced.jsonl"
    replaced.write_text(line(8) + line(9))
    replaced.replace(other)  # a new file of the same name
    assert steps(cluster) == [8, 9]
    other.write_text(line(5))  # emptied and written again, shorter than what was read
    assert steps(cluster) == [5]


@pytest.mark.e2e
def test_a_coordinator_started_beside_a_rallypoint_folder_runs_the_installed_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As in a checkout whose package is installed from a wheel: the folder in the working
    # directory must not be what `python -m rallypoint` imports.
    decoy = tmp_path / "rallypoint"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the working directory was imported')\n")
    (decoy / "__main__.py").write_text("raise SystemExit('the working directory was run')\n")
    monkeypatch.chdir(tmp_path)
    coordinator = Coordinator(["--storage", f"local:{tmp_path / 'storage'}"]).start()
    try:
        assert httpx.get(f"{coordinator.url}/healthz", timeout=5).status_code == 200
    finally:
        coordinator.stop()


#: A worker that says it is there, then waits where a hung job's worker would.
HANGS = """
import json, sys, time

def stuck_after_training():
    time.sleep(600)

with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"event": "stuck"}) + "\\n")
stuck_after_training()
"""


@pytest.mark.e2e
def test_a_cluster_that_does_not_end_says_where_each_of_its_processes_waits(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    events = tmp_path / "hangs.events.jsonl"
    cluster = Cluster(
        coordinator.url, "hangs", tmp_path, nnodes="1", script=[str(script), str(events)]
    )
    cluster.events_file = events
    try:
        cluster.add("a")
        cluster.wait_for(lambda e: e["event"] == "stuck", timeout=120)
        with pytest.raises(TimeoutError, match="a still runs after 1 s") as raised:
            cluster.wait(timeout=1)
    finally:
        cluster.stop()
    said = str(raised.value)
    # The worker's stack, and its agent's (torchrun's monitor loop).
    assert "stuck_after_training (hangs.py:5)" in said, said
    assert "_invoke_run" in said, said


def semaphores_of(pids: list[int]) -> list[Path]:
    """The named semaphores in /dev/shm that ``pids`` have open: each maps its file (the
    creator under the name it had before it was linked, so matched by inode)."""
    inodes = set()
    for pid in pids:
        for entry in Path(f"/proc/{pid}/maps").read_text().splitlines():
            fields = entry.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/sem."):
                inodes.add(int(fields[4]))
    return [p for p in Path("/dev/shm").glob("sem.*") if p.stat().st_ino in inodes]


@pytest.mark.e2e
def test_a_nodes_sigkill_leaves_none_of_its_semaphores_behind(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """torchrun's agent makes multiprocessing semaphores for its workers (``sem.mp-*``),
    which a SIGKILL of the agent leaves in /dev/shm unless its resource tracker, which
    unlinks them once the processes it serves are gone, outlives them: the kill spares it
    that long."""
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    events = tmp_path / "hangs.events.jsonl"
    cluster = Cluster(
        coordinator.url, "sems", tmp_path, nnodes="1", script=[str(script), str(events)]
    )
    cluster.events_file = events
    try:
        agent = cluster.add("a").proc.pid
        cluster.wait_for(lambda e: e["event"] == "stuck", timeout=120)
        held = semaphores_of([agent, *descendants(agent)])
        assert held, "the node's processes hold no semaphore: the test checks nothing"
        cluster.kill("a")
        assert [p for p in held if p.exists()] == []
        assert leftover_semaphores() == []
    finally:
        cluster.stop()


def test_the_harness_names_the_agents_start_gate_as_the_agent_reads_it() -> None:
    from rallypoint.trainer import agent

    assert START_GATE_ENV == agent.START_GATE_ENV
