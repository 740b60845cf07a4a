"""A storage outage in the deployed shape, beside the same run without one.

N members heartbeat once a second through HAProxy (health-checking ``/readyz``) in front
of R coordinator replicas on one Azurite, and one more node saves a checkpoint every
second (begin, upload through its signed URL, report: the commit). In the outage run
Azurite is frozen (SIGSTOP) for ``--outage`` seconds after ``--before`` seconds, then
resumed and watched for ``--after`` seconds; the anchor run is the same without the
freeze, on a fresh topology. Printed: answers "restart" and generations ended (goal 0),
heartbeat latency outside the outage in both runs and their ratio (goal within 10%),
what the members saw during the outage, and the seconds from Azurite's resumption until a
checkpoint commits again (goal 5 s).

Usage: python bench/outage.py [--nodes 256] [--replicas 2] [--outage 30]
       [--before 15] [--after 30] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # last: its rallypoint/ folder must not hide an installed package
sys.path.insert(0, str(ROOT / "bench"))

import _loadgen  # noqa: E402
import httpx  # noqa: E402
from _loadgen import Beats, Loadgen  # noqa: E402

from bench._smoke import parse  # noqa: E402
from rallypoint.client import ElasticClient, JobSpec, ShardFile  # noqa: E402
from rallypoint.trainer import upload  # noqa: E402
from tests._azurite import Azurite  # noqa: E402
from tests._balancer import Balancer  # noqa: E402
from tests._coordinator import Coordinator  # noqa: E402

FILE = "shard.safetensors"


@dataclass
class Run:
    beats: Beats = field(default_factory=Beats)
    commits: list[float] = field(default_factory=list)  # wall-clock seconds
    ended: int = 0
    #: The outage, in the beats' time (seconds since the first beat) and wall-clock.
    frozen: tuple[float, float] | None = None
    thawed_at: float = 0.0


async def members(
    host: str, port: int, job: str, n: int, seconds: float, begin: Callable[[], None]
) -> Beats:
    """N nodes join through the balancer and heartbeat once a second for ``seconds``
    (bench/_loadgen.py: one asyncio process, the client's bytes on the wire), as plain
    beats; ``begin`` runs as the beats start."""
    nodes = Loadgen(host, port, job, n)
    try:
        await nodes.connect()
        await nodes.join(JobSpec(min_nodes=n, max_nodes=n, last_call=timedelta(0)))
        begin()
        return await nodes.heartbeats(seconds)
    finally:
        nodes.close()


def checkpoints(url: str, run: Run, stop: threading.Event) -> None:
    """One node saves a checkpoint each second; the client retries 503s on its own."""
    node = ElasticClient(url, "saver", "saver")
    node.join(spec=JobSpec(min_nodes=1, max_nodes=1, last_call=timedelta(0)))
    with node.heartbeats():
        _save_each_second(node, run, stop)


def _save_each_second(node: ElasticClient, run: Run, stop: threading.Event) -> None:
    step = 0
    while not stop.is_set():
        step += 1
        try:
            begun = node.begin_checkpoint(step, [FILE])
            data = os.urandom(4096)
            upload(begun.upload_urls[FILE], data)
            info = node.report_checkpoint(
                begun.version, [ShardFile(name=FILE, size=len(data), checksum="xxh3-128:0")]
            )
            if info.state == "committed":
                run.commits.append(time.time())
        except Exception as exc:
            print(f"  checkpoint of step {step}: {type(exc).__name__}: {exc}")
        stop.wait(1.0)


def one_run(args: argparse.Namespace, freeze: bool) -> Run:
    azurite = Azurite()
    assert azurite.start(), azurite.log.read_text()
    env = {"AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string}
    replicas = [Coordinator(["--storage", "azure"], env=env) for _ in range(args.replicas)]
    balancer: Balancer | None = None
    run = Run()
    stop = threading.Event()
    try:
        for replica in replicas:
            replica.start()
        balancer = Balancer([f"127.0.0.1:{r.port}" for r in replicas]).start()
        url, job = balancer.url, "outage" if freeze else "steady"
        saver = threading.Thread(target=checkpoints, args=(url, run, stop))
        saver.start()
        beats_start = 0.0

        def outage() -> None:
            time.sleep(args.before)
            azurite.freeze()
            frozen_at = time.monotonic() - beats_start
            time.sleep(args.outage)
            azurite.thaw()
            run.thawed_at = time.time()
            run.frozen = (frozen_at, time.monotonic() - beats_start)

        freezer = threading.Thread(target=outage)

        def begin() -> None:
            nonlocal beats_start
            beats_start = time.monotonic() + 0.5  # heartbeats() starts half a second on
            if freeze:
                freezer.start()

        total = args.before + args.outage + args.after
        run.beats = _loadgen.run(members("127.0.0.1", balancer.port, job, args.nodes, total, begin))
        if freeze:
            freezer.join()
        stop.set()
        saver.join()
        history = httpx.get(f"{url}/v1/jobs/{job}", timeout=30).json()["history"]
        run.ended = sum(1 for g in history if g["ended_at"] is not None)
    finally:
        stop.set()
        if balancer is not None:
            balancer.stop()
        for replica in replicas:
            replica.stop()
        azurite.stop()
    return run


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def outside(run: Run) -> list[float]:
    """Latencies of the beats sent outside the outage (all of them without one)."""
    if run.frozen is None:
        return [s for _, s in run.beats.samples]
    start, end = run.frozen
    return [s for t, s in run.beats.samples if t < start or t > end]


def report(steady: Run, outage: Run) -> dict[str, Any]:
    assert outage.frozen is not None
    start, end = outage.frozen
    during = [s for t, s in outage.beats.samples if start <= t <= end]
    again = [t - outage.thawed_at for t in outage.commits if t > outage.thawed_at]
    p99 = [percentile(outside(r), 0.99) * 1000 for r in (steady, outage)]
    return {
        "answers restart (steady, outage)": [steady.beats.restarts, outage.beats.restarts],
        "generations ended (steady, outage)": [steady.ended, outage.ended],
        "beats (steady, outage)": [len(steady.beats.samples), len(outage.beats.samples)],
        "p50 ms (steady; outage run, outside the outage)": [
            round(percentile(outside(r), 0.5) * 1000, 1) for r in (steady, outage)
        ],
        "p99 ms (same)": [round(p, 1) for p in p99],
        "p99 ratio (outage run / steady)": round(p99[1] / p99[0], 2),
        "p99 ms of the outage run before it, and after it": [
            round(percentile([s for t, s in outage.beats.samples if t < start], 0.99) * 1000, 1),
            round(percentile([s for t, s in outage.beats.samples if t > end], 0.99) * 1000, 1),
        ],
        "beats answered during the outage": len(during),
        "p99 ms during the outage": round(percentile(during, 0.99) * 1000, 1),
        "seconds until a checkpoint commits after it": round(again[0], 2) if again else None,
    }


def bench_outage(
    nodes: int = 256, replicas: int = 2, outage: float = 30, before: float = 15, after: float = 30
) -> dict[str, Any]:
    """The outage run and its anchor (see the module docstring); prints and returns the
    figures. ``bench/rendezvous.py --only outage`` runs it too."""
    args = argparse.Namespace(
        nodes=nodes, replicas=replicas, outage=outage, before=before, after=after
    )
    print(f"outage: {nodes} members at 1 Hz, {replicas} replicas behind HAProxy, Azurite")
    figures = report(one_run(args, freeze=False), one_run(args, freeze=True))
    for key, value in figures.items():
        print(f"  {key}: {value}")
    return figures


#: What ``--smoke`` sets (``bench/_smoke.py``): a few members, one replica behind the
#: balancer, a second of each phase.
SMOKE = {"nodes": 4, "replicas": 1, "outage": 1.0, "before": 1.0, "after": 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--outage", type=float, default=30)
    parser.add_argument("--before", type=float, default=15)
    parser.add_argument("--after", type=float, default=30)
    args = parse(parser, SMOKE)
    bench_outage(args.nodes, args.replicas, args.outage, args.before, args.after)


if __name__ == "__main__":
    main()
