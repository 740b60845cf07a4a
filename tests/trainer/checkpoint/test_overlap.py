"""Saves that overlap training: the bytes a version holds are the state at the save() call.

``save()`` returns once the copy of the state is scheduled; the copy runs during the
next forward and backward, and the optimizer's step waits for it (the fence). These
tests train a real model with Adam, hash the whole state at every ``save()`` call, change
it right after (the optimizer's step behind the fence, a tensor by hand after
``wait_staged()``, batch norm's running statistics in the next forward) and compare the
hashes of every version as loaded back, byte for byte. They run with the copy going
into reused buffers and straight into the memory tier's file.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from rallypoint.client import ElasticClient, JobSpec
from rallypoint.trainer import CheckpointManager
from rallypoint.trainer._bytes import tensor_bytes
from rallypoint.trainer.memory import MEMORY_ENV

from ..._ranks import run_ranks
from ...conftest import Start

# Nothing heartbeats for these nodes: a generation must outlast the test however loaded
# the machine is. With the 10 s default a save saw its generation end (StaleGeneration)
# under four xdist workers; under two the memory-tier case took 7.1 s.
ONE_NODE = JobSpec(min_nodes=1, max_nodes=1, heartbeat_timeout=timedelta(minutes=5))

pytestmark = pytest.mark.timeout(300)


def digests(value: Any, path: str = "") -> dict[str, str]:
    """Every tensor's and value's hash, by its place in the state."""
    out: dict[str, str] = {}
    if isinstance(value, torch.Tensor):
        h = xxhash.xxh3_128()
        h.update(tensor_bytes(value.detach().cpu()))
        out[path] = f"{value.dtype}{tuple(value.shape)}:{h.hexdigest()}"
    elif isinstance(value, Mapping):
        for k, v in value.items():
            out.update(digests(v, f"{path}.{k}"))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            out.update(digests(v, f"{path}.{i}"))
    else:
        out[path] = repr(value)
    return out


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, 1024), torch.nn.BatchNorm1d(1024)]
    for _ in range(6):  # about 25 MiB of parameters, 50 MiB of Adam's state
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


@pytest.fixture(params=["buffers", "memory-tier"])
def tier(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "memory-tier":
        monkeypatch.setenv(MEMORY_ENV, str(tmp_path / "shm"))
    else:
        monkeypatch.delenv(MEMORY_ENV, raising=False)
    return str(request.param)


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_overlapped_saves_hold_the_bytes_of_their_call(start: Start, tier: str) -> None:
    client = ElasticClient(start().url, "overlap", "a")
    client.join(spec=ONE_NODE)
    net = model()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    ema = {k: v.detach().clone() for k, v in net.state_dict().items() if v.numel() > 1 << 16}
    checkpoints = CheckpointManager(client, progress=False, fence=[net, optimizer])
    if tier == "memory-tier":
        assert checkpoints.memory is not None
    data = torch.randn(256, 64)

    def train_step(long: bool) -> None:
        x = data.repeat(8, 1) if long else data
        net(x).square().mean().backward()

    expected: dict[int, dict[str, str]] = {}
    unfinished = 0
    for step in range(1, 9):
        train_step(long=False)
        if step % 2 == 0:
            optimizer.step()
            optimizer.zero_grad()
            continue
        state = {
            "model": net.state_dict(),
            "optim": optimizer.state_dict(),
            "ema": ema,
            "meta": {"step": step},
        }
        expected[step] = digests(copy.deepcopy(state))
        handle = checkpoints.save(state, step)
        assert handle is not None
        if step % 4 == 1:
            # The optimizer's step at once: it changes the parameters and Adam's moments
            # the copy is still reading, behind the fence.
            unfinished += not handle.staged()
            optimizer.step()
        else:
            # A long forward and backward first (the copy finishes under it; batch
            # norm's running statistics change in it), then the step.
            train_step(long=True)
            optimizer.step()
        optimizer.zero_grad()
        checkpoints.wait_staged()
        for k, v in net.state_dict().items():  # by hand, after waiting
            if k in ema:
                ema[k].mul_(0.5).add_(v, alpha=0.5)
        # Read back now: retention keeps the newest versions only.
        restored = checkpoints.load(handle.result().version)
        assert digests(restored.state) == expected[step], f"step {step}"
    # The fence was in the way at least once: the copy ran past the save() call.
    assert unfinished > 0
    if tier == "memory-tier":
        # One copy: the version's data file in memory is the file the tensors were
        # staged into, and the tier kept only its newest versions and one spare file.
        memory = checkpoints.memory
        assert memory is not None
        held = sorted(p.name for p in memory.folder.glob("v*"))
        assert len(held) == memory.keep
        spare = list((memory.folder / "recycle").rglob("*"))
        assert len([p for p in spare if p.is_file()]) <= 1
        assert not [p for p in (memory.folder / "staging").iterdir()]
    checkpoints.close()


def test_the_fence_is_a_module_or_an_optimizer(start: Start) -> None:
    client = ElasticClient(start().url, "fence", "a")
    client.join(spec=ONE_NODE)
    with pytest.raises(TypeError, match="modules and optimizers"):
        CheckpointManager(client, fence=[torch.zeros(1)])  # type: ignore[list-item]


# Two ranks, each its own node with a memory tier, save DDP-style state (plain tensors,
# the same on both: DCP writes each from one rank) beside sharded DTensors. Each rank
# staged everything into its file; the plan leaves half the plain tensors to the other
# rank, so the file is compacted in place before it becomes the version's.
REPLICATED = r"""
import hashlib, torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from rallypoint.trainer import CheckpointManager, RallypointReader

def run(client, assignment):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(1)
    state = {f"plain{i}": torch.randn(1000 + 17 * i) for i in range(8)}
    state["sharded"] = distribute_tensor(torch.randn(64, 300), mesh, [Shard(0)])
    state["small"] = torch.arange(5)
    state["note"] = {"epoch": 3}
    m = CheckpointManager(client, progress=False)
    info = m.save(state, 7, blocking=True).result()
    mine = f"rank-{dist.get_rank():05d}/data.distcp"
    data = m.memory.find(info.version, mine)
    reader = RallypointReader(client, info.version, memory=m.memory)
    items = [s for s in reader.read_metadata().storage_data.values() if s.path == mine]
    sizes = {
        "file": data.stat().st_size,
        "end": max(s.offset + s.length for s in items),
        "items": len(items),
    }
    back = m.load(info.version)
    same = all(
        torch.equal(back.state[k], v.full_tensor() if hasattr(v, "full_tensor") else v)
        for k, v in state.items() if k != "note"
    ) and back.state["note"] == {"epoch": 3}
    m.close()
    return {"same": same, "version": info.version, **sizes}
"""


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_replicated_tensors_another_rank_writes_leave_no_gap(start: Start, tmp_path: Path) -> None:
    url = start().url
    rows = run_ranks(url, "compact", ["c0", "c1"], REPLICATED, tmp_path, memory=tmp_path / "shm")
    assert all("error" not in r for r in rows), rows
    assert all(r["same"] for r in rows), rows
    # Each rank's file in memory ends where its last item does: the tensors the plan
    # gave the other rank left no gap. Between them the ranks wrote each plain tensor
    # once (8 plain, 2 shards, the small one, the rank states and the fixups).
    assert all(r["file"] == r["end"] for r in rows), rows
    assert all(r["items"] < 12 for r in rows), rows


# A state restored without a template is made of views of the memory tier's file (no
# copy), and a training loop keeps them (an optimizer's load_state_dict keeps its
# tensors). The tier reuses the files of the versions it drops for later saves, and a
# reused file is written over and cut to its new length: Linux then takes back even the
# pages a process had copied on write, so the next read of such a tensor is a SIGBUS
# (a torchrun worker died so, 30 steps after its restore). A mapped file is never reused.
KEPT_VIEWS = r"""
import hashlib, torch
from rallypoint.trainer import CheckpointManager

def digest(state):
    return hashlib.sha256(b"".join(
        state[k].numpy().tobytes() for k in sorted(state) if k != "note"
    )).hexdigest()

def run(client, assignment):
    m = CheckpointManager(client, progress=False)
    assert m.memory is not None
    # The first tensor large and the rest small: a later, smaller state cuts the file
    # short of them.
    state = {"big": torch.randn(1 << 18), "note": {"n": 0}}
    state.update({f"w{i}": torch.randn(4096) for i in range(8)})
    first = m.save(state, 1, blocking=True).result().version
    held = m.load(first).state  # views of this node's file of ``first``
    before = digest(held)
    for step in range(2, 2 + 3 * m.memory.keep):  # the tier drops ``first`` and reuses
        smaller = {k: torch.randn(v.numel() // 2) for k, v in state.items() if k != "note"}
        m.save({**smaller, "note": {"n": step}}, step, blocking=True).result()
    after = digest(held)  # a SIGBUS here, or other bytes, had the file been reused
    m.close()
    return {"same": before == after}
"""


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_tensors_restored_from_the_tier_never_change(start: Start, tmp_path: Path) -> None:
    url = start().url
    rows = run_ranks(url, "kept", ["k0"], KEPT_VIEWS, tmp_path, memory=tmp_path / "shm")
    assert all("error" not in r for r in rows), rows
    assert rows[0]["same"], rows
