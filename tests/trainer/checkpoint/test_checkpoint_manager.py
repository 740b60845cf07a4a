"""CheckpointManager end to end: real coordinators, real files, real Azurite.

Each test runs on both storage backends over the default transport: the routes the
manager calls are tested through the envelope too, in tests/service/test_coordinator.py."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from rallypoint.client import ElasticClient, StaleGeneration
from rallypoint.trainer import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointManager,
    ElasticSampler,
    RallypointReader,
    RallypointWriter,
)

from ..._support import clients, join_all, managers, spec
from ...conftest import Spawn, Start


def make_state(seed: int = 0) -> dict[str, Any]:
    """A small but realistic state: model, Adam (int-keyed state), scheduler, sampler,
    tensors of several dtypes, and plain values JSON cannot tell apart."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    scheduler.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "sampler": ElasticSampler(100, rank=0, world_size=1).state_dict(),
        "half": torch.randn(7, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(5, dtype=torch.int64).reshape(1, 5),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "shape": (2, 3),
        "losses": [1.5, float("inf"), float("nan")],
        "name": "run-1",
        "none": None,
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, dict):  # an OrderedDict (a state_dict) comes back as a dict
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def test_save_and_load_round_trip(start: Start) -> None:
    url = start().url
    (m,) = managers(url, ["a"], 1, 1)
    state = make_state()
    rng = torch.get_rng_state()
    handle = m.save(state, 10, rank_state={"rng": rng}, metadata={"loss": 0.25}, blocking=True)
    assert handle is not None and handle.result().state == "committed"
    assert handle.result().latest
    # A new generation resumes from it.
    (m2,) = managers(url, ["a"], 1, 1)
    assert m2.assignment.checkpoint is not None and m2.assignment.checkpoint.step == 10
    restored = m2.load_latest()
    assert restored is not None
    assert (restored.step, restored.world_size, restored.metadata) == (10, 1, {"loss": 0.25})
    assert same(restored.state, state)
    assert same(restored.rank_state, {"rng": rng})
    # The restored tensors are the user's to change, and changing them changes no file.
    restored.state["model"]["0.weight"].add_(1)
    again = m2.load_latest()
    assert again is not None and same(again.state, state)


def test_a_fresh_job_has_nothing_to_load(start: Start) -> None:
    (m,) = managers(start().url, ["a"], 1, 1)
    assert m.load_latest() is None


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_versions_are_dcp_checkpoints(start: Start, tmp_path: Path) -> None:
    """Plain DCP with Rallypoint's writer and reader gives the versions the manager
    gives, and each reads the other's."""
    url = start().url
    (m,) = managers(url, ["a"], 1, 1)
    state = {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.float16), "n": 3}
    writer = RallypointWriter(m.client, 1, metadata={"by": "dcp"})
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert writer.info is not None and (writer.info.state, writer.info.latest) == (
        "committed",
        True,
    )
    root = tmp_path / "storage"
    files = sorted(p.relative_to(root) for p in root.glob("**/v*/**/*.*"))
    assert [(p.parent.name, p.name) for p in files] == [
        ("v0000000001", "manifest.json"),
        ("rank-00000", "data.distcp"),
        ("rank-00000", "dcp.metadata"),
    ]
    restored = m.load(1)
    assert same(restored.state, state) and restored.metadata == {"by": "dcp"}
    assert restored.rank_state is None  # plain DCP saves none
    m.save({**state, "n": 4}, 2, rank_state={"seed": 7}, blocking=True)
    (resumed,) = managers(url, ["a"], 1, 1)  # its generation resumes from version 2
    target = {"w": torch.empty(3, 4), "b": torch.empty(2, dtype=torch.float16), "n": 0}
    dcp.load(target, storage_reader=RallypointReader(resumed.client), no_dist=True)
    assert same(target, {**state, "n": 4})


def test_what_cannot_be_saved_is_refused_before_any_upload(start: Start) -> None:
    (m,) = managers(start().url, ["a"], 1, 1)
    with pytest.raises(TypeError, match=r"state\['opt'\]\['fn'\]: cannot checkpoint a function"):
        m.save({"opt": {"fn": lambda: 0}}, 1)
    with pytest.raises(TypeError, match="dict keys must be str or int"):
        m.save({"w": {(1, 2): torch.zeros(1)}}, 1)
    with pytest.raises(TypeError, match="only dense"):
        m.save({"w": torch.zeros(3, 3).to_sparse()}, 1)
    with pytest.raises(TypeError, match="__rallypoint__"):
        m.save({"__rallypoint__": 1}, 1)
    with pytest.raises(ValueError, match=r"metadata is \d+ bytes as JSON; at most 524288"):
        m.save({"w": torch.zeros(1)}, 1, metadata={"x": "y" * (600 << 10)})
    with pytest.raises(TypeError, match="metadata must be JSON"):
        m.save({"w": torch.zeros(1)}, 1, metadata={"x": torch.zeros(1)})
    assert m.client.checkpoints() == []  # nothing was begun, let alone uploaded


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_state_of_thousands_of_tensors_fits(start: Start) -> None:
    """Adam's state for a large model is thousands of tensors: their names and shapes
    travel in DCP's metadata file, not in the 512 KiB report (which refused 2,800)."""
    (m,) = managers(start().url, ["a"], 1, 1)
    state = {"optim": {"state": {i: {"exp_avg": torch.full((2,), float(i))} for i in range(6000)}}}
    m.save(state, 1, blocking=True)
    restored = m.load(1)
    assert len(restored.state["optim"]["state"]) == 6000
    assert torch.equal(restored.state["optim"]["state"][5999]["exp_avg"], torch.full((2,), 5999.0))


def test_several_processes_need_a_process_group(start: Start) -> None:
    ms = managers(start().url, ["a", "b"], 2, 2)
    with pytest.raises(CheckpointError, match="init_process_group"):
        ms[0].save({"w": torch.zeros(1)}, 1)


def test_a_save_holds_the_state_of_its_call(start: Start) -> None:
    """Training goes on while the copy and the upload run: what it changes after save()
    returned (the optimizer's step, behind the fence; a value by hand, after
    wait_staged()) is not in the checkpoint."""
    (m,) = managers(start().url, ["a"], 1, 1)
    weight = torch.nn.Parameter(torch.zeros(1 << 20))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    weight.grad = torch.full_like(weight, -1.0)
    state = {"w": weight, "meta": {"epoch": 1}, "bias": torch.zeros(1 << 20)}
    handle = m.save(state, 1)
    optimizer.step()  # in place, behind the fence
    state["meta"]["epoch"] = 2
    m.wait_staged()
    state["bias"].add_(1)  # by hand: after wait_staged()
    assert handle is not None and handle.result().state == "committed"
    assert handle.staged() and handle.copy_seconds > 0
    restored = m.load(handle.result().version)
    assert torch.equal(restored.state["w"], torch.zeros(1 << 20))
    assert torch.equal(restored.state["bias"], torch.zeros(1 << 20))
    assert restored.state["meta"] == {"epoch": 1}
    assert torch.equal(weight.detach(), torch.ones(1 << 20))


def test_without_overlap_save_returns_with_the_copy_done(start: Start) -> None:
    nodes = clients(start().url, ["a"])
    join_all(nodes, spec(1, 1))
    m = CheckpointManager(nodes[0], progress=False, overlap=False)
    state = {"w": torch.zeros(1 << 20)}
    handle = m.save(state, 1)
    assert handle is not None and handle.staged() and handle.waited == 0.0
    state["w"].add_(1)  # no fence needed
    restored = m.load(handle.result().version)
    assert torch.equal(restored.state["w"], torch.zeros(1 << 20))
    m.close()


def test_consecutive_saves_never_mix(start: Start, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save while the previous one uploads waits for it: the staging buffers that
    upload reads are not overwritten under it."""
    url = start().url
    (m,) = managers(url, ["a"], 1, 1)
    first = {"w": torch.full((256, 256), 1.0)}
    second = {"w": torch.full((256, 256), 2.0)}
    # The first save's upload is held until the second save waits for it (the manager
    # waits for a save through wait()), so the second starts with the first in flight.
    uploading, release = threading.Event(), threading.Event()
    write_data = RallypointWriter.write_data

    def held(writer: RallypointWriter, *args: Any) -> Any:
        if writer.step == 1:
            uploading.set()
            assert release.wait(60), "the second save never waited for the first"
        return write_data(writer, *args)

    waits: list[bool] = []  # whether the first was still in flight at each wait
    wait = m.wait

    def waiting() -> Any:
        waits.append(one is not None and not one.done())
        release.set()
        return wait()

    monkeypatch.setattr(RallypointWriter, "write_data", held)
    monkeypatch.setattr(m, "wait", waiting)
    one = m.save(first, 1)
    assert uploading.wait(60)
    try:
        two = m.save(second, 2)
    finally:
        release.set()
    assert waits == [True] and one is not None and one.done()
    assert two is not None
    assert one.result().version != two.result().version
    for version, expected in ((one.result().version, first), (two.result().version, second)):
        assert same(m.load(version).state, expected)


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_corrupt_or_missing_shard_fails_loudly(start: Start, tmp_path: Path) -> None:
    url = start().url
    (m,) = managers(url, ["a"], 1, 1)
    m.save({"w": torch.randn(1000)}, 1, blocking=True)
    (shard,) = tmp_path.glob("storage/**/data.distcp")
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(data)
    (m2,) = managers(url, ["a"], 1, 1)
    with pytest.raises(CheckpointCorrupt, match="checksum"):
        m2.load_latest()
    shard.unlink()
    with pytest.raises(CheckpointCorrupt, match="missing"):
        m2.load_latest()


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_the_named_version_wins_over_newer_looking_files(start: Start, tmp_path: Path) -> None:
    url = start().url
    (m,) = managers(url, ["a"], 1, 1)
    m.save({"w": torch.zeros(4)}, 1, blocking=True)
    m.save({"w": torch.ones(4)}, 2, blocking=True)
    # A cache that trusts modification times would pick version 1 now.
    future = time.time() + 3600
    for path in tmp_path.glob("storage/**/v0000000001/**/*"):
        os.utime(path, (future, future))
    (m2,) = managers(url, ["a"], 1, 1)
    restored = m2.load_latest()
    assert restored is not None and restored.step == 2
    assert torch.equal(restored.state["w"], torch.ones(4))


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_restored_tensors_outlive_their_version(start: Start, tmp_path: Path) -> None:
    """Retention collects the loaded version and later saves reuse collected files
    (local storage), yet what load() mapped never changes."""
    url = start().url
    (m,) = managers(url, ["a"], 1, 1)
    m.save({"w": torch.full((1024, 1024), 1.0)}, 1, blocking=True)
    (m2,) = managers(url, ["a"], 1, 1)
    restored = m2.load_latest()
    assert restored is not None
    inodes = {}
    for step in range(2, 8):  # version = step; keep=3: v1 goes at step 4, v2 at 5, ...
        m2.save({"w": torch.full((1024, 1024), float(step))}, step, blocking=True)
        (shard,) = tmp_path.glob(f"storage/**/v{step:010d}/**/data.distcp")
        inodes[step] = shard.stat().st_ino
    assert not list(tmp_path.glob("storage/**/v0000000001"))
    assert torch.equal(restored.state["w"], torch.full((1024, 1024), 1.0))
    # Step 6 got the file of version 2 (collected at step 5), step 7 that of version 3.
    assert (inodes[6], inodes[7]) == (inodes[2], inodes[3])
    for step in (5, 6, 7):
        assert torch.equal(m2.load(step).state["w"], torch.full((1024, 1024), float(step)))


def test_a_zombie_manager_cannot_save(start: Start) -> None:
    url = start().url
    (old,) = managers(url, ["a"], 1, 1)
    (new,) = managers(url, ["a"], 1, 1)  # the node restarted: generation 1 ended
    handle = old.save({"w": torch.zeros(2)}, 5)
    assert handle is not None
    with pytest.raises(StaleGeneration):
        handle.result()
    assert new.client.checkpoints() == []


SAVER = """
import sys, torch
from datetime import timedelta
from rallypoint.client import ElasticClient
from rallypoint.trainer import CheckpointManager
client = ElasticClient(sys.argv[1], "job", "a")
client.join("127.0.0.1", 29500, spec=None, timeout=timedelta(seconds=60))
m = CheckpointManager(client, progress=False)
m.save({"w": torch.ones(8)}, 1, blocking=True)
print("committed", flush=True)
m.save({"w": torch.zeros(64 << 20)}, 2, blocking=True)
print("finished", flush=True)
"""


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_rank_killed_mid_upload_never_becomes_latest(spawn: Spawn, tmp_path: Path) -> None:
    url = spawn().url
    s = spec(1, 1)
    ElasticClient(url, "job", "x").create_job(
        1,
        1,
        last_call=s.last_call,
        heartbeat_timeout=s.heartbeat_timeout,
        join_timeout=s.join_timeout,
    )
    proc = subprocess.Popen([sys.executable, "-c", SAVER, url], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "committed"
        # The 256 MiB shard is being written once a temporary file holds some of it.
        deadline = time.monotonic() + 60
        while not any(p.stat().st_size for p in tmp_path.glob("storage/**/tmp/*")):
            assert time.monotonic() < deadline and proc.poll() is None
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    (m,) = managers(url, ["a"], 1, 1)  # the node comes back: a new generation
    versions = m.client.checkpoints()
    assert [(v.version, v.state, v.latest) for v in versions] == [
        (1, "committed", True),
        (2, "pending", False),
    ]
    restored = m.load_latest()
    assert restored is not None and restored.version == 1
    assert torch.equal(restored.state["w"], torch.ones(8))


def test_empty_dicts_in_lists_load_back_as_lists(start: Start) -> None:
    """Lightning's optimizer list with a stateless optimizer (plain SGD before its first
    step holds no tensor) comes back as the list it was, not a dict by index."""
    url = start().url
    (m,) = managers(url, ["a"], 1, 1)
    state = {"optimizers": [{"state": {}}, {"state": {}}], "w": torch.ones(2)}
    m.save(state, 1, blocking=True)
    restored = m.load(1)
    assert restored.state["optimizers"] == [{"state": {}}, {"state": {}}]
    m.close()
