"""A node SIGKILLed at every point of a save (issue 25): the job trains again within one
generation, restores the bytes saved at the step it resumes from, and resumes from the
newest version that every rank of the survivors can read.

The FSDP2 example under real torchrun agents: node sizes 2, 1 and 1 (4 processes, so one
node holds two ranks), checkpoints every 5 steps, only the first in blob storage (the
rest in the nodes' memory tiers and their ring successors'), except where the point is
the upload. At step 10's save, the process named by ``RALLYPOINT_TEST_HALT`` halts at the
point (``trainer/checkpoint/_faults.py``) and the test SIGKILLs a whole node: the one holding rank
0, or the one holding the last rank.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from rallypoint.cli.processes import Cluster, Coordinator, example_script, judge
from rallypoint.trainer.checkpoint._faults import HALT_ENV, HALT_FILE_ENV, POINTS

from ..._support import status

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

STEPS, EVERY, HALT_STEP = 20, 5, 10
#: Points a rank passes only after the version committed: it must be restored.
AFTER_COMMIT = {"committed", "returned"}


def wait_for_file(path: Path, cluster: Cluster, timeout: float = 150) -> dict[str, object]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.is_file() and path.read_text().endswith("}"):
            found: dict[str, object] = json.loads(path.read_text())
            return found
        if all(a.proc.poll() is not None for a in cluster.agents.values()):
            break
        time.sleep(0.05)
    raise TimeoutError(f"no process halted within {timeout} s; logs in {cluster.workdir}")


@pytest.mark.parametrize("victim", ["rank-0", "last-rank"])
@pytest.mark.parametrize("point", POINTS)
def test_a_node_killed_at_any_point_of_a_save_costs_one_generation(
    coordinator: Coordinator, tmp_path: Path, point: str, victim: str
) -> None:
    job = f"kill-{point}-{victim}"
    halt = tmp_path / "halt.json"
    world = 4
    # The process that halts: on the victim's node, except at "committed", which only
    # rank 0 passes (the last rank's node then dies while rank 0 holds there).
    trigger = 0 if victim == "rank-0" or point == "committed" else world - 1
    events = tmp_path / "events.jsonl"
    script = [
        str(example_script().with_name("train_fsdp.py")),
        *("--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--step-time", "0.05"),
        *("--persist-every", "1" if point == "uploaded" else "1000"),
        *("--digests", "--dim", "32", "--events", str(events)),
    ]
    cluster = Cluster(
        coordinator.url, job, tmp_path, nnodes="2:3", last_call=4, script=script,
        memory=tmp_path / "memory",
    )  # fmt: skip
    cluster.events_file = events
    env = {HALT_ENV: f"{point}:{HALT_STEP}:{trigger}", HALT_FILE_ENV: str(halt)}
    try:
        cluster.start(("a", {"nproc": 2}), "b", "c", env=env)
        halted = wait_for_file(halt, cluster)
        members = status(coordinator, job)["members"]
        assert len(members) == 3, members  # 4 processes: the halt named rank 3 of 4
        ranked = sorted(members, key=lambda m: m["rank"])
        dead = ranked[0 if victim == "rank-0" else -1]["node_id"]
        cluster.kill(dead)
        codes = cluster.wait(timeout=150)
    finally:
        cluster.stop()
    assert {n: c for n, c in codes.items() if n != dead} == {n: 0 for n in "abc" if n != dead}, (
        codes
    )
    log = cluster.events()
    history = status(coordinator, job)["history"]
    verdict = judge(log, history)
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == STEPS
    # The first generation to reach the halting step: later ones reach it again.
    killed_in = min(e["generation"] for e in log if e["event"] == "step" and e["step"] == HALT_STEP)
    assert halted["step"] == HALT_STEP and halted["point"] == point
    # Trains again within one generation: the next one resumes and finishes.
    after = [e for e in log if e["event"] == "resumed" and e["generation"] > killed_in]
    assert {e["generation"] for e in after} == {killed_in + 1}, history
    finished = {e["generation"] for e in log if e["event"] == "finished"}
    assert finished == {killed_in + 1}
    # The newest version the rule allows: the newest that committed in the generation
    # of the kill (every committed version is readable by the survivors).
    versions = httpx.get(f"{coordinator.url}/v1/jobs/{job}/checkpoints", timeout=10).json()
    committed = [v for v in versions if v["state"] == "committed" and v["generation"] <= killed_in]
    newest = max(committed, key=lambda v: v["step"])
    assert {e["version"] for e in after} == {newest["version"]}
    assert not any(v.get("unrecoverable") or v["quarantined"] for v in versions)
    if point in AFTER_COMMIT or (point == "reported" and trigger == 0):
        assert newest["step"] == HALT_STEP
    elif point != "reported":
        assert newest["step"] == HALT_STEP - EVERY
    # The bytes: every tensor, gathered, equals what was saved at that step.
    saved = {e["step"]: e["digests"] for e in log if e["event"] == "saving" and e["rank"] == 0}
    for e in after:
        assert e["step"] == newest["step"] + 1
        assert e["digests"] == saved[newest["step"]], f"rank {e['rank']}"
