"""Sharded checkpoints under real torchrun agents (CPU, gloo, ``--nproc-per-node=2``):
the FSDP2 example through the SIGKILL of a node, and each process's own rank_state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rallypoint.cli.processes import Cluster, Coordinator, example_script, judge

from ..._support import status

#: The torchrun tests' coordinator (local storage, logged), as a fixture here too.

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_fsdp2_resumes_resharded_after_a_node_is_killed(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """2 agents x 2 processes train an FSDP2 transformer with Adam; one agent and its
    workers are SIGKILLed; the 2 survivors restore the 4-way shards into 2-way ones,
    and every parameter and optimizer tensor equals what was saved."""
    events = tmp_path / "fsdp.events.jsonl"
    script = example_script().with_name("train_fsdp.py")
    args = ["--steps", "40", "--checkpoint-every", "5", "--step-time", "0.05", "--digests"]
    cluster = Cluster(
        coordinator.url,
        "fsdp",
        tmp_path,
        nnodes="1:2",
        nproc=2,
        script=[str(script), *args, "--events", str(events)],
    )
    cluster.events_file = events
    try:
        cluster.start("a", "b")
        cluster.wait_for(
            lambda e: e["event"] == "step" and e["step"] >= 12 and e["world_size"] == 4
        )
        cluster.kill("b")
        codes = cluster.wait(timeout=200)
    finally:
        cluster.stop()
    assert codes["a"] == 0
    log = cluster.events()
    history = status(coordinator, "fsdp")["history"]
    assert [g["world_size"] for g in history][:2] == [2, 1]  # nodes, not processes
    verdict = judge(log, history)
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == 40
    saved = {
        e["step"]: e["digests"] for e in log if e["event"] == "saving" and e["world_size"] == 4
    }
    resumed = [e for e in log if e["event"] == "resumed" and e["world_size"] == 2]
    assert {e["rank"] for e in resumed} == {0, 1}
    for e in resumed:
        assert e["saved_by"] == 4
        digests = saved[e["step"] - 1]
        assert any(k.startswith("optim.state.") for k in digests)  # Adam's moments too
        assert e["digests"] == digests


WORKER = r"""
import json, os, torch, torch.distributed as dist
from rallypoint.client import ElasticClient
from rallypoint.trainer import CheckpointManager
client = ElasticClient.from_env(); client.join()
dist.init_process_group("gloo")
g = dist.get_rank()
m = CheckpointManager(client, progress=False, verify_replicated=True)
if os.environ["PHASE"] == "save":
    own = {"g": torch.tensor(g), "local": os.environ["LOCAL_RANK"]}
    m.save({"w": torch.arange(8.0)}, 3, rank_state=own, blocking=True)
    out = {"saved": g}
else:
    r = m.load_latest()
    out = {"rank": g, "step": r.step, "w": r.state["w"].tolist(),
           "g": int(r.rank_state["g"]), "local": r.rank_state["local"], "bytes": r.bytes_from}
m.close(); dist.barrier(); dist.destroy_process_group()
with open(os.environ["OUT"], "a") as f: f.write(json.dumps(out) + "\n")
"""


def test_each_process_of_a_node_restores_its_own_rank_state(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out.jsonl"
    for phase in ("save", "load"):
        env = dict(os.environ, OUT=str(out), PHASE=phase, OMP_NUM_THREADS="1")
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2"),
            *("--rdzv-backend=rallypoint", f"--rdzv-endpoint={coordinator.url}"),
            *("--rdzv-id=nproc", "--max-restarts=0", str(script)),
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    loaded = sorted((r for r in rows if "step" in r), key=lambda r: r["rank"])
    assert [(r["rank"], r["g"], r["local"]) for r in loaded] == [(0, 0, "0"), (1, 1, "1")]
    assert all(r["step"] == 3 and r["w"] == list(map(float, range(8))) for r in loaded)
    versions = httpx.get(f"{coordinator.url}/v1/jobs/nproc/checkpoints", timeout=10).json()
    assert [(v["world_size"], v["reported"]) for v in versions] == [(2, 2)]
