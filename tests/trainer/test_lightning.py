"""Lightning on Rallypoint: real Lightning under real torchrun agents (CPU, gloo) with
``--rdzv-backend=rallypoint``, the example ``train_lightning.py`` (a small CNN on
synthetic CIFAR-shaped data), and failures.

Each run checks that every rank resumed from the version the coordinator named, that the
state it resumed with hashes like the state saved at that step, and that a folder with
a newer-looking ``last.ckpt`` changed nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rallypoint.cli.fake_imds import FakeImds
from rallypoint.cli.processes import Cluster, Coordinator, example_script, judge

from .._support import status

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

STEPS = 30


def test_importing_the_trainer_package_imports_no_framework() -> None:
    code = 'import sys, rallypoint.trainer; assert "lightning" not in sys.modules'
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def stale_folder(path: Path) -> Path:
    """A checkpoint folder as a stale mount shows it: files newer than anything the job
    saved, at a step far ahead. Lightning's ``ckpt_path="last"`` would pick them."""
    path.mkdir(parents=True)
    bogus = {
        "global_step": 10_000,
        "epoch": 99,
        "state_dict": {},
        "pytorch-lightning_version": "2.6.6",
    }
    for name in ("last.ckpt", "epoch=99-step=10000.ckpt"):
        torch.save(bogus, path / name)
        os.utime(path / name, (2e9, 2e9))  # 2033: newer than any save of this run
    return path


def lightning_cluster(
    coordinator: Coordinator, job: str, tmp_path: Path, strategy: str, *extra: str, **kw: Any
) -> Cluster:
    events = tmp_path / f"{job}.events.jsonl"
    script = [
        str(example_script().with_name("train_lightning.py")),
        *("--strategy", strategy, "--steps", str(STEPS), "--batch-size", "16"),
        *("--samples", "1024", "--checkpoint-every", "4", "--step-time", "0.05"),
        *("--events", str(events), "--digests"),
        *("--checkpoint-dir", str(stale_folder(tmp_path / "stale"))),
        *extra,
    ]
    cluster = Cluster(coordinator.url, job, tmp_path, nnodes="2:3", script=script, **kw)
    cluster.events_file = events
    return cluster


def kill_a_node_mid_run(coordinator: Coordinator, tmp_path: Path, strategy: str) -> None:
    job = f"lit-{strategy}"
    # fit(ckpt_path="last") too: the coordinator's version wins over the folder's files.
    cluster = lightning_cluster(coordinator, job, tmp_path, strategy, "--ckpt-path", "last")
    try:
        cluster.add("a", nproc=2)
        cluster.add("b")
        cluster.add("c")
        cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 10, timeout=120)
        victim = "c"
        cluster.kill(victim)  # the node and its worker, SIGKILL
        codes = cluster.wait(timeout=150)
    finally:
        cluster.stop()
    log = cluster.events()
    history = status(coordinator, job)["history"]
    assert [g["world_size"] for g in history][:2] == [3, 2], history  # nodes
    verdict = judge(log, history)
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == STEPS, codes
    assert all(code == 0 for node, code in codes.items() if node != victim), codes
    # Generation 1 started fresh despite the stale folder and ckpt_path="last".
    first = [e for e in log if e["event"] == "resumed" and e["generation"] == 1]
    assert {(e["version"], e["step"]) for e in first} == {(None, 0)}
    saved = {e["step"]: e["digest"] for e in log if e["event"] == "saving"}
    pointer = history[1]["checkpoint"]
    resumed = [e for e in log if e["event"] == "resumed" and e["generation"] == 2]
    assert sorted(e["rank"] for e in resumed) == [0, 1, 2]  # 3 processes of 4
    for e in resumed:
        assert (e["version"], e["step"], e["saved_by"]) == (pointer["version"], pointer["step"], 4)
        assert e["digest"] == saved[pointer["step"]]  # model and optimizer, gathered
        assert sum(e["bytes_from"].values()) > 0
        assert e["saves_back"]  # a torch.save of the resumed state loads back equal
    assert 4 <= pointer["step"] < STEPS  # resumed mid-run, not from the stale 10,000


def test_lightning_ddp_resumes_from_the_coordinator_after_a_node_is_killed(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    kill_a_node_mid_run(coordinator, tmp_path, "ddp")


def test_lightning_fsdp2_resumes_resharded_after_a_node_is_killed(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    kill_a_node_mid_run(coordinator, tmp_path, "model-parallel")


def test_lightning_cifar_miniature_loses_no_step_to_a_preemption_notice(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    with FakeImds() as imds:
        # Routine versions stay in memory (every 100th to storage): the notice's
        # emergency version must reach storage.
        cluster = lightning_cluster(
            coordinator, "lit-preempt", tmp_path, "ddp", "--persist-every", "100", imds_url=imds.url
        )
        cluster.nnodes = "1:2"
        try:
            cluster.add("a", nproc=2)
            cluster.add("b")
            cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 6, timeout=120)
            event_id = imds.schedule("b")
            cluster.wait_for(lambda e: e["event"] == "resumed" and e["generation"] == 2)
            codes = cluster.wait(timeout=150)
        finally:
            cluster.stop()
    assert imds.acknowledged == [event_id]
    assert codes == {"a": 0, "b": 0}  # the preempted node left cleanly
    log = cluster.events()
    history = status(coordinator, "lit-preempt")["history"]
    assert [g["world_size"] for g in history] == [2, 1]
    assert "preempted (Preempt)" in history[0]["ended_reason"]
    verdict = judge(log, history)
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == STEPS
    assert verdict.steps_lost == {2: 0}
    emergency = {e["version"] for e in log if e["event"] == "emergency"}
    pointer = history[1]["checkpoint"]
    assert emergency == {pointer["version"]} and pointer["durable"]
    saved = {e["step"]: e["digest"] for e in log if e["event"] == "saving"}
    resumed = [e for e in log if e["event"] == "resumed" and e["generation"] == 2]
    assert [e["digest"] for e in resumed] == [saved[pointer["step"]]] * 2
    versions = httpx.get(f"{coordinator.url}/v1/jobs/lit-preempt/checkpoints", timeout=10).json()
    assert "memory" in {v["durability"] for v in versions}  # routine ones stayed in memory
