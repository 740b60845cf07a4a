"""Rendezvous, side by side with torch's dynamic rendezvous on the c10d backend.

Three measurements, each against real coordinator processes (uvicorn):

1. rounds: N nodes (real ElasticClients, as threads of this process) join a job with
   min = max = N; the time from their common start until the last one holds its
   assignment. On local storage and on Azurite, and for torch's dynamic rendezvous
   (N handlers on one TCPStore, as threads of a subprocess) for the smaller N.
2. heartbeats: N members heartbeat once a second each for a while, on Azurite; the
   latency percentiles seen by the nodes and the coordinator's CPU.
3. failure detection: 4 node processes with heartbeat_timeout 3 s; one is SIGKILLed;
   the time until every survivor's heartbeat answered "restart".

Usage: python bench/rendezvous.py [--sizes 8,32,64,256,1024] [--torch-sizes 8,32,64]
       [--beat-nodes 1024] [--beat-seconds 60] [--only rounds|heartbeats|detection]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from rallypoint.client import CREDENTIAL_HEADER, ElasticClient, JobSpec  # noqa: E402
from tests._azurite import free_port, running_azurite  # noqa: E402
from tests._coordinator import Coordinator  # noqa: E402

TORCH_LIMIT_S = 120.0
WARM_S = 5.0  # heartbeats: the part of the run reported apart as warm-up


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spec(n: int, timeout: float = 30) -> JobSpec:
    return JobSpec(
        min_nodes=n,
        max_nodes=n,
        last_call=timedelta(0),
        heartbeat_timeout=timedelta(seconds=timeout),
        join_timeout=timedelta(seconds=600),
    )


THREADS_PER_PROCESS = 128


def _node_process(
    url: str, job: str, names: list[str], n: int, timeout: float, ready: Any, go: Any, out: Any
) -> None:
    """One process of simulated nodes: a thread and a real ElasticClient per node."""
    sys.setswitchinterval(0.0005)  # hundreds of threads: hand the GIL on quickly
    # One transport for the process's nodes (each still gets its own connection): an
    # httpx client per node would load the CA certificates once per node.
    shared = httpx.HTTPTransport(limits=httpx.Limits(max_connections=None))
    clients = [ElasticClient(url, job, name, http_transport=shared) for name in names]
    done: list[float] = []
    errors: list[str] = []

    def node(c: ElasticClient, port: int) -> None:
        go.wait()
        try:
            c.join("127.0.0.1", port, spec=spec(n, timeout))
            done.append(time.time())
        except Exception as exc:
            errors.append(repr(exc))

    threads = [
        threading.Thread(target=node, args=(c, 20000 + int(c.node_id[1:])), daemon=True)
        for c in clients
    ]
    for t in threads:
        t.start()
    ready.release()
    for t in threads:
        t.join()
    ranks = [(c.assignment.generation, c.assignment.rank) for c in clients if c.assignment]
    credentials = {c.node_id: c.credential for c in clients if c.credential}
    out.put((max(done, default=0.0), ranks, errors, credentials))


def join_round(url: str, job: str, n: int, timeout: float = 30) -> tuple[float, dict[str, str]]:
    """N nodes join at once; seconds from their common start until the last assignment,
    and each node's credential (by node id, in join order) for acting as it later.

    Nodes are threads spread over processes of at most 128 (real nodes are separate
    machines; a thousand threads in one process mostly measure its GIL).
    """
    ctx = multiprocessing.get_context("spawn")
    names = [f"n{i:04d}" for i in range(n)]
    groups = [names[i : i + THREADS_PER_PROCESS] for i in range(0, n, THREADS_PER_PROCESS)]
    ready, go, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_node_process, args=(url, job, g, n, timeout, ready, go, out))
        for g in groups
    ]
    for p in procs:
        p.start()
    for _ in procs:
        if not ready.acquire(timeout=300):
            raise RuntimeError("node processes did not start")
    start = time.time()
    go.set()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    errors = [e for _, _, errs, _ in results for e in errs]
    if errors:
        raise RuntimeError(f"{len(errors)} joins failed; first: {errors[0]}")
    ranks = sorted(r for _, rs, _, _ in results for r in rs)
    assert ranks == [(1, i) for i in range(n)], ranks[:5]
    credentials = {k: v for _, _, _, creds in results for k, v in creds.items()}
    assert sorted(credentials) == names, "a node joined without a credential"
    return max(t for t, _, _, _ in results) - start, {name: credentials[name] for name in names}


TORCH_ROUND = """
import sys, threading, time
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

n, port = int(sys.argv[1]), int(sys.argv[2])
master = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
handlers = []
for i in range(n):
    store = TCPStore("127.0.0.1", port, is_master=False)
    params = RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="bench", min_nodes=n,
        max_nodes=n, local_addr="127.0.0.1", join_timeout=3600,
    )
    handlers.append(create_handler(store, C10dRendezvousBackend(store, "bench"), params))
barrier = threading.Barrier(n + 1)
def node(h):
    barrier.wait()
    h.next_rendezvous()
threads = [threading.Thread(target=node, args=(h,), daemon=True) for h in handlers]
for t in threads:
    t.start()
barrier.wait()
start = time.perf_counter()
for t in threads:
    t.join()
print(time.perf_counter() - start, flush=True)
import os; os._exit(0)
"""


def torch_round(n: int) -> float | None:
    """torch's dynamic rendezvous (c10d backend) for N nodes; None past the limit."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", TORCH_ROUND, str(n), str(free_port())],
            capture_output=True,
            text=True,
            timeout=TORCH_LIMIT_S,
        )
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def bench_rounds(sizes: list[int], torch_sizes: list[int], azurite: str) -> None:
    print("\n## One rendezvous round (seconds, all N nodes assigned)")
    print(f"{'N':>6} {'local':>9} {'azurite':>9} {'torch c10d':>11}  c10d/local")
    backends = {
        "local": Coordinator(
            ["--storage", f"local:{ROOT / 'build' / f'rdzv-{uuid.uuid4().hex[:6]}'}"], {}
        ),
        "azurite": Coordinator(
            ["--storage", "azure"],
            {
                "AZURE_STORAGE_CONNECTION_STRING": azurite,
                "RALLYPOINT_STORAGE_PREFIX": "b" + uuid.uuid4().hex[:8],
            },
        ),
    }
    for coordinator in backends.values():
        coordinator.start()
    try:
        for n in sizes:
            row = {}
            for name, coordinator in backends.items():
                row[name], _ = join_round(coordinator.url, f"round-{n}", n)
            anchor = torch_round(n) if n in torch_sizes else None
            anchor_text = (
                f"{anchor:11.2f}"
                if anchor is not None
                else (f"{'>' + str(int(TORCH_LIMIT_S)):>11}" if n in torch_sizes else f"{'-':>11}")
            )
            ratio = f"{anchor / row['local']:10.1f}x" if anchor else ""
            print(
                f"{n:>6} {row['local']:9.2f} {row['azurite']:9.2f} {anchor_text}  {ratio}",
                flush=True,
            )
    finally:
        for coordinator in backends.values():
            coordinator.stop()


async def _beats(
    port: int, job: str, nodes: dict[str, str], generation: int, seconds: float
) -> tuple[list[tuple[float, float]], int, int]:
    """Each node (id to credential) sends one heartbeat a second on its own connection
    (raw HTTP/1.1, so the load generator costs little CPU), with its credential as the
    coordinator checks it; returns (seconds since the start, latency) per beat,
    restarts and errors."""
    loop = asyncio.get_running_loop()
    latencies: list[tuple[float, float]] = []
    restarts = errors = 0
    body = json.dumps({"generation": generation}).encode()
    start = loop.time() + 2.0
    end = start + seconds

    async def node(i: int, node_id: str, credential: str) -> None:
        nonlocal restarts, errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = (
            f"POST /v1/jobs/{job}/nodes/{node_id}/heartbeat HTTP/1.1\r\nHost: bench\r\n"
            f"{CREDENTIAL_HEADER}: {credential}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        at = start + i / len(nodes)  # spread evenly over each second
        while at < end:
            await asyncio.sleep(max(0.0, at - loop.time()))
            sent = loop.time()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            size = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
            payload = await reader.readexactly(size)
            latencies.append((sent - start, loop.time() - sent))
            if not head.startswith(b"HTTP/1.1 200"):
                errors += 1
            elif b'"restart"' in payload:
                restarts += 1
            at += 1.0
        writer.close()

    await asyncio.gather(*(node(i, n, c) for i, (n, c) in enumerate(nodes.items())))
    return latencies, restarts, errors


def bench_heartbeats(n: int, seconds: float, azurite: str) -> None:
    print(f"\n## Heartbeats: {n} nodes at 1 Hz for {seconds:.0f} s, Azurite")
    coordinator = Coordinator(
        ["--storage", "azure"],
        {
            "AZURE_STORAGE_CONNECTION_STRING": azurite,
            "RALLYPOINT_STORAGE_PREFIX": "hb" + uuid.uuid4().hex[:8],
        },
    ).start()
    try:
        # Nobody heartbeats while a thousand nodes join: the timeout must outlast that.
        _, nodes = join_round(coordinator.url, "beats", n, timeout=600)
        generation = 1
        assert coordinator.proc is not None
        cpu0, wall0 = cpu_seconds(coordinator.proc.pid), time.monotonic()
        latencies, restarts, errors = asyncio.run(
            _beats(coordinator.port, "beats", nodes, generation, seconds)
        )
        cpu = (cpu_seconds(coordinator.proc.pid) - cpu0) / (time.monotonic() - wall0)
        print(
            f"requests {len(latencies)} ({len(latencies) / seconds:.0f}/s), errors {errors}, "
            f"restarts {restarts}\ncoordinator CPU: {cpu * 100:.0f}% of one core"
        )
        # The first seconds also hold the end of the join round (a thousand long-polls
        # answered and closed) and a thousand connections opening: shown apart.
        for label, since in (("all", 0.0), (f"after the first {WARM_S:.0f} s", WARM_S)):
            window = [latency for at, latency in latencies if at >= since]
            q = statistics.quantiles(window, n=100)
            print(
                f"latency ms, {label}: p50 {q[49] * 1e3:.1f}, p99 {q[98] * 1e3:.1f}, "
                f"max {max(window) * 1e3:.1f}"
            )
    finally:
        coordinator.stop()


NODE = """
import sys, time
from datetime import timedelta
from rallypoint.client import ElasticClient, JobSpec
url, job, name, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
client = ElasticClient(url, job, name)
spec = JobSpec(min_nodes=n, max_nodes=n, last_call=timedelta(0),
               heartbeat_timeout=timedelta(seconds=3), join_timeout=timedelta(seconds=120))
client.join("127.0.0.1", spec=spec)
print("joined", flush=True)
with client.heartbeats() as beats:
    beats.restart.wait()
print("restart", time.time(), flush=True)
"""


def bench_detection(repeats: int, nodes: int = 4) -> None:
    print(f"\n## Failure detection: {nodes} node processes, heartbeat_timeout 3 s, SIGKILL one")
    coordinator = Coordinator(
        ["--storage", f"local:{ROOT / 'build' / f'detect-{uuid.uuid4().hex[:6]}'}"], {}
    ).start()
    results = []
    try:
        for r in range(repeats):
            job = f"detect-{r}"
            procs = [
                subprocess.Popen(
                    [sys.executable, "-c", NODE, coordinator.url, job, f"n{i}", str(nodes)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for i in range(nodes)
            ]
            for p in procs:
                assert p.stdout is not None and p.stdout.readline().strip() == "joined"
            time.sleep(2.0)  # let every node settle into its heartbeat rhythm
            victim = procs[r % nodes]
            killed = time.time()
            victim.send_signal(signal.SIGKILL)
            told = []
            for p in procs:
                if p is victim:
                    continue
                line = p.stdout.readline() if p.stdout else ""
                told.append(float(line.split()[1]) - killed)
                p.wait(30)
            victim.wait()
            results.append(max(told))
            print(
                f"round {r + 1}: every survivor told to restart after {max(told):.2f} s", flush=True
            )
    finally:
        coordinator.stop()
    print(f"median {statistics.median(results):.2f} s, max {max(results):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,32,64,256,1024")
    parser.add_argument("--torch-sizes", default="8,32,64")
    parser.add_argument("--beat-nodes", type=int, default=1024)
    parser.add_argument("--beat-seconds", type=float, default=60)
    parser.add_argument("--detect-repeats", type=int, default=5)
    parser.add_argument("--only", choices=["rounds", "heartbeats", "detection"])
    args = parser.parse_args()
    (ROOT / "build").mkdir(exist_ok=True)
    print(f"{os.cpu_count()} CPUs; coordinator, Azurite and the nodes share them")
    with running_azurite() as azurite:
        if args.only in (None, "rounds"):
            bench_rounds(
                [int(s) for s in args.sizes.split(",")],
                [int(s) for s in args.torch_sizes.split(",")],
                azurite,
            )
        if args.only in (None, "heartbeats"):
            bench_heartbeats(args.beat_nodes, args.beat_seconds, azurite)
    if args.only in (None, "detection"):
        bench_detection(args.detect_repeats)


if __name__ == "__main__":
    main()
