"""A restored state is ordinary tensors, whichever copy it was read from: blob storage
(local files and Azurite), this node's memory tier, a peer's. Each tensor is saved with
``torch.save`` and with safetensors and read back equal, drags no storage larger than
itself into a file, and so is every tensor an optimizer keeps after ``load_state_dict``
of them (the data-loss bug of issue 36: a resumed Adam saved with ``torch.save`` could not
be loaded back)."""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from rallypoint.trainer.memory import MEMORY_ENV

from ..._ranks import run_ranks
from ..._support import managers
from ...conftest import Start


def odd_state() -> dict[str, Any]:
    """An MLP with Adam after one step, beside tensors of every awkward kind: uint8 and
    bool of odd lengths (their bytes end off any element boundary of the float tensors
    saved next to them), bf16, fp16, int64, 0-d tensors and tensors of 0 elements."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.ReLU(), torch.nn.Linear(17, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 33)).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "bytes": torch.arange(7, dtype=torch.uint8),
        "mask": torch.tensor([True, False, True, True, False]),
        "half": torch.randn(5, dtype=torch.bfloat16),
        "fp16": torch.randn(3, 3, dtype=torch.float16),
        "ids": torch.arange(11, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "count": torch.tensor(3, dtype=torch.int32),
        "empty": torch.empty(0, 3),
        "no_bytes": torch.empty(0, dtype=torch.uint8),
    }


def ordinary_problems(state: dict[str, Any]) -> list[str]:
    """What keeps the tensors of a restored ``state`` from being ordinary: each is
    checked, then the state is loaded into a fresh MLP and Adam, which step once, and
    every tensor, the whole state and the optimizer's state are written with
    ``torch.save`` and safetensors and read back. Empty if none. (Run in the test's
    process and, as source, in the peer test's ranks.)"""
    import io

    import safetensors.torch
    import torch

    def flatten(value: Any, name: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {} if out is None else out
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                flatten(v, f"{name}/{k}", out)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                flatten(v, f"{name}/{i}", out)
        return out

    problems: list[str] = []

    def round_trip(obj: Any) -> Any:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)

    flat = flatten(state)
    for name, t in flat.items():
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            problems.append(f"{name}: a storage of {t.untyped_storage().nbytes()} bytes")
        try:
            if not same(round_trip(t), t):
                problems.append(f"{name}: torch.save -> torch.load differs")
        except Exception as exc:
            problems.append(f"{name}: torch.save -> torch.load: {exc}")
    try:
        back = flatten(round_trip(state))
        problems += [f"{n}: differs in the whole state" for n in flat if not same(back[n], flat[n])]
    except Exception as exc:
        problems.append(f"the whole state: {type(exc).__name__}: {exc}")
    try:
        saved = safetensors.torch.save(flat)
        loaded = safetensors.torch.load(saved)
        problems += [
            f"{n}: differs through safetensors" for n in flat if not same(loaded[n], flat[n])
        ]
    except Exception as exc:
        problems.append(f"safetensors: {type(exc).__name__}: {exc}")
    # What an optimizer keeps after load_state_dict of the restored tensors, and after
    # a step on them.
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.ReLU(), torch.nn.Linear(17, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    for when in ("loaded", "stepped"):
        try:
            kept = optimizer.state_dict()
            back = round_trip(kept)
            for i, s in kept["state"].items():
                for k, v in s.items():
                    if not same(back["state"][i][k], v):
                        problems.append(f"optimizer {when}: state {i} {k} differs")
        except Exception as exc:
            problems.append(f"optimizer {when}: {type(exc).__name__}: {exc}")
        model(torch.randn(5, 33)).sum().backward()
        optimizer.step()
    return problems


def restore(url: str) -> Any:
    """Saves :func:`odd_state` as one node's job and restores it in a new generation."""
    (m,) = managers(url, ["a"], 1, 1)
    m.save(odd_state(), 1, blocking=True)
    m.close()
    (m,) = managers(url, ["a"], 1, 1)  # a restart: the next generation
    restored = m.load_latest()
    m.close()
    assert restored is not None
    return restored


def test_a_state_restored_from_storage_is_ordinary_tensors(start: Start) -> None:
    """Blob storage: a local file (mapped) and Azurite (downloaded in ranged reads)."""
    restored = restore(start().url)
    assert restored.bytes_from["storage"] > 0
    assert ordinary_problems(restored.state) == []
    assert torch.equal(restored.state["model"]["0.weight"], odd_state()["model"]["0.weight"])


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_state_restored_from_this_nodes_memory_is_ordinary_tensors(
    start: Start, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MEMORY_ENV, str(tmp_path / "shm"))
    restored = restore(start().url)
    assert restored.bytes_from["storage"] == 0 and restored.bytes_from["memory"] > 0
    assert ordinary_problems(restored.state) == []


PEER = """
import os
import shutil
import torch
from pathlib import Path
import torch.distributed as dist
from rallypoint.trainer import CheckpointManager
from rallypoint.trainer.memory import MEMORY_ENV

def run(client, a):
    m = CheckpointManager(client, progress=False, persist_every=100)
    m.save({"w": torch.ones(1)}, 1, blocking=True)  # the first version goes to storage
    info = m.save(odd_state(), 2, blocking=True).result()
    dist.barrier()
    out = {}
    if a.rank == 1:
        # Rank 0's files (the replicated state) are on its node and, as a replica, here:
        # without the replica, they come from rank 0's node.
        for replicas in Path(os.environ[MEMORY_ENV]).rglob("replicas"):
            shutil.rmtree(replicas)
        restored = m.load(info.version)
        out = {"bytes_from": restored.bytes_from, "problems": ordinary_problems(restored.state)}
    dist.barrier()
    m.close()
    return out
"""


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_state_restored_from_a_peer_is_ordinary_tensors(start: Start, tmp_path: Path) -> None:
    body = "\n".join(
        [
            "from typing import Any",
            inspect.getsource(odd_state),
            inspect.getsource(ordinary_problems),
            PEER,
        ]
    )
    rows = run_ranks(start().url, "peer", ["p0", "p1"], body, tmp_path, memory=tmp_path / "shm")
    assert all("error" not in r for r in rows), rows
    reader = rows[1]
    assert reader["bytes_from"]["peer"] > 0 and reader["bytes_from"]["storage"] == 0, reader
    assert reader["problems"] == []
    shutil.rmtree(tmp_path / "shm", ignore_errors=True)
