"""Recovery after a lost node, a preemption notice and a new node: rallypoint vs stock
torchrun.

Four torchrun agents, one CPU worker each (gloo), train the example CNN
(``trainer/examples/train_ddp.py``; 50 ms of extra work per step). Mid-training one node
goes, and the clock runs until rank 0 completes a training step at world size 3:

- ``worker``: SIGKILL of rank 2's worker process alone (its agent lives on and
  restarts it; the others restart theirs, or, in place, regroup around it).
- ``kill``: SIGKILL of a whole node (agent and worker, as when a VM vanishes), rank 2.
- ``preempt``: for rallypoint an Azure Scheduled Events ``Preempt`` notice (a stand-in
  for IMDS on loopback); stock torchrun has no notice to act on, so it gets what the
  platform sends next, SIGTERM to the agent.
- ``join``: three agents train to step 30, then a fourth is started; the clock runs from
  its start to rank 0's first step at world size 4.
- ``standby``: four agents train and a fifth parks beside them
  (``--rdzv-conf standbys=1``); once a version saved since it parked has committed (one
  it holds copies of), rank 2's node is SIGKILLed, and the clock runs until
  rank 0's first step at world size 4 again, the standby in the lost node's rank. Stock
  c10d has no standby: its fifth agent (``--nnodes=3:4``) waits as a spare, and the clock
  runs the same way.

Rallypoint runs in up to three setups, each node with a memory tier of its own (as on
separate machines):

- ``rallypoint``: checkpoints every 10 steps to memory (the node's and its peer's), every
  10th of them to blob storage too (every 100 steps); the agents restart their workers
  (warm, under ``rallypoint run``) for each new generation;
- ``rallypoint-in-place``: the same checkpoints, but the workers regroup in place
  (``train_ddp.py --in-place``): survivors keep their processes, build the new process
  group and restore from their node's memory (``worker``, ``kill`` and ``join``, with the
  shipped defaults: a newcomer's join is hot, its worker starts when it parks and waits,
  its model built, in ``join()``, and the generation ends for it only then; for ``join``
  also with ``hot_join=0``, as ``rallypoint-in-place-cold``: the generation ends as the
  newcomer joins, and the members wait for its process start; and with ``hot_join=0,
  last_call=0``, as ``rallypoint-in-place-lc0``: the 2 s last call is a deliberate wait
  for more newcomers; for ``standby`` also with ``hot_standby=1``, as
  ``rallypoint-in-place-hot``: the standby's worker starts when it parks);
- ``rallypoint-blob``: ``RALLYPOINT_MEMORY_DIR=none``, a checkpoint every 100 steps to
  blob storage, the most its bandwidth allows for a large model (``worker``, ``kill``).

Bytes the new workers read from storage and steps lost are printed for each; for in
place, the regroup's phases too (seconds from the event to the survivors' end of the old
generation, leaving its group, the node's next assignment, the new group, the restore and
the first step).

``--kind chaos`` (in place only): four nodes, ten rounds of a seeded random node other than
n0 SIGKILLed (to a step at world 3) and a new node started (to a step at world 4); every
generation is checked consistent, fallbacks (a worker restarted instead of regrouping)
are counted, and n0's worker, which never dies, reports its RSS (in all and by kind), its
mappings, threads and open files at each regroup: the leak check.

Both sides use ``--nnodes=3:4`` and ``--max-restarts=100``. rallypoint runs with
``heartbeat_timeout=3`` and a 2 s last call; stock c10d keeps its defaults. The anchor's
workers train the same model on the same data without checkpoints (it has no
authoritative checkpoint to resume from); "steps lost" is rallypoint's only.

``--smoke`` runs the same paths on two nodes (``--nodes 2``: rank 0 is the one lost),
each trained to step 5 (``--warm``): a node's kill in place and under stock c10d (given
10 s: it may not recover, as above, and that does not fail the run), then one round of
chaos.

Usage::

    python bench/recovery.py [--limit 100] [--only rallypoint|rallypoint-in-place|c10d]
        [--kind worker|kill|preempt|join|standby] [--repeat 1] [--nodes 4] [--warm 30]
    python bench/recovery.py --kind chaos [--rounds 10] [--seed 0]
    python bench/recovery.py --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _c10d import anchor_cluster, listening
from _regroup_chaos import chaos, format_chaos, format_regroup, log_lines, regroup
from _smoke import parse

from rallypoint.cli.fake_imds import FakeImds
from rallypoint.cli.processes import Cluster, Coordinator, descendants, judge
from rallypoint.trainer.memory import MEMORY_ENV

STEP_TIME = 0.05
STANDBY = "s0"


@dataclass(frozen=True)
class Shape:
    """How large a run is: ``nodes`` agents (``--nnodes=nodes-1:nodes``), trained to
    step ``warm`` before the event; the node lost is rank ``nodes - 2``'s."""

    nodes: int = 4
    warm: int = 30

    @property
    def agents(self) -> tuple[str, ...]:
        return tuple(f"n{i}" for i in range(self.nodes))

    @property
    def nnodes(self) -> str:
        return f"{self.nodes - 1}:{self.nodes}"

    @property
    def lost_rank(self) -> int:
        return self.nodes - 2

    def world_after(self, kind: str) -> int:
        """The world size the clock stops at."""
        return self.nodes - 1 if kind in ("kill", "preempt") else self.nodes


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


def rallypoint(
    kind: str,
    workdir: Path,
    limit: float,
    shape: Shape,
    memory: bool = True,
    in_place: bool = False,
    last_call: int = 2,
    hot_standby: bool = False,
    hot_join: bool = True,
) -> dict[str, Any]:
    storage = ["--storage", f"local:{workdir / 'storage'}"]
    coordinator = Coordinator(storage, log=workdir / "coordinator.log")
    with FakeImds() as imds:
        coordinator.start()
        cluster = Cluster(
            coordinator.url,
            f"rp-{kind}",
            workdir,
            nnodes=shape.nnodes,
            steps=10**6,
            step_time=STEP_TIME,
            heartbeat_timeout=3,
            last_call=last_call,
            imds_url=imds.url,
            checkpoint_every=10 if memory else 100,
            persist_every=10 if memory else 1,
            memory=workdir / "shm" if memory else None,
            in_place=in_place,
            standbys=1 if kind == "standby" else 0,
            hot_standby=hot_standby,
            hot_join=hot_join,
        )
        first: dict[str, Any] | None = None
        try:
            # A join starts with three nodes (``3:4``: the job runs without the fourth).
            cluster.start(*(shape.agents[:-1] if kind == "join" else shape.agents))
            cluster.wait_for(
                lambda e: e["event"] == "step" and e["step"] >= shape.warm, timeout=120
            )
            if kind == "standby":
                cluster.add(STANDBY)
                _parked(coordinator.url, cluster.job, limit)
                # Killed once a version begun STANDBY_SOAK s after it parked committed:
                # one the standby holds copies of, and its warm worker server has
                # imported torch (a standby waits for minutes in a real job; here four
                # training nodes take both CPUs, and the import takes seconds).
                _saved_since(coordinator.url, cluster.job, time.time() + STANDBY_SOAK, limit)
            world = shape.world_after(kind)
            generation = max(e["generation"] for e in cluster.events())
            if kind == "join":
                started = time.time()
                cluster.add(shape.agents[-1])
            else:
                victim = _member_of_rank(coordinator.url, cluster.job, shape.lost_rank)
                started = time.time()
                if kind == "worker":
                    os.kill(_worker_of_rank(cluster, shape.lost_rank), signal.SIGKILL)
                elif kind in ("kill", "standby"):
                    cluster.kill(victim)
                else:
                    imds.schedule(victim)
            later = restarted(world, started, lambda e: e["generation"] > generation)
            try:
                first = cluster.wait_for(later, timeout=limit)
                recovered: float | None = first["t"] - started
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
    # (In place only the newcomers' count: a survivor's process started long before.)
    spawned = [
        e["started"] - started for e in resumed if e.get("started") and not e.get("in_place")
    ]
    # The lost node's rank (2; one worker a node): for a standby, what it read, by source.
    taken = [e.get("bytes_from") or {} for e in resumed if e["rank"] == shape.lost_rank]
    storage = [(e.get("bytes_from") or {}).get("storage", 0) for e in resumed]
    peer = [(e.get("bytes_from") or {}).get("peer", 0) for e in resumed]
    return {
        "seconds": recovered,
        "workers_started": min(spawned) if spawned else None,
        "steps_lost": lost,
        "consistent": verdict.consistent,
        "replacement_bytes": (
            {k: sum(b.get(k, 0) for b in taken) for k in ("memory", "peer", "storage")}
            if taken
            else None
        ),
        "storage_bytes": sum(storage) if resumed else None,
        "peer_bytes": sum(peer) if resumed else None,
        "pause": _pause(events, first),
        # In place: who regrouped and who restarted, the phases, the bytes of each.
        "regroup": regroup(events, history, started, first) if in_place and first else None,
    }


def c10d(kind: str, workdir: Path, limit: float, shape: Shape) -> dict[str, Any]:
    script = workdir / "anchor.py"
    script.write_text(ANCHOR)
    events = workdir / f"c10d-{kind}.events.jsonl"
    cluster, port = anchor_cluster(
        workdir, f"c10d-{kind}", shape.nnodes, [str(script), str(events), str(STEP_TIME)], events
    )
    first: dict[str, Any] | None = None
    try:
        for node in shape.agents[:-1] if kind == "join" else shape.agents:
            cluster.add(node)
            if node == shape.agents[0]:
                # Every agent tries to host the store at the endpoint and the first to bind
                # it does: n0, once it listens, so that the node lost is never the host.
                listening(port, limit)
        # c10d's first round waits out its last call (30 s) for the fourth node of 3:4.
        cluster.wait_for(step_with(shape.nodes - (kind == "join")), timeout=120)
        cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= shape.warm, timeout=120)
        if kind == "standby":
            # c10d's spare: a node beyond max_nodes waits in its wait list.
            cluster.add(STANDBY)
            spare_at = time.time()
            cluster.wait_for(lambda e: e["event"] == "step" and e["t"] > spare_at + 5, timeout=120)
        victim = shape.agents[-1]  # not the store's host: that one takes the job down with it
        at_kill = max(e["step"] for e in cluster.events() if e["event"] == "step")
        started = time.time()
        if kind == "join":
            # The running agents see it waiting (their monitor polls c10d's count of
            # waiting nodes) and restart their workers into a round with it.
            cluster.add(victim)
        elif kind == "worker":
            # The anchor's workers log no pid: the agent's child that runs the script.
            for pid in descendants(cluster.agents[victim].proc.pid):
                with contextlib.suppress(OSError):
                    if b"anchor.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        os.kill(pid, signal.SIGKILL)
        elif kind in ("kill", "standby"):
            cluster.kill(victim)
        else:
            cluster.terminate(victim)
        world = shape.world_after(kind)
        try:
            # The anchor keeps no checkpoint: restarted workers count their steps from 0.
            later = restarted(world, started, lambda e: e["step"] < at_kill)
            first = cluster.wait_for(later, timeout=limit)
            recovered: float | None = first["t"] - started
        except TimeoutError:
            recovered = None
    finally:
        cluster.stop()
    return {
        "seconds": recovered,
        "workers_started": None,
        "steps_lost": None,
        "consistent": None,
        "pause": _pause(cluster.events(), first),
        # Why no step came: each agent's last error line (torchrun logs its own).
        "why": None if first else _last_errors([a.log for a in cluster.agents.values()]),
    }


def _last_errors(logs: list[Path]) -> list[str]:
    out = []
    for line in [log_lines([log], "Error") for log in logs]:
        if line:
            out.append(line[-1])
    return out


def _pause(events: list[dict[str, Any]], first: dict[str, Any] | None) -> float | None:
    """Rank 0's pause in steps: from its last step before ``first`` (the first at the
    new world size) to ``first``. For a join it is what the running nodes lose to the
    newcomer; after a kill it includes the detection."""
    if first is None:
        return None
    before = [e["t"] for e in events if e["event"] == "step" and e["t"] < first["t"]]
    return first["t"] - max(before) if before else None


def _worker_of_rank(cluster: Cluster, rank: int) -> int:
    """The pid of the worker that runs ``rank`` now (from its latest ``resumed`` event)."""
    resumed = [e for e in cluster.events() if e["event"] == "resumed" and e["rank"] == rank]
    return int(resumed[-1]["pid"])


def _member_of_rank(url: str, job: str, rank: int) -> str:
    import httpx

    members = httpx.get(f"{url}/v1/jobs/{job}", timeout=10).json()["members"]
    return str(next(m["node_id"] for m in members if m["rank"] == rank))


#: Seconds a standby stands by before the kill (see ``run``).
STANDBY_SOAK = 10.0


def _saved_since(url: str, job: str, since: float, limit: float) -> None:
    """Waits until the job has a version begun after ``since`` committed."""
    import httpx

    end = time.monotonic() + limit
    while time.monotonic() < end:
        versions = httpx.get(f"{url}/v1/jobs/{job}/checkpoints", timeout=10).json()
        if any(v["state"] == "committed" and v["created_at"] > since for v in versions):
            return
        time.sleep(0.1)
    raise TimeoutError(f"no version committed within {limit} s")


def _parked(url: str, job: str, limit: float) -> None:
    """Waits until the job shows a standby."""
    import httpx

    end = time.monotonic() + limit
    while time.monotonic() < end:
        waiting = httpx.get(f"{url}/v1/jobs/{job}", timeout=10).json()["waiting"]
        if any(w["standby"] for w in waiting):
            return
        time.sleep(0.1)
    raise TimeoutError(f"no standby parked within {limit} s")


def _history(url: str, job: str) -> list[dict[str, Any]]:
    import httpx

    history: list[dict[str, Any]] = httpx.get(f"{url}/v1/jobs/{job}", timeout=10).json()["history"]
    return history


def _runs(results: list[dict[str, Any]], limit: float) -> str:
    if not results:
        return "-"
    return (
        ", ".join(
            f"> {limit:.0f}" if r["seconds"] is None else f"{r['seconds']:.2f}" for r in results
        )
        + " s"
    )


# Which setups each family of ``--only`` runs, and the events each setup takes part in.
FAMILIES = {
    "rallypoint": ("rallypoint", "rallypoint-blob"),
    "rallypoint-in-place": (
        "rallypoint-in-place",
        "rallypoint-in-place-cold",
        "rallypoint-in-place-lc0",
        "rallypoint-in-place-hot",
    ),
    "c10d": ("c10d",),
}
KINDS = {
    "rallypoint": ("worker", "kill", "preempt", "join", "standby"),
    # A notice persists the emergency version either way; a newcomer reads the memory
    # tier of a peer, which blob storage only has no stand-in for.
    "rallypoint-blob": ("worker", "kill"),
    "rallypoint-in-place": ("worker", "kill", "join", "standby"),
    # last_call=0 seals the newcomer's generation at once: what the 2 s wait for more
    # newcomers costs a join.
    "rallypoint-in-place-lc0": ("join",),
    # hot_join=0: the generation ends as the newcomer joins (the default before 2026-11-28).
    "rallypoint-in-place-cold": ("join",),
    # hot_standby=1: the standby's worker starts at the park, and waits with its model
    # built in join() until the node is promoted.
    "rallypoint-in-place-hot": ("standby",),
    "c10d": ("worker", "kill", "preempt", "join", "standby"),
}
LABELS = {
    "worker": "SIGKILL of a worker (rank 2)",
    "kill": "SIGKILL of a node (rank 2)",
    "preempt": "preemption notice / SIGTERM",
    "join": "a node joins (3 -> 4)",
    "standby": "SIGKILL of a node, a standby (4)",
}


def _variant(label: str, runs: list[dict[str, Any]], limit: float) -> None:
    """Prints a variant of the in-place setup: its runs, and each one's phases."""
    if runs:
        print(f"  {label}: {_runs(runs, limit)}")
        for r in runs:
            if r.get("regroup"):
                print(f"    {format_regroup(r['regroup'])[0]}")


def _keep(tmp: Path, label: str) -> Path:
    """Copies a run's logs and events (not its checkpoints) to /tmp/bench-evidence: the
    temporary directory goes when the run ends."""
    out = Path("/tmp/bench-evidence") / f"{label}-{time.strftime('%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    for path in tmp.iterdir():
        if path.is_file() and path.suffix in (".log", ".jsonl"):
            shutil.copy(path, out / path.name)
    return out


def _failed(result: dict[str, Any]) -> bool:
    """A run worth keeping the logs of: no recovery, an inconsistent restore, or, in
    place, a survivor that came back as a new process."""
    report = result.get("regroup")
    return (
        result["seconds"] is None
        or result["consistent"] is False
        or (report is not None and not report["same_pids"])
    )


def _chaos(args: argparse.Namespace) -> int:
    os.environ[MEMORY_ENV] = ""
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp:
        result = chaos(
            Path(tmp),
            args.limit,
            rounds=args.rounds,
            seed=args.seed,
            step_time=STEP_TIME,
            nodes=args.nodes,
            warm=args.warm,
        )
        # Ten rounds of logs: kept whatever the outcome (a smoke run's only if it failed,
        # or every run of the suite would leave its own).
        kept = _keep(Path(tmp), "chaos") if result["failure"] or not args.smoke else None
    print(f"\nchaos, in place: {args.rounds} rounds, seed {args.seed} (logs kept in {kept})")
    for line in format_chaos(result):
        print(line)
    return 0 if result["failure"] is None else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=float, default=100, help="give up after this many s")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--only", choices=list(FAMILIES))
    parser.add_argument(
        "--kind", choices=[*LABELS, "chaos"], help="one event only (chaos: in place only)"
    )
    parser.add_argument("--rounds", type=int, default=10, help="chaos: kills and joins")
    parser.add_argument("--seed", type=int, default=0, help="chaos: which nodes die")
    parser.add_argument("--nodes", type=int, default=4, help="agents (--nnodes=NODES-1:NODES)")
    parser.add_argument("--warm", type=int, default=30, help="steps trained before the event")
    smoke = {"nodes": 2, "warm": 5, "rounds": 1, "limit": 60}
    args = parse(parser, smoke)
    # CPU workers, as above, on a machine with a GPU too: there the example would train on
    # it with NCCL, which refuses four ranks on one device.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.kind == "chaos":
        return _chaos(args)
    shape = Shape(args.nodes, args.warm)
    runners: dict[str, Callable[[str, Path, float, Shape], dict[str, Any]]] = {
        "rallypoint-in-place": lambda k, w, limit, s: rallypoint(k, w, limit, s, in_place=True),
        "rallypoint-in-place-cold": lambda k, w, limit, s: rallypoint(
            k, w, limit, s, in_place=True, hot_join=False
        ),
        "rallypoint-in-place-lc0": lambda k, w, limit, s: rallypoint(
            k, w, limit, s, in_place=True, last_call=0, hot_join=False
        ),
        "rallypoint-in-place-hot": lambda k, w, limit, s: rallypoint(
            k, w, limit, s, in_place=True, hot_standby=True
        ),
        "rallypoint": rallypoint,
        "rallypoint-blob": lambda k, w, limit, s: rallypoint(k, w, limit, s, memory=False),
        "c10d": c10d,
    }
    if args.only:
        runners = {k: v for k, v in runners.items() if k in FAMILIES[args.only]}
    runs = [
        (kind, name)
        for kind in ([args.kind] if args.kind else list(LABELS))
        for name in runners
        if kind in KINDS[name]
    ]
    if args.smoke and not (args.only or args.kind):
        # Rallypoint's path (in place) and the anchor's; the others are variants of these.
        runs = [("kill", "rallypoint-in-place"), ("kill", "c10d")]
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    failed = False
    for _ in range(args.repeat):
        for kind, name in runs:
            # Blob storage only: the agents give their workers no memory tier.
            os.environ[MEMORY_ENV] = "none" if name == "rallypoint-blob" else ""
            # A smoke run does not wait for the anchor, which may never recover.
            limit = min(args.limit, 10) if args.smoke and name == "c10d" else args.limit
            with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
                result = runners[name](kind, Path(tmp), limit, shape)
                # (In a smoke run the anchor's not recovering is no failure: see above.)
                if _failed(result) and not (args.smoke and name == "c10d"):
                    failed = True
                    result["evidence"] = str(_keep(Path(tmp), f"{name}-{kind}"))
            results.setdefault((kind, name), []).append(result)
            print(f"{kind:8} {name:10} {result}", file=sys.stderr, flush=True)

    print(
        f"\n{'event':30} {'in place':>18} {'rallypoint':>18} {'stock c10d':>18} {'steps lost':>11}"
    )
    for kind, label in LABELS.items():
        inplace = results.get((kind, "rallypoint-in-place"), [])
        ours = results.get((kind, "rallypoint"), [])
        theirs = results.get((kind, "c10d"), [])
        blob = results.get((kind, "rallypoint-blob"), [])
        if not (inplace or ours or theirs or blob):
            continue
        lost = [r["steps_lost"] for r in inplace + ours if r["steps_lost"] is not None]
        spawned = [r["workers_started"] for r in ours if r["workers_started"] is not None]
        # Every run, not a median: a run of the anchor may not recover at all.
        print(
            f"{label:30} {_runs(inplace, args.limit):>18} {_runs(ours, args.limit):>18} "
            f"{_runs(theirs, args.limit):>18} {max(lost) if lost else '-':>11}"
        )
        for r in inplace:
            report = r.get("regroup")
            lines = format_regroup(report) if report else ["no step at the new world size"]
            print(f"  in place, steps lost {r['steps_lost']}:")
            for line in lines:
                print(f"    {line}")
        if kind == "standby":
            hot = results.get((kind, "rallypoint-in-place-hot"), [])
            _variant("in place, a hot standby (hot_standby=1)", hot, args.limit)
        if kind == "join":
            cold = results.get((kind, "rallypoint-in-place-cold"), [])
            _variant("in place, a cold join (hot_join=0)", cold, args.limit)
            fast = results.get((kind, "rallypoint-in-place-lc0"), [])
            _variant("in place, hot_join=0 and last_call=0", fast, args.limit)
            for name, rs in (
                ("in place (defaults: a hot join)", inplace),
                ("in place, hot_join=0", cold),
                ("in place, hot_join=0, last_call=0", fast),
            ):
                pauses = [f"{r['pause']:.2f}" for r in rs if r.get("pause") is not None]
                if pauses:
                    print(f"  {name}: rank 0's pause in steps {', '.join(pauses)} s")
            for name, rs in (("rallypoint", ours), ("c10d", theirs)):
                pauses = [f"{r['pause']:.2f}" for r in rs if r.get("pause") is not None]
                if pauses:
                    print(f"  {name}: rank 0's pause in steps {', '.join(pauses)} s")
        if spawned:
            print(f"  rallypoint: new worker processes started after {min(spawned):.2f} s")
        read = [r["storage_bytes"] for r in ours if r.get("storage_bytes") is not None]
        peers = [r["peer_bytes"] for r in ours if r.get("peer_bytes") is not None]
        if kind != "preempt" and read:
            print(
                f"  rallypoint: new workers read {max(read)} bytes from storage, "
                f"{max(peers) if peers else 0} from peers"
            )
        hot_runs = results.get((kind, "rallypoint-in-place-hot"), [])
        for r in ours + inplace + hot_runs if kind == "standby" else []:
            if r.get("replacement_bytes"):
                b = r["replacement_bytes"]
                print(
                    f"  rallypoint: the standby's rank read {b['memory']} bytes from its "
                    f"memory, {b['peer']} from peers, {b['storage']} from storage"
                )
        if blob:
            blob_read = [r["storage_bytes"] for r in blob if r.get("storage_bytes") is not None]
            blob_lost = [r["steps_lost"] for r in blob if r["steps_lost"] is not None]
            print(
                f"  rallypoint, blob storage only: {_runs(blob, args.limit)}, "
                f"{max(blob_read) if blob_read else '-'} bytes from storage, "
                f"{max(blob_lost) if blob_lost else '-'} steps lost"
            )
        for name, rs in (("rallypoint", ours), ("in place", inplace)):
            if rs and not all(r["consistent"] for r in rs):
                print(f"  {name}: ranks resumed from different checkpoints after {kind}!")
        for r in theirs:
            if r.get("why"):
                print(
                    f"  c10d: no step at world {shape.world_after(kind)}, each agent's last error:"
                )
                for line in r["why"]:
                    print(f"    {line}")
        kept = [r["evidence"] for r in inplace + ours + theirs + blob if r.get("evidence")]
        if kept:
            print(f"  logs of failed runs: {', '.join(kept)}")
    if not args.smoke:
        return 0  # a setup that did not recover is a finding, shown above
    # The smoke run fails on any: there each setup recovers, or the bench broke.
    return max(1 if failed else 0, _chaos(args))


if __name__ == "__main__":
    sys.exit(main())
