"""Sharded and replicated state across real processes (gloo on CPU): DCP plans, the
coordinator commits, each global rank restores its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..._ranks import run_ranks
from ...conftest import Spawn

MiB = 1 << 20

SAVE_SHARDED = """
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from rallypoint.trainer import CheckpointManager

def run(client, a):
    mesh = init_device_mesh("cpu", (a.world_size,))
    w = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48) / 7
    big = torch.arange(1024 * 1024, dtype=torch.float32).reshape(1024, 1024)
    state = {"w": distribute_tensor(w, mesh, [Shard(0)]),
             "big": distribute_tensor(big, mesh, [Shard(0)]),
             "r": torch.full((5,), 3.0), "epoch": 2}
    m = CheckpointManager(client, progress=False, verify_replicated=True)
    info = m.save(state, 5, rank_state={"g": torch.tensor(a.rank)}, blocking=True).result()
    m.close()
    return {"version": info.version}
"""

LOAD_RESHARDED = """
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from rallypoint.trainer import CheckpointManager

def run(client, a):
    mesh = init_device_mesh("cpu", (a.world_size,))
    state = {"w": distribute_tensor(torch.zeros(64, 48), mesh, [Shard(1)]),
             "big": distribute_tensor(torch.zeros(1024, 1024), mesh, [Shard(0)]),
             "r": torch.zeros(5), "epoch": 0}
    m = CheckpointManager(client, progress=False)
    restored = m.load_latest(state)
    w = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48) / 7
    big = torch.arange(1024 * 1024, dtype=torch.float32).reshape(1024, 1024)
    return {
        "step": restored.step, "saved_by": restored.world_size,
        "same_dict": restored.state is state,
        "w": bool(torch.equal(state["w"].full_tensor(), w)),
        "w_placement": str(state["w"].placements[0]),
        "big": bool(torch.equal(state["big"].full_tensor(), big)),
        "r": state["r"].tolist(), "epoch": state["epoch"],
        "rank_state": int(restored.rank_state["g"]),
        "bytes": restored.bytes_from["storage"],
    }
"""


@pytest.mark.parametrize("backend", ["local", "azure"], indirect=True)
def test_dtensors_reshard_to_another_world_and_placement(spawn: Spawn, tmp_path: Path) -> None:
    """Shard(0) on 4 processes restores in place into a Shard(1) template on 2; each
    process reads about its share of the bytes."""
    url = spawn().url
    saved = run_ranks(url, "job", [f"s{i}" for i in range(4)], SAVE_SHARDED, tmp_path)
    assert [r.get("error") for r in saved] == [None] * 4
    loaded = run_ranks(url, "job", ["l0", "l1"], LOAD_RESHARDED, tmp_path)
    for r in loaded:
        assert "error" not in r, r
        assert (r["step"], r["saved_by"], r["same_dict"]) == (5, 4, True)
        assert (r["w"], r["w_placement"], r["big"]) == (True, "S(1)", True)
        assert (r["r"], r["epoch"], r["rank_state"]) == ([3.0] * 5, 2, r["rank"])
        # Half of the 4 MiB tensor, all of the small one (its columns span every saved
        # row shard), the manifest and DCP's metadata: not the whole state.
        assert 2 * MiB <= r["bytes"] < 2 * MiB + 64 * 1024, r["bytes"]


SAVE_REPLICATED = """
import torch
from rallypoint.trainer import CheckpointManager

def run(client, a):
    torch.manual_seed(0)  # the same on every rank, as DDP keeps them
    state = {"model": {f"t{i}": torch.randn(128 + i, 256) for i in range(12)},
             "opt": {"state": {0: {"m": torch.ones(3)}}, "groups": [{"lr": 0.1, "params": [0]}]},
             "empty": {}, "step": 9}
    m = CheckpointManager(client, progress=False, verify_replicated=True)
    info = m.save(state, 9, rank_state={"rank": a.rank}, blocking=True).result()
    m.close()
    return {"version": info.version}
"""

LOAD_REPLICATED = """
import torch
from rallypoint.trainer import CheckpointManager

def run(client, a):
    torch.manual_seed(0)
    expected = {f"t{i}": torch.randn(128 + i, 256) for i in range(12)}
    m = CheckpointManager(client, progress=False)
    restored = m.load_latest()
    s = restored.state
    return {
        "model": list(s["model"]) == list(expected)
        and all(torch.equal(s["model"][k], v) for k, v in expected.items()),
        "opt_keys": list(s["opt"]["state"]), "m": s["opt"]["state"][0]["m"].tolist(),
        "groups": s["opt"]["groups"], "empty": s["empty"], "step": s["step"],
        "rank_state": restored.rank_state,
        # Every saving rank's rank_state, to any rank (DeepSpeed's ZeRO reshard).
        "rank_states": m.load_latest(every_rank=True).rank_states,
        "none": restored.rank_states,
    }
"""


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_replicated_state_is_written_once_and_restores_at_any_world(
    spawn: Spawn, tmp_path: Path
) -> None:
    url = spawn().url
    saved = run_ranks(url, "job", ["a", "b", "c"], SAVE_REPLICATED, tmp_path)
    assert [r.get("error") for r in saved] == [None] * 3
    # DCP writes each replicated tensor once, spread over the ranks.
    sizes = [p.stat().st_size for p in sorted(tmp_path.glob("storage/**/data.distcp"))]
    total = sum((128 + i) * 256 * 4 for i in range(12))
    assert len(sizes) == 3 and sum(sizes) < total * 1.05
    assert max(sizes) < total / 3 * 1.3, sizes
    for world in (["x0", "x1"], ["y0", "y1", "y2", "y3"]):  # new nodes: no survivors
        loaded = run_ranks(url, "job", world, LOAD_REPLICATED, tmp_path)
        for r in loaded:
            assert "error" not in r, r
            assert (r["model"], r["opt_keys"], r["m"]) == (True, [0], [1.0] * 3)
            assert (r["groups"], r["empty"], r["step"]) == ([{"lr": 0.1, "params": [0]}], {}, 9)
            # A rank that did not exist when the version was saved has no rank_state.
            assert r["rank_state"] == ({"rank": r["rank"]} if r["rank"] < 3 else None)
            assert r["rank_states"] == {str(i): {"rank": i} for i in range(3)}
            assert r["none"] is None


SAVE_DIVERGED = """
import torch
from rallypoint.trainer import CheckpointManager, StateNotReplicated

def run(client, a):
    m = CheckpointManager(client, progress=False, verify_replicated=True)
    try:
        m.save({"w": torch.ones(4), "seed": torch.tensor([a.rank])}, 1, blocking=True)
    except StateNotReplicated as exc:
        refused = {"refused": str(exc), "versions": len(client.checkpoints())}
    else:
        return {"refused": None}
    # if_busy="skip": every rank skips while the save before is uploading, and none hangs.
    m = CheckpointManager(client, progress=False, if_busy="skip")
    big = {"w": torch.zeros(16 << 20)}
    first = m.save(big, 2)
    second = m.save(big, 3)
    first.result()
    third = m.save(big, 4, blocking=True)
    m.close()
    return {**refused, "skipped": second is None, "then": third is not None}
"""


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_plain_tensor_that_differs_across_ranks_is_refused_and_skips_are_unanimous(
    spawn: Spawn, tmp_path: Path
) -> None:
    results = run_ranks(spawn().url, "job", ["a", "b"], SAVE_DIVERGED, tmp_path)
    for r in results:
        assert r["refused"] is not None and "seed" in r["refused"], r
        assert "rank_state" in r["refused"] and "w" not in r["refused"].split(":")[1]
        assert r["versions"] == 0  # refused before anything was begun or uploaded
        assert (r["skipped"], r["then"]) == (True, True)
