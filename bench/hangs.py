"""Hangs and stragglers: how soon a rank that makes no progress is found and the others
train again, rallypoint beside stock torchrun; how soon a straggler is named, replaced
or dropped; and what reporting progress costs.

Three torchrun agents, one CPU worker each (gloo), train the example CNN
(``trainer/examples/train_ddp.py``, images of 16 a side, 0.1 s of extra work a step),
``--nnodes=2:3``, each node with a memory tier of its own. Once the job trained ``--warm``
steps and the coordinator knows its hang limit, rank 1's worker hangs:

- ``sigstop``: SIGSTOP (a process stuck in a kernel call or on a hung GPU looks so);
- ``asleep``: its main thread sleeps for good while its other threads run on (a deadlock
  in Python; the example's ``--hang-file``).

Measured, from the events of rank 0 (another rank) and the coordinator's history:
*detection*, from the stop and from the job's last step (rank 0's, the last the job made
before it stalled) to the end of the generation, whose reason must name the hung node and
rank; *recovery*, from the end to the survivors' first step (rank 0's, in a later
generation). Setups:

- ``rallypoint``: ``rallypoint run`` (the workers restart, warm, for the new generation);
- ``in-place``: the same with ``train_ddp.py --in-place`` (the survivors regroup in
  their processes);
- ``torchrun``: stock ``python -m torch.distributed.run`` with the rallypoint backend
  (the plugin; the workers restart cold: each imports torch again);
- ``c10d``: the anchor, stock torchrun with its c10d rendezvous, whose workers (the same
  model and data, plain DDP, no checkpoints) build their gloo group with a timeout of
  ``--anchor-timeout`` s (gloo's default is 30 minutes, NCCL's 10): the survivors wait
  in their all-reduce until it passes. Its "end" is the first survivor's timeout error,
  its recovery the first step of a restarted worker; it is given the timeout and
  ``--limit`` s more, and a figure it did not reach prints as "> cap".

Each rallypoint setup runs ``--repeat`` times (a fresh coordinator and cluster each), the
anchor once; the table shows each figure's median and range.

Stragglers (``rallypoint run``): rank 1's worker is throttled (SIGSTOP 0.4 s of every
0.5 s: five times slower), and the job's pace is rank 0's steps/s before (over
``--pace-window`` s), during and after, as a ratio of before:

- ``report`` (the default policy): from the throttling to its naming (the coordinator's
  ``since`` of the straggler in the status' ``health.stragglers``); no other node may be
  named;
- ``replace``: ``straggler=replace`` with a standby parked beside the job: from the
  throttling to the generation's end (the straggler's node quarantined) and to the first
  step with the standby in its rank;
- ``drop``: ``straggler=drop``, no standby: the same, to the first step at world 2.

Overhead:

- ``loop``: the training loop of ``bench/checkpoint.py --mode loop`` (an MLP with Adam,
  ``--loop-mib`` MiB of state, one process) with progress reporting on
  (``rallypoint.trainer.report_steps()``: hooks on every optimizer's step and on the
  parameters' gradients, and one ``pwrite`` of its record a step, as under an agent) and
  off, alternating rounds of ``--loop-steps`` steps; steps/s and the cost per step (goal:
  <= 1% of steps/s). Also on the smallest such loop (one layer), where a step is
  shortest and the cost shows most.
- ``beats``: ``--beat-nodes`` members (a list: each size in turn; the load generator,
  bench/_loadgen.py) beat every ``--beat-interval`` s (1; an agent's default is 2.5 s,
  each beat held that long: ``--beat-holds 2.5``) on ``--beat-storage``, each beat
  carrying 8 ranks' progress (an agent of 8 workers) or none, alternating runs of
  ``--beat-seconds``; the
  coordinator's share of a core, its CPU per beat, the latency, the bytes on the wire
  per beat each way and the load generator's own share of a core (a run where it nears
  100% measures the load generator), and the ratios with and without progress (goal:
  within 1.1x).

``--smoke`` runs a hang in place and under the anchor (gloo timeout 5 s, not required to
recover) on two nodes, a straggler's throttling under ``report`` for a few seconds (not
required to be named), a few loop steps and a few seconds of beats of 8 members.

Usage::

    python bench/hangs.py [--only hangs|stragglers|loop|beats] [--repeat 3]
        [--setup rallypoint|in-place|torchrun|c10d] [--kind sigstop|asleep]
        [--policy report|replace|drop] [--anchor-timeout 60] [--limit 60]
        [--beat-nodes 1024,10000] [--beat-seconds 20] [--beat-storage azurite|local]
        [--beat-holds 1,0] [--beat-interval 1]
    python bench/hangs.py --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # last: its rallypoint/ folder must not hide an installed package

import httpx  # noqa: E402
from _c10d import anchor_cluster, listening  # noqa: E402
from _smoke import azurite, parse  # noqa: E402

from rallypoint.cli.processes import Cluster, Coordinator, Event, judge  # noqa: E402
from rallypoint.client.models import RankProgress  # noqa: E402
from rallypoint.tls import ssl_context  # noqa: E402
from tests._support import throttled  # noqa: E402

STEP_TIME = 0.1
IMAGE_SIZE = 16
#: The rank that hangs or straggles: not rank 0, whose steps the events record.
VICTIM = 1
STANDBY = "s0"
#: What each setup is called in the table.
SETUPS = {
    "rallypoint": "rallypoint run (workers restart, warm)",
    "in-place": "rallypoint run, in place",
    "torchrun": "stock torchrun + rallypoint plugin (cold)",
    "c10d": "stock torchrun, c10d",
}
KINDS = {"sigstop": "SIGSTOP of rank 1's worker", "asleep": "rank 1's main thread asleep"}
POLICIES = ("report", "replace", "drop")


@dataclass(frozen=True)
class Shape:
    """The job: ``nodes`` agents (``--nnodes=nodes-1:nodes``), trained to step ``warm``
    (and until the coordinator knows the hang limit) before the event."""

    nodes: int = 3
    warm: int = 30

    @property
    def agents(self) -> tuple[str, ...]:
        return tuple("abcdefgh"[i] for i in range(self.nodes))

    @property
    def nnodes(self) -> str:
        return f"{self.nodes - 1}:{self.nodes}"


class Job:
    """The coordinator's view of one job, over one connection."""

    def __init__(self, url: str, job: str) -> None:
        self.url, self.job = url, job
        # One client, and the package's TLS context: an httpx.get per poll would load
        # the CA bundle each time (54 ms of CPU here, beside the processes measured).
        self.http = httpx.Client(base_url=url, timeout=10, verify=ssl_context())

    def status(self) -> dict[str, Any]:
        reply = self.http.get(f"/v1/jobs/{self.job}")
        reply.raise_for_status()
        body: dict[str, Any] = reply.json()
        return body

    def until(self, what: Callable[[dict[str, Any]], Any], timeout: float) -> Any:
        """The first truthy ``what(status)``, polled every 0.1 s; None after ``timeout``."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            found = what(self.status())
            if found:
                return found
            time.sleep(0.1)
        return None

    def ended(self, generation: int, timeout: float) -> dict[str, Any] | None:
        """``generation``'s history entry once it ended (None: not within ``timeout``)."""

        def entry(s: dict[str, Any]) -> dict[str, Any] | None:
            h = s["history"]
            return (
                h[generation - 1]
                if len(h) >= generation and h[generation - 1].get("ended_reason")
                else None
            )

        found: dict[str, Any] | None = self.until(entry, timeout)
        return found

    def hang_report(self, generation: int, timeout: float = 15) -> dict[str, Any] | None:
        """The hang report of ``generation``, once its agent sent the stacks (or why not)."""
        end = time.monotonic() + timeout
        report: dict[str, Any] | None = None
        while time.monotonic() < end:
            reply = self.http.get(f"/v1/jobs/{self.job}/hangs/{generation}")
            if reply.status_code == 200:
                report = reply.json()
                if report and (report.get("taken_by") or report.get("stacks_error")):
                    break
            time.sleep(0.2)
        return report

    def close(self) -> None:
        self.http.close()


def _with_conf(cluster: Cluster, extra: str) -> None:
    """Adds ``extra`` to the cluster's ``--rdzv-conf``."""
    cluster.conf += f",{extra}"
    cluster.rdzv = [
        f"--rdzv-conf={cluster.conf}" if a.startswith("--rdzv-conf=") else a for a in cluster.rdzv
    ]


class Running:
    """A rallypoint job on a fresh coordinator: its cluster, the coordinator's view of
    it, and where a worker finds the pid its main thread is to sleep at
    (``--hang-file``)."""

    def __init__(self, name: str, workdir: Path, shape: Shape, setup: str, conf: str = "") -> None:
        self.shape, self.setup = shape, setup
        self.coordinator = Coordinator(
            ["--storage", f"local:{workdir / 'storage'}"], log=workdir / "coordinator.log"
        )
        self.cluster = Cluster(
            self.coordinator.url,  # (its port is chosen before it starts)
            name,
            workdir,
            nnodes=shape.nnodes,
            steps=10**6,
            step_time=STEP_TIME,
            memory=workdir / "memory",
            image_size=IMAGE_SIZE,
            in_place=setup == "in-place",
        )
        self.hang_file = workdir / "hang"
        self.cluster.script += ["--hang-file", str(self.hang_file)]
        if conf:
            _with_conf(self.cluster, conf)
        # Stock torchrun (not `rallypoint run`) with the same rendezvous flags.
        self.cluster.rallypoint = setup != "torchrun"
        self.job = Job(self.coordinator.url, name)

    def __enter__(self) -> Running:
        self.coordinator.start()
        try:
            # As one: a first round that holds them all however loaded the machine is.
            self.cluster.start(*self.shape.agents)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.job.close()
        self.cluster.stop()
        self.coordinator.stop()

    def warm(self, limit: float, after: int = 0) -> tuple[int, int, str]:
        """Waits until a generation after ``after`` of every node trained ``shape.warm``
        steps and the coordinator knows the hang limit; that generation, and the pid and
        node of rank :data:`VICTIM`'s worker in it."""
        cluster, n, end = self.cluster, self.shape.nodes, time.monotonic() + limit + 60
        while True:
            left = max(0.1, end - time.monotonic())
            first = cluster.wait_for(
                lambda e, a=after: (
                    e["event"] == "step" and e["world_size"] == n and e["generation"] > a
                ),
                timeout=left,
            )
            generation, enough = first["generation"], first["step"] + self.shape.warm
            cluster.wait_for(
                lambda e, g=generation, s=enough: (
                    e["event"] == "step" and e["generation"] >= g and e["step"] >= s
                ),
                timeout=left,
            )
            now = self.job.until(
                lambda s: s if (s.get("health") or {}).get("hang_limit") is not None else None,
                left,
            )
            if now is None:
                raise TimeoutError("the coordinator learned no hang limit")
            if now["generation"] == generation:
                break
            after = generation  # a generation followed meanwhile (a late node): its next
        node = next(m["node_id"] for m in now["members"] if m["rank"] == VICTIM)
        resumed = cluster.wait_for(
            lambda e: e["event"] == "resumed" and e["generation"] == generation
            and e["rank"] == VICTIM,
            timeout=left,
        )  # fmt: skip
        return generation, int(resumed["pid"]), node


def _steps(events: Sequence[Event], after: float = 0.0) -> list[Event]:
    return [e for e in events if e["event"] == "step" and e["t"] > after]


def _hang(pid: int, kind: str, hang_file: Path) -> None:
    if kind == "sigstop":
        os.kill(pid, signal.SIGSTOP)
    else:
        hang_file.write_text(str(pid))


def measure_hang(run: Running, kind: str, limit: float) -> dict[str, Any]:
    """Rank :data:`VICTIM`'s worker hangs (``kind``) in ``run``'s job: detection and
    recovery (see the module's docstring)."""
    cluster, job = run.cluster, run.job
    out: dict[str, Any] = {"stop_end": None, "last_end": None, "end_step": None}
    generation, pid, node = run.warm(limit)
    out["generation"] = generation
    stopped = time.time()
    _hang(pid, kind, run.hang_file)
    ended = job.ended(generation, limit)
    if ended is None:
        out["problem"] = f"generation {generation} did not end within {limit:.0f} s"
        return out
    reason = ended["ended_reason"]
    end = float(ended["ended_at"])
    last = max(e["t"] for e in _steps(cluster.events()) if e["t"] <= end)
    out.update(stop_end=end - stopped, last_end=end - last, reason=reason)
    if not reason.startswith(f"rank {VICTIM} on node {node} hung: "):
        out["problem"] = f"ended for another reason: {reason}"
    try:
        first = cluster.wait_for(
            lambda e: e["event"] == "step" and e["generation"] > generation, timeout=limit
        )
        out.update(end_step=first["t"] - end, world=first["world_size"])
    except TimeoutError:
        out["problem"] = f"no step after the end within {limit:.0f} s"
    report = job.hang_report(generation)
    if report is not None:
        out["idle"] = report["idle"]
        out["stacks"] = report.get("taken_by") or f"none: {report.get('stacks_error')}"
    verdict = judge(cluster.events(), job.status()["history"])
    if not verdict.consistent:
        out["problem"] = f"inconsistent: {verdict.problems}"
    return out


# The anchor's worker: the example's model and data at the same size, plain DDP, gloo
# with the timeout given, events like the example's (and its pid, and its timeout).
ANCHOR = textwrap.dedent(
    """
    import json, os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from rallypoint.trainer.examples.train_ddp import SmallCNN, synthetic_cifar
    events, step_time, timeout = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    size, hang = int(sys.argv[4]), sys.argv[5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    def event(name, **fields):
        line = {"t": time.time(), "event": name, "generation": 0, "rank": rank,
                "world_size": world, "pid": os.getpid(), **fields}
        with open(events, "a") as f:
            f.write(json.dumps(line) + "\\n")
    event("resumed")
    images, labels = synthetic_cifar(4096, 0, size)
    model = DistributedDataParallel(SmallCNN(image_size=size))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for step in range(10**9):
        i = torch.randint(0, 4096, (32,), generator=g)
        try:
            loss = nn.functional.cross_entropy(model(images[i]), labels[i])
            opt.zero_grad(); loss.backward(); opt.step()
        except Exception as exc:
            event("failed", step=step, error=str(exc).splitlines()[0][:200])
            raise
        time.sleep(step_time)
        if os.path.exists(hang) and open(hang).read().strip() == str(os.getpid()):
            while True:  # the main thread only
                time.sleep(3600)
        if rank == 0:
            event("step", step=step)
    """
)


def c10d_hang(kind: str, workdir: Path, shape: Shape, timeout: float, cap: float) -> dict[str, Any]:
    """One hang under the anchor: gloo's ``timeout``, and ``cap`` s in all from the stop."""
    script = workdir / "anchor.py"
    script.write_text(ANCHOR)
    events = workdir / "c10d.events.jsonl"
    hang_file = workdir / "hang"
    cluster, port = anchor_cluster(
        workdir, f"c10d-{kind}", shape.nnodes,
        [str(script), str(events), str(STEP_TIME), str(timeout), str(IMAGE_SIZE), str(hang_file)],
        events,
    )  # fmt: skip
    out: dict[str, Any] = {"stop_end": None, "last_end": None, "end_step": None}
    try:
        for node in shape.agents:
            cluster.add(node)
            if node == shape.agents[0]:
                listening(port, 60)  # the first agent hosts the store, as in recovery.py
        cluster.wait_for(
            lambda e: e["event"] == "step" and e["world_size"] == shape.nodes
            and e["step"] >= shape.warm,
            timeout=180,
        )  # fmt: skip
        resumed = [e for e in cluster.events() if e["event"] == "resumed"]
        before = {e["pid"] for e in resumed}
        pid = int([e for e in resumed if e["rank"] == VICTIM][-1]["pid"])
        stopped = time.time()
        _hang(pid, kind, hang_file)
        deadline = time.monotonic() + cap
        try:
            failed = cluster.wait_for(
                lambda e: e["event"] == "failed" and e["t"] > stopped, timeout=cap
            )
        except TimeoutError:
            return out
        last = max(e["t"] for e in _steps(cluster.events()) if e["t"] <= failed["t"])
        out.update(
            stop_end=failed["t"] - stopped, last_end=failed["t"] - last, error=failed["error"]
        )
        # All the anchor's workers restart: a step of a new process is the recovery.
        with contextlib.suppress(TimeoutError):
            first = cluster.wait_for(
                lambda e: e["event"] == "step" and e["pid"] not in before and e["t"] > stopped,
                timeout=max(0.1, deadline - time.monotonic()),
            )
            out.update(end_step=first["t"] - failed["t"], world=first["world_size"])
        if out["end_step"] is None:
            out["end_step_cap"] = stopped + cap - failed["t"]  # what was left of the cap
            out["keep"] = True  # its agents' logs say why
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)  # (cluster.stop()'s SIGKILL ends it either way)
        cluster.stop()
    return out


# --- stragglers ---------------------------------------------------------------------


def pace(events: Sequence[Event], start: float, end: float) -> float | None:
    """Rank 0's steps per second between ``start`` and ``end`` (None: too few steps)."""
    times = sorted(e["t"] for e in events if e["event"] == "step" and start <= e["t"] <= end)
    if len(times) < 3 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def measure_straggler(
    run: Running, policy: str, window: float, limit: float, throttle_s: float, after: int = 0
) -> dict[str, Any]:
    """Rank :data:`VICTIM`'s worker is throttled for ``throttle_s`` at most in ``run``'s
    job (its ``straggler`` policy ``policy``), once a generation after ``after`` trained:
    the naming, replacement or drop, and the pace (see the module's docstring)."""
    cluster, job, shape = run.cluster, run.job, run.shape
    out: dict[str, Any] = {"named": None, "ended": None, "stepped": None}
    generation, pid, node = run.warm(limit, after)
    if policy == "replace":
        cluster.add(STANDBY)
        parked = job.until(
            lambda s: any(w["node_id"] == STANDBY and w["standby"] for w in s["waiting"]), limit
        )
        if not parked:
            out["problem"] = "the standby did not park"
            return out
    start = time.time()
    time.sleep(window)
    throttle = time.time()
    out["before"] = pace(cluster.events(), start, throttle)
    with throttled(pid):
        if policy == "report":

            def named(s: dict[str, Any]) -> list[dict[str, Any]]:
                found: list[dict[str, Any]] = (s.get("health") or {}).get("stragglers", [])
                return found

            stragglers = job.until(named, throttle_s)
            until = time.time()
            if not stragglers:
                out["problem"] = f"no straggler named within {throttle_s:.0f} s"
            else:
                out["named"] = min(s["since"] for s in stragglers) - throttle
                wrong = [s["node_id"] for s in stragglers if s["node_id"] != node]
                if wrong:
                    out["problem"] = f"named {wrong} too (throttled: {node})"
        else:
            ended = job.ended(generation, throttle_s)
            if ended is None:
                out["problem"] = f"not acted on within {throttle_s:.0f} s of throttling"
                return out
            until = float(ended["ended_at"])
            out["ended"] = until - throttle
            out["reason"] = ended["ended_reason"]
            if not ended["ended_reason"].startswith(f"node {node} quarantined: straggler"):
                out["problem"] = f"ended for another reason: {ended['ended_reason']}"
    out["during"] = pace(cluster.events(), throttle, until)
    if policy != "report":
        world = shape.nodes if policy == "replace" else shape.nodes - 1
        first = cluster.wait_for(
            lambda e: e["event"] == "step" and e["generation"] > generation
            and e["world_size"] == world,
            timeout=limit,
        )  # fmt: skip
        out["stepped"] = first["t"] - throttle
        time.sleep(max(0.0, first["t"] + window - time.time()))
        out["after"] = pace(cluster.events(), first["t"], first["t"] + window)
        if policy == "replace":
            members = {m["node_id"]: m["rank"] for m in job.status()["members"]}
            if members.get(STANDBY) != VICTIM:
                out["problem"] = f"the standby did not take rank {VICTIM}: {members}"
    return out


# --- overhead -----------------------------------------------------------------------


def loop_overhead(mib: int, steps: int, block: int = 4) -> dict[str, Any]:
    """The training loop of bench/_loop.py with progress reporting on and off, in turn:
    blocks of ``block`` steps, off then on, then on then off, about ``steps`` steps of
    each. The first step of a block (which installs or removes the hooks) is not timed;
    each pair of blocks gives a ratio of their median steps, in wall and in this
    thread's CPU time, and the figures are the medians of those ratios. On a shared
    machine whole rounds' rates ranged 0.65-1.23x of each other with nothing changed:
    what pairs neighbouring steps outlasts the others' load better."""
    import torch
    from _loop import _Loop

    from rallypoint.trainer import report_steps
    from rallypoint.trainer.health import PROGRESS_ENV, reporter

    torch.set_num_threads(1)  # as a worker on this machine runs
    pairs = max(1, -(-steps // (block - 1)))
    walls: dict[str, list[float]] = {"off": [], "on": []}
    wall_ratios: list[float] = []
    cpu_ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-progress-") as folder:
        # Its record in a file, rewritten each step, as under an agent.
        os.environ[PROGRESS_ENV] = folder
        loop = _Loop(mib, ratio=10.0)
        try:
            for i in range(pairs + 1):  # the first pair warms both up
                timed: dict[str, tuple[float, float]] = {}
                for name in ("off", "on") if i % 2 else ("on", "off"):
                    if name == "on":
                        report_steps()
                    else:
                        reporter().close()
                    loop.step()
                    wall, cpu = [], []
                    for _ in range(block - 1):
                        w, c = time.perf_counter(), time.thread_time()
                        loop.step()
                        wall.append(time.perf_counter() - w)
                        cpu.append(time.thread_time() - c)
                    timed[name] = statistics.median(wall), statistics.median(cpu)
                    if i:
                        walls[name] += wall
                if i:
                    wall_ratios.append(timed["on"][0] / timed["off"][0])
                    cpu_ratios.append(timed["on"][1] / timed["off"][1])
            counted = reporter().record().step
        finally:
            reporter().close()
            os.environ.pop(PROGRESS_ENV, None)
    off = statistics.median(walls["off"])
    wall_ratio, cpu_ratio = statistics.median(wall_ratios), statistics.median(cpu_ratios)
    return {
        "mib": mib,
        "layers": len(list(loop.model.parameters())) // 2,
        "steps": len(walls["on"]),
        "step": off,
        # steps/s on over off: the inverse of the steps' time ratio
        "speed": 1 / wall_ratio,
        "cpu_speed": 1 / cpu_ratio,
        "cost_us": (wall_ratio - 1) * off * 1e6,
        "counted": counted,  # the steps the reporter counted: it ran
    }


def fixed_cost(blocks: int, block: int = 20) -> float:
    """Reporting's own CPU per step, in microseconds: a loop of almost nothing (one 8x8
    layer and Adam, a step of a fraction of a millisecond) with it on and off in turn,
    ``blocks`` blocks of ``block`` steps each, this thread's CPU time; the difference of
    the medians. What it costs a step of any size (its hooks, its record's writes)."""
    import torch

    from rallypoint.trainer import report_steps
    from rallypoint.trainer.health import PROGRESS_ENV, reporter

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(4, 8)

    def step() -> None:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    per: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="bench-progress-") as folder:
        os.environ[PROGRESS_ENV] = folder
        try:
            for _ in range(50):
                step()
            for i in range(blocks):
                for name in ("off", "on") if i % 2 else ("on", "off"):
                    if name == "on":
                        report_steps()
                    else:
                        reporter().close()
                    step()  # (installs its gradients' hooks: not timed)
                    cpu = time.thread_time()
                    for _ in range(block):
                        step()
                    per[name].append((time.thread_time() - cpu) / block)
        finally:
            reporter().close()
            os.environ.pop(PROGRESS_ENV, None)
    return (statistics.median(per["on"]) - statistics.median(per["off"])) * 1e6


#: An agent's beat of 8 workers: each rank's progress as its record reads.
PROGRESS = [
    RankProgress(rank=r, step=1200, idle=0.04, interval=0.11, own=0.08, process="running")
    for r in range(8)
]


def beats_overhead(
    n: int,
    seconds: float,
    rounds: int,
    holds: list[float],
    storage: str,
    conn: str,
    profile: bool = False,
    interval: float = 1.0,
) -> list[dict[str, Any]]:
    """``n`` loadgen members beat every ``interval`` s, with 8 ranks' progress and
    without, in alternating runs of ``seconds`` (``rounds`` of each per hold); with
    ``profile``, the coordinator under py-spy in each run (as ``bench/rendezvous.py
    --profile``)."""
    import _loadgen
    from _loadgen import Loadgen
    from rendezvous import WARM_S, Profile, coordinator_for, cpu_seconds, running
    from rendezvous import spec as job_spec

    _loadgen.raise_nofile(n)
    (ROOT / "build").mkdir(exist_ok=True)  # local storage and profiles go there
    rows: list[dict[str, Any]] = []
    with running(coordinator_for(storage, conn)) as (coordinator, pid):

        async def main() -> None:
            gen = Loadgen("127.0.0.1", coordinator.port, "beats", n)
            await gen.connect()
            await gen.join(job_spec(n, timeout=60), waves=(256, 3.0))
            for hold in holds:
                for _ in range(rounds):
                    for ranks in (0, 8):
                        label = f"beats-{n}-hold{hold:g}-{ranks}ranks-{storage}"
                        spy = Profile(pid, label, profile)
                        cpu0, wall0 = cpu_seconds(pid), time.monotonic()
                        beats = await gen.heartbeats(
                            seconds,
                            interval=timedelta(seconds=interval),
                            hold=timedelta(seconds=hold),
                            progress=PROGRESS[:ranks],
                        )
                        wall = time.monotonic() - wall0
                        cpu = cpu_seconds(pid) - cpu0
                        spy.stop()
                        warm = [lat for at, lat in beats.samples if at >= WARM_S]
                        window = warm if len(warm) >= 2 else [lat for _, lat in beats.samples]
                        q = statistics.quantiles(window, n=100) if len(window) >= 2 else [0.0] * 99
                        rows.append(
                            {
                                "hold": hold,
                                "ranks": ranks,
                                "beats": len(beats.samples),
                                "restarts": beats.restarts,
                                "core": cpu / wall,
                                "cpu_us": cpu / max(1, len(beats.samples)) * 1e6,
                                "p50": q[49] * 1e3,
                                "p99": q[98] * 1e3,
                                "up": beats.sent / max(1, len(beats.samples)),
                                "down": beats.received / max(1, len(beats.samples)),
                                "loadgen": beats.loadgen_cpu / wall,
                            }
                        )
            gen.close()

        _loadgen.run(main())
    return rows


# --- the tables ---------------------------------------------------------------------


def _spread(values: Sequence[float | None], cap: float | None = None) -> str:
    """The median and range of ``values`` (None: not reached; ``> cap`` if given)."""
    got = sorted(v for v in values if v is not None)
    missed = len(values) - len(got)
    if not got:
        return f"> {cap:.0f}" if cap is not None else "-"
    text = f"{statistics.median(got):.2f}"
    if len(got) > 1:
        text += f" ({got[0]:.2f}-{got[-1]:.2f})"
    if missed:
        text += f", {missed} > {cap:.0f}" if cap is not None else f", {missed} missed"
    return text


def print_hangs(
    results: dict[tuple[str, str], list[dict[str, Any]]], shape: Shape, timeout: float, cap: float
) -> None:
    print(
        f"\n## Hangs: {shape.nodes} nodes of one CPU worker (gloo), images {IMAGE_SIZE}, "
        f"{STEP_TIME} s of extra work a step; seconds, median (range)"
    )
    print(f"{'':46} {'stop -> end':>22} {'last step -> end':>22} {'end -> step':>22}  runs")
    for kind, label in KINDS.items():
        rows = [(s, results[(kind, s)]) for s in SETUPS if (kind, s) in results]
        if not rows:
            continue
        print(label)
        for setup, runs in rows:
            name = SETUPS[setup] + (f" (gloo timeout {timeout:.0f} s)" if setup == "c10d" else "")
            limit = cap if setup == "c10d" else None
            left = max((r.get("end_step_cap", 0.0) for r in runs), default=0.0) or limit
            print(
                f"  {name:44} {_spread([r['stop_end'] for r in runs], limit):>22} "
                f"{_spread([r['last_end'] for r in runs], limit):>22} "
                f"{_spread([r['end_step'] for r in runs], left):>22}  {len(runs)}"
            )
            idle = [r["idle"] for r in runs if r.get("idle") is not None]
            if idle:
                stacks = sorted({r["stacks"] for r in runs if r.get("stacks")})
                print(
                    f"    the coordinator's 'no progress for': {_spread(idle)} s; "
                    f"stacks: {', '.join(stacks) or 'none'}"
                )
            for r in runs:
                if r.get("error"):
                    print(f"    the survivors' error: {r['error']}")
                if r.get("kept"):
                    print(f"    no step within the cap: its logs are in {r['kept']}")
                if r.get("problem"):
                    print(f"    problem: {r['problem']}")


def print_stragglers(results: dict[str, list[dict[str, Any]]], window: float) -> None:
    print(
        "\n## Stragglers: rank 1's worker stopped 0.4 s of every 0.5 s; seconds from the "
        f"throttling, median (range); pace: rank 0's steps/s over {window:.0f} s, x before"
    )
    print(
        f"{'policy':20} {'named':>20} {'generation ended':>20} {'first step after':>20} "
        f"{'before':>7} {'during':>7} {'after':>7}"
    )
    for policy in POLICIES:
        runs = results.get(policy)
        if not runs:
            continue

        def ratio(key: str, rs: list[dict[str, Any]] = runs) -> str:
            got = [r[key] / r["before"] for r in rs if r.get(key) and r.get("before")]
            return f"{statistics.median(got):.2f}x" if got else "-"

        before = [r["before"] for r in runs if r.get("before")]
        label = {
            "report": "report",
            "replace": "replace, a standby",
            "drop": "drop, no standby",
        }[policy]
        print(
            f"{label:20} {_spread([r['named'] for r in runs]):>20} "
            f"{_spread([r['ended'] for r in runs]):>20} "
            f"{_spread([r['stepped'] for r in runs]):>20} "
            f"{statistics.median(before) if before else 0:7.2f} {ratio('during'):>7} "
            f"{ratio('after'):>7}"
        )
        for r in runs:
            if r.get("problem"):
                print(f"    problem: {r['problem']}")


def print_loop(rows: list[dict[str, Any]], fixed_us: float) -> None:
    print("\n## Progress reporting in the training loop (bench/_loop.py, one process)")
    print(
        f"{'loop':30} {'steps':>6} {'step ms':>8} {'steps/s on/off':>15} {'CPU':>6} "
        f"{'per step':>10}"
    )
    for r in rows:
        label = f"{r['mib']} MiB of state, {r['layers']} layers"
        print(
            f"{label:30} {r['steps']:6} {r['step'] * 1e3:8.1f} {r['speed']:15.3f} "
            f"{r['cpu_speed']:6.3f} {r['cost_us']:7.0f} us"
        )
    print(
        "  (each of on and off that many steps, in neighbouring blocks; the medians of the "
        "blocks' ratios, in wall and in the loop's CPU time)"
    )
    shares = ", ".join(f"{fixed_us / r['step'] / 1e4:.2f}% of a step of the {r['mib']} MiB loop"
                       for r in rows)  # fmt: skip
    print(
        f"reporting's own CPU per step (a loop of one 8x8 layer, on and off in turn): "
        f"{fixed_us:.0f} us: {fixed_us / STEP_TIME / 1e4:.2f}% of a {STEP_TIME} s step, {shares}"
    )


def print_beats(rows: list[dict[str, Any]], n: int, storage: str, interval: float = 1.0) -> None:
    print(
        f"\n## Heartbeats: {n} members, one beat each every {interval:g} s, {storage}, with "
        "8 ranks' progress or none"
    )
    print(
        f"{'':34} {'beats':>7} {'coord % core':>12} {'CPU us/beat':>11} {'p50 ms':>7} {'p99 ms':>7}"
        f" {'B/beat up':>9} {'down':>5} {'loadgen % core':>14}"
    )
    for hold in sorted({r["hold"] for r in rows}, reverse=True):
        what = f"held {hold:g} s" if hold else "not held"
        for ranks in (0, 8):
            mine = [r for r in rows if r["hold"] == hold and r["ranks"] == ranks]
            label = f"{what}, {'8 ranks' if ranks else 'no progress'}"
            for r in mine:
                print(
                    f"{label:34} {r['beats']:7} {r['core'] * 100:12.0f} {r['cpu_us']:11.0f} "
                    f"{r['p50']:7.1f} {r['p99']:7.1f} {r['up']:9.0f} {r['down']:5.0f} "
                    f"{r['loadgen'] * 100:14.0f}"
                    + (f"  ({r['restarts']} restarts)" if r["restarts"] else "")
                )
        ratios = []
        for key in ("cpu_us", "p50", "p99"):
            with_ = [r[key] for r in rows if r["hold"] == hold and r["ranks"] == 8]
            without = [r[key] for r in rows if r["hold"] == hold and r["ranks"] == 0]
            if with_ and without and statistics.median(without) > 0:
                ratios.append(f"{key} {statistics.median(with_) / statistics.median(without):.2f}x")
        print(f"  {what}, 8 ranks / none (medians): {', '.join(ratios)}")


# --- main ---------------------------------------------------------------------------


def _keep(tmp: Path, label: str) -> Path:
    """Copies a failed run's logs and events to /tmp/bench-evidence."""
    out = Path("/tmp/bench-evidence") / f"hangs-{label}-{time.strftime('%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    for path in tmp.iterdir():
        if path.is_file() and path.suffix in (".log", ".jsonl"):
            shutil.copy(path, out / path.name)
    return out


def _run(label: str, run: Callable[[Path], dict[str, Any]], required: bool) -> dict[str, Any]:
    """Runs one measurement in a temporary folder; keeps its logs if it failed."""
    with tempfile.TemporaryDirectory(prefix=f"bench-hangs-{label}-") as tmp:
        try:
            result = run(Path(tmp))
        except TimeoutError as exc:
            result = {"problem": str(exc).splitlines()[0]}
        result.setdefault("problem", None)
        if result["problem"] and required:
            result["problem"] += f" (logs kept in {_keep(Path(tmp), label)})"
        elif result.pop("keep", False):
            result["kept"] = str(_keep(Path(tmp), label))
    shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    print(f"{label:24} {shown}", file=sys.stderr, flush=True)
    return result


#: What ``--smoke`` sets (``bench/_smoke.py``).
SMOKE = {
    "nodes": 2,
    "warm": 12,
    "repeat": 1,
    "setup": "in-place,c10d",
    "kind": "sigstop",
    "policy": "report",
    "anchor_timeout": 5.0,
    "limit": 20.0,
    "pace_window": 1.0,
    "throttle_limit": 2.0,
    "anchor_cap": 1.0,
    "loop_mib": 1,
    "loop_steps": 5,
    "beat_nodes": "8",
    "beat_seconds": 1.0,
    "beat_rounds": 1,
    "beat_holds": "1",
    "beat_interval": 1.0,
    "beat_storage": "local",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["hangs", "stragglers", "loop", "beats"])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each rallypoint setup")
    parser.add_argument("--setup", default=",".join(SETUPS), help=f"of {', '.join(SETUPS)}")
    parser.add_argument("--kind", default=",".join(KINDS), help=f"of {', '.join(KINDS)}")
    parser.add_argument("--policy", default=",".join(POLICIES), help=f"of {', '.join(POLICIES)}")
    parser.add_argument("--nodes", type=int, default=3, help="agents (--nnodes=NODES-1:NODES)")
    parser.add_argument("--warm", type=int, default=30, help="steps trained before the event")
    parser.add_argument("--limit", type=float, default=60, help="give up a wait after this many s")
    parser.add_argument(
        "--anchor-timeout", type=float, default=60, help="the anchor's gloo timeout (s)"
    )
    parser.add_argument("--pace-window", type=float, default=10, help="stragglers: s of steps")
    parser.add_argument(
        "--throttle-limit", type=float, default=90, help="stragglers: s of throttling at most"
    )
    parser.add_argument(
        "--anchor-cap", type=float, default=90, help="s the anchor is given past its timeout"
    )
    parser.add_argument("--loop-mib", type=int, default=96, help="the loop's state (as documented)")
    parser.add_argument("--loop-steps", type=int, default=150, help="timed steps on, and off")
    parser.add_argument("--beat-nodes", default="1024", help="members, e.g. 1024,10000")
    parser.add_argument("--beat-seconds", type=float, default=20)
    parser.add_argument("--beat-rounds", type=int, default=2, help="runs of each, alternating")
    parser.add_argument("--beat-holds", default="1,0")
    parser.add_argument(
        "--beat-interval",
        type=float,
        default=1.0,
        help="s between a member's beats (an agent's: a quarter of heartbeat_timeout, 2.5)",
    )
    parser.add_argument("--beat-storage", default="azurite", choices=["local", "azurite"])
    parser.add_argument(
        "--profile", action="store_true", help="beats: the coordinator under py-spy (build/)"
    )
    args = parse(parser, SMOKE)
    # CPU workers, as above, on a machine with a GPU too (NCCL refuses 3 ranks on one).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    shape = Shape(args.nodes, args.warm)
    setups = [s for s in args.setup.split(",") if s]
    kinds = [k for k in args.kind.split(",") if k]
    policies = [p for p in args.policy.split(",") if p]
    for given, known in ((setups, SETUPS), (kinds, KINDS), (policies, POLICIES)):
        if unknown := set(given) - set(known):
            parser.error(f"unknown: {sorted(unknown)}")
    failed = False
    cap = args.anchor_timeout + args.anchor_cap
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start")

    def hang(workdir: Path, kind: str, setup: str) -> dict[str, Any]:
        if setup == "c10d":
            result = c10d_hang(kind, workdir, shape, args.anchor_timeout, cap)
            if args.smoke:  # its few seconds are not meant to see it recover
                result.pop("keep", None)
            return result
        with Running(f"hang-{setup}-{kind}", workdir, shape, setup) as run:
            result = measure_hang(run, kind, args.limit)
            if args.smoke and not result.get("problem"):
                # The stragglers' path too, on the same job: a cluster of its own costs
                # its start, and the smoke run is part of every test run.
                result["straggler"] = measure_straggler(
                    run,
                    "report",
                    args.pace_window,
                    args.limit,
                    args.throttle_limit,
                    after=result["generation"],
                )
        return result

    def straggle(workdir: Path, policy: str) -> dict[str, Any]:
        conf = f"straggler={policy}" + (",standbys=1" if policy == "replace" else "")
        with Running(f"straggler-{policy}", workdir, shape, "rallypoint", conf) as run:
            return measure_straggler(run, policy, args.pace_window, args.limit, args.throttle_limit)

    stragglers: dict[str, list[dict[str, Any]]] = {}
    if args.only in (None, "hangs"):
        hangs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for i in range(args.repeat):
            for kind in kinds:
                for setup in setups:
                    if setup == "c10d" and i:
                        continue  # the anchor once: it waits out its timeout
                    result = _run(
                        f"{kind}-{setup}",
                        lambda w, k=kind, s=setup: hang(w, k, s),
                        setup != "c10d",
                    )
                    # (The anchor's not recovering within its cap is a finding, not a failure.)
                    failed |= bool(result["problem"]) and setup != "c10d"
                    hangs.setdefault((kind, setup), []).append(result)
                    if "straggler" in result:
                        stragglers.setdefault("report", []).append(result["straggler"])
        print_hangs(hangs, shape, args.anchor_timeout, cap)

    if args.only in (None, "stragglers") and not (args.smoke and stragglers):
        for _ in range(args.repeat):
            for policy in policies:
                result = _run(
                    f"straggler-{policy}", lambda w, p=policy: straggle(w, p), not args.smoke
                )
                # A smoke run throttles for seconds only: naming takes three 5 s windows.
                failed |= bool(result["problem"]) and not args.smoke
                stragglers.setdefault(policy, []).append(result)
    if stragglers:
        print_stragglers(stragglers, args.pace_window)

    if args.only in (None, "loop"):
        sizes = sorted({args.loop_mib, 1}, reverse=True)
        loops = [loop_overhead(m, args.loop_steps) for m in sizes]
        print_loop(loops, fixed_cost(args.loop_steps))

    if args.only in (None, "beats"):
        holds = [float(h) for h in args.beat_holds.split(",")]
        for n in (int(n) for n in str(args.beat_nodes).split(",")):
            with azurite() if args.beat_storage == "azurite" else contextlib.nullcontext("") as c:
                rows = beats_overhead(
                    n,
                    args.beat_seconds,
                    args.beat_rounds,
                    holds,
                    args.beat_storage,
                    c,
                    args.profile,
                    args.beat_interval,
                )
            print_beats(rows, n, args.beat_storage, args.beat_interval)
            failed |= any(r["restarts"] for r in rows)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
