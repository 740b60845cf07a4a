"""Recovery after a lost node and after a preemption notice: rallypoint vs stock torchrun.

Four torchrun agents, one CPU worker each (gloo), train the example CNN
(``trainer/examples/train_ddp.py``; 50 ms of extra work per step). Mid-training one node
goes, and the clock runs until rank 0 completes a training step at world size 3:

- ``worker``: SIGKILL of rank 2's worker process alone (its agent lives on and
  restarts it; the others restart theirs).
- ``kill``: SIGKILL of a whole node (agent and worker, as when a VM vanishes), rank 2.
- ``preempt``: for rallypoint an Azure Scheduled Events ``Preempt`` notice (a stand-in
  for IMDS on loopback); stock torchrun has no notice to act on, so it gets what the
  platform sends next, SIGTERM to the agent.

For the SIGKILLs Rallypoint runs twice, each node with a memory tier of its own (as on
separate machines):

- ``rallypoint``: checkpoints every 10 steps to memory (the node's and its peer's), every
  10th of them to blob storage too (every 100 steps);
- ``rallypoint-blob``: ``RALLYPOINT_MEMORY_DIR=none``, a checkpoint every 100 steps to
  blob storage, the most its bandwidth allows for a large model.

Bytes the new workers read from storage and steps lost are printed for each.

Both sides use ``--nnodes=3:4`` and ``--max-restarts=100``. rallypoint runs with
``heartbeat_timeout=3`` and a 2 s last call; stock c10d keeps its defaults. The anchor's
workers train the same model on the same data without checkpoints (it has no
authoritative checkpoint to resume from); "steps lost" is rallypoint's only.

Usage::

    python bench/recovery.py [--limit 100] [--only rallypoint|c10d]
        [--kind worker|kill|preempt] [--repeat 1]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rallypoint.cli.fake_imds import FakeImds
from rallypoint.cli.processes import Cluster, Coordinator, descendants, free_port, judge
from rallypoint.trainer._memory import MEMORY_ENV

STEP_TIME = 0.05
AGENTS = ("n0", "n1", "n2", "n3")

# The anchor's worker: the example's model and data, plain DDP, events like the example's.
ANCHOR = textwrap.dedent(
    """
    import json, os, sys, time
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from rallypoint.trainer.examples.train_ddp import SmallCNN, synthetic_cifar
    events, step_time = sys.argv[1], float(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    images, labels = synthetic_cifar(4096, 0)
    model = DistributedDataParallel(SmallCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for step in range(10**9):
        i = torch.randint(0, 4096, (32,), generator=g)
        loss = nn.functional.cross_entropy(model(images[i]), labels[i])
        opt.zero_grad(); loss.backward(); opt.step()
        time.sleep(step_time)
        if rank == 0:
            with open(events, "a") as f:
                f.write(json.dumps({"t": time.time(), "event": "step", "step": step,
                                    "generation": 0, "rank": 0, "world_size": world}) + "\\n")
    """
)


def step_with(world: int, after: float = 0.0) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == "step" and e["world_size"] == world and e["t"] > after


def restarted(
    world: int, after: float, where: Callable[[dict[str, Any]], bool]
) -> Callable[[dict[str, Any]], bool]:
    """A step at ``world`` by restarted workers (``where``): after a worker's kill the
    others may still finish a step or two before they notice."""
    return lambda e: step_with(world, after)(e) and where(e)


def rallypoint(kind: str, workdir: Path, limit: float, memory: bool = True) -> dict[str, Any]:
    storage = ["--storage", f"local:{workdir / 'storage'}"]
    coordinator = Coordinator(storage, log=workdir / "coordinator.log")
    with FakeImds() as imds:
        coordinator.start()
        cluster = Cluster(
            coordinator.url,
            f"rp-{kind}",
            workdir,
            nnodes="3:4",
            steps=10**6,
            step_time=STEP_TIME,
            heartbeat_timeout=3,
            last_call=2,
            imds_url=imds.url,
            checkpoint_every=10 if memory else 100,
            persist_every=10 if memory else 1,
            memory=workdir / "shm" if memory else None,
        )
        try:
            for node in AGENTS:
                cluster.add(node)
            cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 30, timeout=120)
            victim = _member_of_rank(coordinator.url, cluster.job, 2)
            world = 4 if kind == "worker" else 3
            generation = max(e["generation"] for e in cluster.events())
            started = time.time()
            if kind == "worker":
                os.kill(_worker_of_rank(cluster, 2), signal.SIGKILL)
            elif kind == "kill":
                cluster.kill(victim)
            else:
                imds.schedule(victim)
            later = restarted(world, started, lambda e: e["generation"] > generation)
            try:
                recovered = cluster.wait_for(later, timeout=limit)["t"] - started
            except TimeoutError:
                recovered = None
            history = _history(coordinator.url, cluster.job)
        finally:
            cluster.stop()
            coordinator.stop()
    events = cluster.events()
    verdict = judge(events, history)
    lost = max(verdict.steps_lost.values(), default=None)
    # When the new workers' processes started: the rest of the time is their start-up
    # (importing torch, three at once on this machine's CPUs) and the first step.
    resumed = [e for e in events if e["event"] == "resumed" and e["t"] > started]
    spawned = [e["started"] - started for e in resumed if e.get("started")]
    storage = [(e.get("bytes_from") or {}).get("storage", 0) for e in resumed]
    peer = [(e.get("bytes_from") or {}).get("peer", 0) for e in resumed]
    return {
        "seconds": recovered,
        "workers_started": min(spawned) if spawned else None,
        "steps_lost": lost,
        "consistent": verdict.consistent,
        "storage_bytes": sum(storage) if resumed else None,
        "peer_bytes": sum(peer) if resumed else None,
    }


def c10d(kind: str, workdir: Path, limit: float) -> dict[str, Any]:
    script = workdir / "anchor.py"
    script.write_text(ANCHOR)
    events = workdir / f"c10d-{kind}.events.jsonl"
    port = free_port()
    cluster = Cluster(
        "",
        f"c10d-{kind}",
        workdir,
        nnodes="3:4",
        script=[str(script), str(events), str(STEP_TIME)],
        rdzv=[
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=c10d-{kind}",
        ],
    )
    cluster.events_file = events
    try:
        for node in AGENTS:
            cluster.add(node)
        cluster.wait_for(step_with(4), timeout=120)
        cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 30, timeout=120)
        victim = AGENTS[-1]  # not the store's host: that one takes the job down with it
        at_kill = max(e["step"] for e in cluster.events() if e["event"] == "step")
        started = time.time()
        if kind == "worker":
            # The anchor's workers log no pid: the agent's child that runs the script.
            for pid in descendants(cluster.agents[victim].proc.pid):
                with contextlib.suppress(OSError):
                    if b"anchor.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        os.kill(pid, signal.SIGKILL)
        elif kind == "kill":
            cluster.kill(victim)
        else:
            cluster.terminate(victim)
        world = 4 if kind == "worker" else 3
        try:
            # The anchor keeps no checkpoint: restarted workers count their steps from 0.
            later = restarted(world, started, lambda e: e["step"] < at_kill)
            recovered = cluster.wait_for(later, timeout=limit)["t"] - started
        except TimeoutError:
            recovered = None
    finally:
        cluster.stop()
    return {"seconds": recovered, "workers_started": None, "steps_lost": None, "consistent": None}


def _worker_of_rank(cluster: Cluster, rank: int) -> int:
    """The pid of the worker that runs ``rank`` now (from its latest ``resumed`` event)."""
    resumed = [e for e in cluster.events() if e["event"] == "resumed" and e["rank"] == rank]
    return int(resumed[-1]["pid"])


def _member_of_rank(url: str, job: str, rank: int) -> str:
    import httpx

    members = httpx.get(f"{url}/v1/jobs/{job}", timeout=10).json()["members"]
    return str(next(m["node_id"] for m in members if m["rank"] == rank))


def _history(url: str, job: str) -> list[dict[str, Any]]:
    import httpx

    history: list[dict[str, Any]] = httpx.get(f"{url}/v1/jobs/{job}", timeout=10).json()["history"]
    return history


def _runs(results: list[dict[str, Any]], limit: float) -> str:
    if not results:
        return "-"
    return (
        ", ".join(
            f"> {limit:.0f}" if r["seconds"] is None else f"{r['seconds']:.1f}" for r in results
        )
        + " s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=float, default=100, help="give up after this many s")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--only", choices=["rallypoint", "c10d"])
    parser.add_argument("--kind", choices=["worker", "kill", "preempt"], help="one event only")
    args = parser.parse_args()
    # CPU workers, as above, on a machine with a GPU too: there the example would train on
    # it with NCCL, which refuses four ranks on one device.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    runners: dict[str, Callable[[str, Path, float], dict[str, Any]]] = {
        "rallypoint": rallypoint,
        "rallypoint-blob": lambda k, w, limit: rallypoint(k, w, limit, memory=False),
        "c10d": c10d,
    }
    if args.only:
        runners = {k: v for k, v in runners.items() if k.split("-")[0] == args.only}
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(args.repeat):
        for kind in [args.kind] if args.kind else ["worker", "kill", "preempt"]:
            for name, run in runners.items():
                if name == "rallypoint-blob" and kind == "preempt":
                    continue  # a notice persists the emergency version either way
                # Blob storage only: the agents give their workers no memory tier.
                os.environ[MEMORY_ENV] = "none" if name == "rallypoint-blob" else ""
                with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
                    result = run(kind, Path(tmp), args.limit)
                results.setdefault((kind, name), []).append(result)
                print(f"{kind:8} {name:10} {result}", file=sys.stderr, flush=True)

    print(f"\n{'event':34} {'rallypoint':>16} {'stock c10d':>18} {'steps lost':>11}")
    labels = {
        "worker": "SIGKILL of a worker (rank 2)",
        "kill": "SIGKILL of a node (rank 2)",
        "preempt": "preemption notice / SIGTERM",
    }
    for kind, label in labels.items():
        ours = results.get((kind, "rallypoint"), [])
        theirs = results.get((kind, "c10d"), [])
        blob = results.get((kind, "rallypoint-blob"), [])
        lost = [r["steps_lost"] for r in ours if r["steps_lost"] is not None]
        spawned = [r["workers_started"] for r in ours if r["workers_started"] is not None]
        # Every run, not a median: a run of the anchor may not recover at all.
        print(
            f"{label:34} {_runs(ours, args.limit):>16} {_runs(theirs, args.limit):>18} "
            f"{max(lost) if lost else '-':>11}"
        )
        if spawned:
            print(f"  rallypoint: new worker processes started after {min(spawned):.2f} s")
        read = [r["storage_bytes"] for r in ours if r.get("storage_bytes") is not None]
        peers = [r["peer_bytes"] for r in ours if r.get("peer_bytes") is not None]
        if kind != "preempt" and read:
            print(
                f"  rallypoint: new workers read {max(read)} bytes from storage, "
                f"{max(peers) if peers else 0} from peers"
            )
        if blob:
            blob_read = [r["storage_bytes"] for r in blob if r.get("storage_bytes") is not None]
            blob_lost = [r["steps_lost"] for r in blob if r["steps_lost"] is not None]
            print(
                f"  rallypoint, blob storage only: {_runs(blob, args.limit)}, "
                f"{max(blob_read) if blob_read else '-'} bytes from storage, "
                f"{max(blob_lost) if blob_lost else '-'} steps lost"
            )
        if ours and not all(r["consistent"] for r in ours):
            print(f"  rallypoint ranks resumed from different checkpoints after {kind}!")
    return 0


if __name__ == "__main__":
    sys.exit(main())
