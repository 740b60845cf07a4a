"""What each process of ``bench/checkpoint.py --mode sharded`` runs (see there).

Loaded by ``tests/_ranks.py`` into a process that joined the job and holds a gloo
process group; ``PARAMS`` is filled in by the bench. Every figure is timed on every
rank between barriers, so it is the time until the slowest rank is done.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from rallypoint.trainer import CheckpointManager
from rallypoint.trainer._bytes import as_memoryview  # no numpy here

PARAMS: dict[str, Any] = json.loads(os.environ["BENCH_PARAMS"])
MiB = 1 << 20


def rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def timed(action: Callable[[], Any]) -> float:
    """Seconds from a barrier until every rank finished ``action``."""
    dist.barrier()
    start = time.perf_counter()
    action()
    dist.barrier()
    return time.perf_counter() - start


def state_for(mesh: Any, placement: Any, fill: bool) -> dict[str, DTensor]:
    """``tensors`` float32 DTensors of ``rows x 1024`` in all, sharded over ``mesh``."""
    world = mesh.size()
    rows = PARAMS["rows"]
    local_rows = rows // world if isinstance(placement, Shard) and placement.dim == 0 else rows
    cols = 1024 // world if isinstance(placement, Shard) and placement.dim == 1 else 1024
    g = torch.Generator().manual_seed(dist.get_rank())
    out = {}
    for i in range(PARAMS["tensors"]):
        local = (
            torch.randn(local_rows, cols, generator=g) if fill else torch.empty(local_rows, cols)
        )
        out[f"layer{i}.weight"] = DTensor.from_local(local, mesh, [placement], run_check=False)
    return out


def median(values: list[float]) -> float:
    return statistics.median(values)


def run(client: Any, assignment: Any) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    work = Path(PARAMS["work"])
    phase = PARAMS["phase"]
    manager = CheckpointManager(client, progress=False)
    out: dict[str, Any] = {}
    before = rss("VmRSS:")
    if phase == "memory":
        state = state_for(mesh, Shard(0), fill=True)
        local_bytes = sum(t.to_local().numel() * 4 for t in state.values())
        for step in range(1001, 1004):
            manager.save(state, step, blocking=True)
        out["peak_rss_x"] = (rss("VmHWM:") - before) / local_bytes
    elif phase == "save":
        state = state_for(mesh, Shard(0), fill=True)
        local_bytes = sum(t.to_local().numel() * 4 for t in state.values())
        total = local_bytes * world
        rounds, warm = PARAMS["repeat"], PARAMS["warmup"]
        step = 0

        def ours() -> tuple[float, float]:
            nonlocal step
            step += 1
            out["version"] = step  # one version per step, from 1
            dist.barrier()
            start = time.perf_counter()
            handle = manager.save(state, step)
            blocked = time.perf_counter() - start
            assert handle is not None
            handle.result()
            dist.barrier()
            return blocked, time.perf_counter() - start

        counter = iter(range(10_000))

        def dcp_async(stager: DefaultStager | None) -> tuple[float, float]:
            target = work / f"dcp-{next(counter)}"
            dist.barrier()
            start = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=str(target), async_stager=stager)
            blocked = time.perf_counter() - start
            future.result()
            dist.barrier()
            persisted = time.perf_counter() - start
            return blocked, persisted

        def clean() -> None:
            dist.barrier()
            if rank == 0:
                for old in work.glob("dcp-*"):
                    if old.name != "dcp-keep":
                        shutil.rmtree(old, ignore_errors=True)
            dist.barrier()

        cached = DefaultStager(StagingOptions(False, False, False, False))
        results: dict[str, list[tuple[float, float]]] = {"ours": [], "dcp": [], "dcp_cached": []}
        if PARAMS.get("conn"):
            # Azurite: the anchor is every rank uploading its shards' bytes at once.
            blob = _blob(rank)
            flat = torch.cat([t.to_local().reshape(-1).view(torch.uint8) for t in state.values()])
            data = bytes(as_memoryview(flat))
            results = {"ours": [], "upload_blob": []}
            for i in range(warm + rounds):
                mine = ours()
                up = timed(lambda: blob.upload_blob(data, overwrite=True, max_concurrency=8))
                if i >= warm:
                    results["ours"].append(mine)
                    results["upload_blob"].append((0.0, up))
        for i in range(0 if PARAMS.get("conn") else warm + rounds):  # alternating: the
            mine = ours()  # same disk weather for all
            plain = dcp_async(None)
            clean()
            with_cache = dcp_async(cached)
            clean()
            if i >= warm:
                results["ours"].append(mine)
                results["dcp"].append(plain)
                results["dcp_cached"].append(with_cache)
        for name, pairs in results.items():
            out[f"{name}_blocked"] = median([b for b, _ in pairs])
            out[f"{name}_persisted_mibs"] = total / MiB / median([p for _, p in pairs])
        buffers = [torch.empty_like(t.to_local()) for t in state.values()]

        def copy() -> float:
            dist.barrier()  # timed on this rank alone, as save()'s blocked time is
            start = time.perf_counter()
            for b, t in zip(buffers, state.values(), strict=True):
                b.copy_(t.to_local())
            return time.perf_counter() - start

        out["copy"] = median([copy() for _ in range(rounds)])
        out["total_mib"] = total / MiB
        if PARAMS.get("conn"):
            manager.close()
            return out
        # The anchors' last checkpoint stays for the restore phases.
        dcp.save(state, checkpoint_id=str(work / "dcp-keep"))

        def gathered() -> None:
            full = {k: v.full_tensor() for k, v in state.items()}
            if rank == 0:
                torch.save(full, work / "full.pt")

        out["torch_save_gathered"] = median([timed(gathered) for _ in range(max(1, rounds - 1))])
    else:
        placement = Shard(0)
        state = state_for(mesh, placement, fill=False)
        version = PARAMS["version"]
        rounds = PARAMS["repeat"]
        read: list[int] = []

        k = PARAMS["saved_by"] // world
        blobs = [_blob(j) for j in range(rank * k, (rank + 1) * k)] if PARAMS.get("conn") else []

        def ours() -> None:
            restored = manager.load(version, state)
            read.append(restored.bytes_from["storage"])

        def theirs() -> None:
            if blobs:  # every rank downloads the bytes the saving ranks it replaces wrote
                for blob in blobs:
                    blob.download_blob(max_concurrency=8).readall()
            else:
                dcp.load(state, checkpoint_id=str(work / "dcp-keep"))

        ours()
        theirs()  # warm-up: the page cache holds both
        a, b = [], []
        for _ in range(rounds):
            a.append(timed(ours))
            b.append(timed(theirs))
        total = PARAMS["total_mib"]
        out["ours_load_mibs"] = total / median(a)
        out["anchor_load_mibs"] = total / median(b)
        out["bytes_read_mib"] = read[-1] / MiB
    manager.close()
    return out


def _blob(rank: int) -> Any:
    from azure.storage.blob import BlobServiceClient

    service = BlobServiceClient.from_connection_string(PARAMS["conn"])
    container = service.get_container_client("anchor")
    if not container.exists():
        with contextlib.suppress(Exception):  # another rank created it first
            container.create_container()
    return container.get_blob_client(f"rank-{rank}.bin")
