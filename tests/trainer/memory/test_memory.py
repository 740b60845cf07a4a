"""The memory tier: this node's copies of its ranks' checkpoint files in shared memory,
read before storage, checked like storage, owned by the agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rallypoint.cli.processes import Coordinator
from rallypoint.trainer import RallypointReader
from rallypoint.trainer.memory import MEMORY_ENV, NodeMemory

from ..._support import managers
from ...conftest import Start

#: The torchrun tests' coordinator (local storage, logged), as a fixture here too.


@pytest.fixture
def memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """What an agent tells its workers: where this machine's memory tier is."""
    root = tmp_path / "shm"
    monkeypatch.setenv(MEMORY_ENV, str(root))
    return root


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_restart_reads_this_nodes_memory_and_a_bad_copy_falls_back(
    start: Start, memory: Path
) -> None:
    url = start().url
    (m,) = managers(url, ["a"], 1, 1)
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "n": 3}
    m.save(state, 1, rank_state={"seed": 7}, metadata={"loss": 0.5}, blocking=True)
    m.close()
    held = sorted(p.name for p in (memory / "job" / "a" / "v0000000001").rglob("*"))
    # Rank 0's files (DCP's metadata among them, for peers) and this node's own copy of
    # the metadata, with the version's index.
    assert held == ["data.distcp", "dcp.metadata", "dcp.metadata", "rank-00000", "version.json"]
    (m,) = managers(url, ["a"], 1, 1)  # the restarted process, same node
    restored = m.load_latest()
    assert restored is not None and restored.bytes_from["storage"] == 0
    assert restored.bytes_from["memory"] > (1 << 18)
    assert torch.equal(restored.state["w"], state["w"]) and restored.state["n"] == 3
    assert (restored.rank_state, restored.metadata, restored.step) == (
        {"seed": 7},
        {"loss": 0.5},
        1,
    )
    # A flipped byte in the memory copy: the item fails its checksum there, and the
    # file comes from storage instead.
    data = memory / "job" / "a" / "v0000000001" / "rank-00000" / "data.distcp"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(raw)
    again = m.load_latest()
    assert again is not None and again.bytes_from["storage"] >= (1 << 18)
    assert torch.equal(again.state["w"], state["w"])


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_report_names_this_node_only_once_its_copy_is_readable(
    start: Start, memory: Path
) -> None:
    """The rule that makes a named version readable: when a rank's report (rank 0's
    commits) reaches the coordinator, the node it names already holds an indexed copy
    that a restarted process reads without this one, so a node dying the moment the
    version commits loses nothing the report promised."""
    (m,) = managers(start().url, ["a"], 1, 1)
    report = m.client.report_checkpoint
    seen: list[tuple[list[str], list[str]]] = []

    def spy(version: int, *args: Any, **kwargs: Any) -> Any:
        folder = memory / "job" / "a" / f"v{version:010d}"
        seen.append((kwargs["memory"], sorted(p.name for p in folder.iterdir())))
        # What a restarted process of this node would read, as of now.
        reader = RallypointReader(m.client, version, memory=NodeMemory.from_env("job", "a"))
        reader.version = version
        assert reader._from_memory() is not None
        return report(version, *args, **kwargs)

    m.client.report_checkpoint = spy  # type: ignore[method-assign]
    m.save({"w": torch.arange(64.0)}, 1, blocking=True)
    m.close()
    assert seen == [(["a"], ["dcp.metadata", "rank-00000", "version.json"])]


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_restore_from_memory_needs_no_coordinator(start: Start, memory: Path) -> None:
    """The coordinator is down when a worker restarts: the version its assignment names
    is in the node's memory, so the restore goes on; only its metrics report is lost."""
    coordinator = start()
    (m,) = managers(coordinator.url, ["a"], 1, 1)
    m.save({"w": torch.arange(4096.0)}, 1, blocking=True)
    m.close()
    (m,) = managers(coordinator.url, ["a"], 1, 1)
    coordinator.stop()
    restored = m.load_latest()
    assert restored is not None and restored.bytes_from["storage"] == 0
    assert torch.equal(restored.state["w"], torch.arange(4096.0))


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_node_keeps_its_newest_versions_only(start: Start, memory: Path) -> None:
    (m,) = managers(start().url, ["a"], 1, 1)
    for step in range(1, 6):
        m.save({"w": torch.full((1024,), float(step))}, step, blocking=True)
    assert sorted(p.name for p in (memory / "job" / "a").glob("v*")) == [
        "v0000000004",
        "v0000000005",
    ]


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_memory_tier_that_cannot_take_a_copy_never_fails_a_save(
    start: Start, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As when a container's 64 MiB /dev/shm is full: the save goes on to storage."""
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv(MEMORY_ENV, str(blocked / "shm"))
    (m,) = managers(start().url, ["a"], 1, 1)
    handle = m.save({"w": torch.ones(1024)}, 1, blocking=True)
    assert handle is not None and handle.result().state == "committed"
    assert "no copy in this node's memory" in caplog.text
    restored = m.load(handle.result().version)
    assert restored.bytes_from["memory"] == 0 and torch.equal(restored.state["w"], torch.ones(1024))


@pytest.mark.e2e
def test_an_agent_reclaims_what_dead_agents_left(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = NodeMemory(tmp_path, "old-job", "n1")
    stale.folder.mkdir(parents=True)
    (stale.folder / "owner").write_text(dead.stdout.strip())  # that process is gone
    alive = NodeMemory(tmp_path, "other-job", "n2")
    alive.claim()  # this process: alive
    NodeMemory(tmp_path, "job", "n3").claim()
    assert not stale.folder.exists()
    assert alive.folder.exists()


WORKER = r"""
import json, os, torch, torch.distributed as dist
from rallypoint.client import ElasticClient
from rallypoint.trainer import CheckpointManager
client = ElasticClient.from_env(); client.join()
dist.init_process_group("gloo")
g = dist.get_rank()
m = CheckpointManager(client, progress=False)
if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) == 0:
    m.save({"w": torch.arange(1 << 16, dtype=torch.float32)}, 5, rank_state={"g": g}, blocking=True)
    dist.barrier()
    if g == 1:
        os.kill(os.getpid(), 9)  # SIGKILL, after the save
    import time; time.sleep(60)
r = m.load_latest()
out = {"rank": g, "step": r.step, "g": r.rank_state["g"], "from": r.bytes_from,
       "memory": os.environ["RALLYPOINT_MEMORY_DIR"]}
m.close(); dist.barrier(); dist.destroy_process_group()
with open(os.environ["OUT"], "a") as f: f.write(json.dumps(out) + "\n")
"""


@pytest.mark.e2e
def test_workers_restarted_by_torchrun_read_nothing_from_storage(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """A worker SIGKILLed after a save: torchrun restarts both, which restore from the
    node's memory; the memory is gone once the agent exits."""
    script, out = tmp_path / "worker.py", tmp_path / "out.jsonl"
    script.write_text(WORKER)
    root = tmp_path / "shm"
    env = dict(os.environ, OUT=str(out), OMP_NUM_THREADS="1", RALLYPOINT_MEMORY_DIR=str(root))
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2"),
        *("--rdzv-backend=rallypoint", f"--rdzv-endpoint={coordinator.url}", "--rdzv-id=mem"),
        *("--max-restarts=1", "--monitor-interval=0.2", str(script)),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = sorted(
        (json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"]
    )
    assert [(r["rank"], r["step"], r["g"]) for r in rows] == [(0, 5, 0), (1, 5, 1)]
    assert all(r["from"]["storage"] == 0 and r["from"]["memory"] > (1 << 18) for r in rows)
    assert {r["memory"] for r in rows} == {str(root)}
    assert list(root.glob("*/*")) == []  # the agent removed its node's copies


def test_without_an_agent_there_is_no_memory_tier(
    start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(MEMORY_ENV, raising=False)
    (m,) = managers(start().url, ["a"], 1, 1)
    assert m.memory is None
    handle = m.save({"w": torch.zeros(4)}, 1, blocking=True)
    assert handle is not None
    restored = m.load(handle.result().version)
    assert restored.bytes_from["memory"] == 0 and restored.bytes_from["storage"] > 0
