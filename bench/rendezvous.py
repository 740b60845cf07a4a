"""Rendezvous, side by side with torch's dynamic rendezvous on the c10d backend.

Each part runs against a fresh real coordinator process (uvicorn), on local storage or
on Azurite:

1. rounds: N nodes join a job with min = max = N; the time from the first join until
   the last node holds its assignment, and the CPU seconds the coordinator, Azurite and
   the simulated nodes used meanwhile. Nodes are real ElasticClients (threads of
   processes of 128) for ``--client-sizes``, and the load generator (bench/_loadgen.py:
   one asyncio process, a keep-alive connection per node, the client's bytes on the
   wire) for ``--sizes``; a size in both is measured both ways. torch's dynamic
   rendezvous (N handlers on one TCPStore, as threads of a subprocess) for
   ``--torch-sizes``. Each row ends with what held the round: the coordinator, the
   nodes (the load generator) or Azurite, whichever used 80% of a core or more over
   it, or none (the round waited).
2. transports: the load generator's CPU per request on raw HTTP/1.1 streams and on
   httpx's AsyncClient, beside the coordinator's.
3. heartbeats: N members beat once a second, each held for ``--beat-holds`` seconds
   (1: as ElasticClient.heartbeats() does at a 1 s interval; 0: plain beats); latency
   percentiles seen by the nodes, and CPU.
4. failure detection: 4 node processes with heartbeat_timeout 3 s; one is SIGKILLed;
   the time until every survivor's heartbeat answered "restart".
5. outage (bench/outage.py): 256 members at 1 Hz through HAProxy to 2 replicas on
   Azurite, Azurite frozen 30 s, beside the same run without the freeze.

The bench raises RLIMIT_NOFILE for a connection per node if it must (the coordinator
inherits it). ``--profile`` records the coordinator with py-spy in each loadgen round
and heartbeat run (build/profile-*.txt) and prints the functions with the most samples.

``--smoke`` runs every part but the outage (``bench/outage.py --smoke`` runs that) with a
few nodes, and fails if a round fails.

Usage: python bench/rendezvous.py [--sizes 256,1024,4096,10000]
       [--client-sizes 8,32,64,256] [--torch-sizes 8,32,64] [--storages local,azurite]
       [--beat-nodes 2048] [--beat-seconds 30] [--beat-holds 1,0] [--profile]
       [--only rounds|transports|heartbeats|detection|outage] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # last: its rallypoint/ folder must not hide an installed package
sys.path.insert(0, str(ROOT / "bench"))

import _loadgen  # noqa: E402
import httpx  # noqa: E402
from _loadgen import Beats, Loadgen, LoadgenError, Round  # noqa: E402
from _smoke import azurite, parse  # noqa: E402

from rallypoint.cli.processes import descendants, free_port  # noqa: E402
from rallypoint.client import ElasticClient, JobSpec  # noqa: E402
from rallypoint.client.models import MAX_NODES_LIMIT  # noqa: E402
from tests._coordinator import Coordinator  # noqa: E402

TORCH_LIMIT_S = 120.0
WARM_S = 5.0  # heartbeats: the part of the run reported apart as warm-up


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spec(n: int, timeout: float = 30) -> JobSpec:
    fields: dict[str, Any] = {
        "min_nodes": n,
        "max_nodes": n,
        "last_call": timedelta(0),
        "heartbeat_timeout": timedelta(seconds=timeout),
        "join_timeout": timedelta(seconds=600),
    }
    if n > MAX_NODES_LIMIT:
        # Unchecked here: the coordinator's answer to a job this large is the result.
        return JobSpec.model_construct(**fields)
    return JobSpec(**fields)


THREADS_PER_PROCESS = 128


class _Recording(httpx.HTTPTransport):
    """Notes the size of every 200 reply to a join or a wait: the one with the assignment."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sizes: list[int] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if response.status_code == 200 and request.url.path.endswith(("/join", "/wait")):
            self.sizes.append(len(response.read()))
        return response


def _node_process(
    url: str, job: str, names: list[str], n: int, ready: Any, go: Any, out: Any
) -> None:
    """One process of simulated nodes: a thread and a real ElasticClient per node."""
    sys.setswitchinterval(0.0005)  # hundreds of threads: hand the GIL on quickly
    # One transport for the process's nodes (each still gets its own connection): an
    # httpx client per node would load the CA certificates once per node.
    shared = _Recording(limits=httpx.Limits(max_connections=None))
    clients = [ElasticClient(url, job, name, http_transport=shared) for name in names]
    done: list[float] = []
    errors: list[str] = []

    def node(c: ElasticClient, port: int) -> None:
        go.wait()
        try:
            c.join("127.0.0.1", port, spec=spec(n))
            done.append(time.time())
        except Exception as exc:
            errors.append(repr(exc))

    threads = [
        threading.Thread(target=node, args=(c, 20000 + int(c.node_id[1:])), daemon=True)
        for c in clients
    ]
    for t in threads:
        t.start()
    cpu = time.process_time()  # the threads wait for go: from here on, CPU is the round's
    ready.release()
    for t in threads:
        t.join()
    ranks = [(c.assignment.generation, c.assignment.rank) for c in clients if c.assignment]
    out.put((max(done, default=0.0), ranks, errors, time.process_time() - cpu, shared.sizes))


def join_round(url: str, job: str, n: int) -> tuple[float, float, float]:
    """N ElasticClients join at once; seconds from their common start until the last
    assignment, their processes' CPU seconds over that time, and the mean size of the
    reply that carried an assignment.

    Nodes are threads spread over processes of at most 128 (real nodes are separate
    machines; a thousand threads in one process mostly measure its GIL).
    """
    ctx = multiprocessing.get_context("spawn")
    names = [f"n{i:05d}" for i in range(n)]
    groups = [names[i : i + THREADS_PER_PROCESS] for i in range(0, n, THREADS_PER_PROCESS)]
    ready, go, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_node_process, args=(url, job, g, n, ready, go, out)) for g in groups
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
    errors = [e for _, _, errs, _, _ in results for e in errs]
    if errors:
        raise RuntimeError(f"{len(errors)} joins failed; first: {errors[0]}")
    ranks = sorted(r for _, rs, _, _, _ in results for r in rs)
    assert ranks == [(1, i) for i in range(n)], ranks[:5]
    sizes = [size for *_, sizes in results for size in sizes]
    assert len(sizes) == n, f"{len(sizes)} assignments for {n} nodes"
    seconds = max(t for t, *_ in results) - start
    return seconds, sum(cpu for *_, cpu, _ in results), sum(sizes) / n


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


def coordinator_for(storage: str, azurite: str) -> Coordinator:
    """A fresh coordinator on ``local`` storage or on Azurite (its own table prefix):
    one per measurement, so no earlier job's members time out during it."""
    tag = uuid.uuid4().hex[:8]
    if storage == "local":
        return Coordinator(["--storage", f"local:{ROOT / 'build' / f'rdzv-{tag}'}"], {})
    return Coordinator(
        ["--storage", "azure"],
        {"AZURE_STORAGE_CONNECTION_STRING": azurite, "RALLYPOINT_STORAGE_PREFIX": "b" + tag},
    )


def azurite_pid() -> int | None:
    for pid in descendants(os.getpid()):
        with contextlib.suppress(OSError):
            if b"azurite" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return None


#: py-spy's samples a second: 100 took a core from the two here and tripled a round.
RATE = int(os.environ.get("RP_PROFILE_RATE", "20"))


class Profile:
    """``py-spy record`` of the coordinator over one measurement (``--profile``): the
    thread holding the GIL (where its CPU goes), as raw collapsed stacks under build/,
    and the functions in the most samples."""

    def __init__(self, pid: int, label: str, enabled: bool) -> None:
        self.path = ROOT / "build" / f"profile-{label}.txt"
        self.proc: subprocess.Popen[bytes] | None = None
        if enabled:
            spy = Path(sys.executable).with_name("py-spy")
            record = ["record", "--pid", str(pid), "--rate", str(RATE), "--nonblocking", "--gil"]
            self.proc = subprocess.Popen(
                [str(spy), *record, "--format", "raw", "--output", str(self.path)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)  # py-spy attaches

    def stop(self, top: int = 8) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(60)
        print(f"  profile of the coordinator ({self.path.name}):")
        for line in summarize(self.path, top):
            print(f"    {line}")


# The coordinator's files as py-spy names them (an editable install or a wheel's).
OURS = ("service/", "client/", "cli/", "rallypoint/")
# Where a sample's own frame lies, by the first of these in its file's path.
AREAS = (
    ("rallypoint/", "rallypoint"),
    ("azure/core/", "azure-core"),
    ("core/", "azure-core"),
    ("tables/", "azure-data-tables"),
    ("storage/blob", "azure-storage-blob"),
    ("requests/", "requests"),
    ("urllib3/", "urllib3"),
    ("http/client", "http.client"),
    ("uvicorn/", "uvicorn"),
    ("starlette/", "starlette"),
    ("fastapi/", "fastapi"),
    ("pydantic", "pydantic"),
    ("anyio/", "anyio"),
    ("asyncio/", "asyncio"),
)


def summarize(path: Path, top: int) -> list[str]:
    """py-spy's raw stacks as three lists: the share of samples whose own frame is in
    each library, the coordinator's functions in the most samples (inclusive), and the
    own frames in the most samples."""
    total, areas, ours, own = 0, Counter[str](), Counter[str](), Counter[str]()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f for f in stack.split(";") if not f.startswith("process ")]
        if not frames:
            continue
        total += int(count)
        leaf = frames[-1]
        where = leaf.rpartition(" (")[2]
        stdlib = where.rpartition(":")[0].removesuffix(".py").removeprefix("<frozen ")
        area = next((name for key, name in AREAS if key in where), stdlib.rstrip(">"))
        areas["rallypoint" if where.startswith(OURS) else area] += int(count)
        own[leaf] += int(count)
        # The coordinator's own functions, less the frames every sample of a thread has.
        for frame in {
            f.partition(" (")[0] for f in frames if f.partition(" (")[2].startswith(OURS)
        }:
            if frame not in ("serve", "_serve", "main", "Server.run", "<module>"):
                ours[frame] += int(count)

    def share(counts: Counter[str]) -> str:
        return ", ".join(f"{k} {v / total:.0%}" for k, v in counts.most_common(top))

    return [
        f"{total} samples holding the GIL at {RATE} Hz",
        f"own frame in: {share(areas)}",
        f"in rallypoint's: {share(ours)}",
        f"own frames: {share(own)}",
    ]


@dataclass
class Row:
    n: int
    storage: str
    nodes_as: str
    seconds: float
    coordinator_cpu: float
    nodes_cpu: float
    azurite_cpu: float | None
    assignment_bytes: float
    wire_bytes: float | None = None
    retries: int = 0

    def print(self) -> None:
        azurite = f"{self.azurite_cpu:9.2f}" if self.azurite_cpu is not None else f"{'-':>9}"
        wire = f"{self.wire_bytes:11,.0f}" if self.wire_bytes is not None else f"{'-':>11}"
        print(
            f"{self.n:>6} {self.storage:>8} {self.nodes_as:>13} {self.seconds:8.2f}"
            f" {self.coordinator_cpu:8.2f} {self.nodes_cpu:8.2f} {azurite}"
            f" {self.assignment_bytes:8.0f} {wire}"
            + (f"  ({self.retries} answers of 429/5xx retried)" if self.retries else "")
            + f"  [{self.bound()}]",
            flush=True,
        )

    def bound(self) -> str:
        """What held the round: the process whose CPU seconds came near the round's (a
        process's event loop is one core; storage works in threads beside it, so the
        coordinator may pass 1.0), or neither (waits: storage, the loopback, timers)."""
        if self.seconds <= 0:
            return "-"
        shares = {
            "coordinator": self.coordinator_cpu / self.seconds,
            "nodes": self.nodes_cpu / self.seconds,
            "Azurite": (self.azurite_cpu or 0.0) / self.seconds,
        }
        busiest = max(shares, key=lambda k: shares[k])
        if shares[busiest] >= 0.8:
            return f"{busiest}-bound: {shares[busiest]:.0%} of a core"
        return f"no process saturated (busiest: {busiest}, {shares[busiest]:.0%}): waits"


ROW_HEAD = (
    f"{'N':>6} {'storage':>8} {'nodes as':>13} {'round s':>8} {'coord':>8} {'nodes':>8}"
    f" {'Azurite':>9} {'B/assign':>8} {'wire B/node':>11}\n"
    f"{'':>37} {'(CPU seconds over the round)':>28}"
)


def client_row(storage: str, n: int, azurite: str) -> Row:
    """A round of real ElasticClients (threads of processes of 128)."""
    with running(coordinator_for(storage, azurite)) as (coordinator, pid):
        storage_pid = azurite_pid() if storage == "azurite" else None
        before = cpu_seconds(pid), cpu_seconds(storage_pid) if storage_pid else 0.0
        seconds, nodes_cpu, assignment_bytes = join_round(coordinator.url, f"round-{n}", n)
        return Row(
            n,
            storage,
            "ElasticClient",
            seconds,
            cpu_seconds(pid) - before[0],
            nodes_cpu,
            cpu_seconds(storage_pid) - before[1] if storage_pid else None,
            assignment_bytes,
        )


def loadgen_row(storage: str, n: int, azurite: str, profile: bool) -> Row:
    """A round of N loadgen nodes, connected before the clock starts."""
    with running(coordinator_for(storage, azurite)) as (coordinator, pid):
        storage_pid = azurite_pid() if storage == "azurite" else None
        cpu: list[float] = []

        def go() -> None:
            cpu.extend((cpu_seconds(pid), cpu_seconds(storage_pid) if storage_pid else 0.0))

        async def main() -> Round:
            gen = Loadgen("127.0.0.1", coordinator.port, f"round-{n}", n)
            try:
                await gen.connect()
                spy = Profile(pid, f"round-{n}-{storage}", profile)
                try:
                    return await gen.join(spec(n), go)
                finally:
                    spy.stop()
            finally:
                gen.close()

        result = _loadgen.run(main())
        if result.retried:
            print(f"  retried answers, e.g.: {result.retried}")
        return Row(
            n,
            storage,
            "loadgen",
            result.seconds,
            cpu_seconds(pid) - cpu[0],
            result.loadgen_cpu,
            cpu_seconds(storage_pid) - cpu[1] if storage_pid else None,
            result.assignment_bytes,
            result.wire_bytes,
            result.retries,
        )


@contextlib.contextmanager
def running(coordinator: Coordinator) -> Iterator[tuple[Coordinator, int]]:
    coordinator.start()
    try:
        assert coordinator.proc is not None
        yield coordinator, coordinator.proc.pid
    finally:
        stopped(coordinator)


def stopped(coordinator: Coordinator) -> None:
    """Stops ``coordinator`` and removes its local storage, if it has one (under build/:
    each measurement has its own, which no later one reads)."""
    coordinator.stop()
    for arg in coordinator.args:
        if arg.startswith("local:"):
            shutil.rmtree(arg.removeprefix("local:"), ignore_errors=True)


def bench_rounds(
    sizes: list[int],
    client_sizes: list[int],
    torch_sizes: list[int],
    storages: list[str],
    azurite: str,
    profile: bool,
) -> bool:
    """Prints the rounds' table; whether every round ran."""
    print("\n## One rendezvous round: N nodes join (min = max = N), until all are assigned")
    print(ROW_HEAD)
    local_clients: dict[int, float] = {}
    ran = True
    for n in sorted(set(sizes) | set(client_sizes)):
        for storage in storages:
            if n in client_sizes:
                row = client_row(storage, n, azurite)
                row.print()
                if storage == "local":
                    local_clients[n] = row.seconds
            if n in sizes:
                try:
                    loadgen_row(storage, n, azurite, profile).print()
                except LoadgenError as exc:
                    ran = False
                    print(f"{n:>6} {storage:>8} {'loadgen':>13}  failed: {exc}"[:200], flush=True)
    for n in torch_sizes:
        anchor = torch_round(n)
        ours = local_clients.get(n)
        text = (
            f"{anchor:.2f} s" if anchor is not None else f"did not finish in {TORCH_LIMIT_S:.0f} s"
        )
        ratio = (
            f" ({anchor / ours:.1f}x ElasticClients on local storage)" if anchor and ours else ""
        )
        print(f"torch c10d, {n} nodes: {text}{ratio}", flush=True)
    return ran


def bench_transports(nodes: int, beats: int) -> None:
    """Which is cheaper for the load generator, per request: raw HTTP/1.1 on asyncio
    streams, or httpx's AsyncClient; the coordinator's cost per request beside them."""
    print(f"\n## Load generator transports: {nodes} nodes x {beats} plain heartbeats, local")
    with running(coordinator_for("local", "")) as (coordinator, pid):

        async def main() -> None:
            gen = Loadgen("127.0.0.1", coordinator.port, "transports", nodes)
            await gen.connect()
            await gen.join(spec(nodes, timeout=60))
            requests = nodes * beats
            for name in ("raw", "httpx", "raw", "httpx"):
                before, wall = cpu_seconds(pid), time.perf_counter()
                if name == "raw":
                    own = await gen.beat_raw(nodes, beats)
                else:
                    own = await gen.beat_httpx(coordinator.url, nodes, beats)
                theirs = cpu_seconds(pid) - before
                print(
                    f"{name:>6}: {requests / (time.perf_counter() - wall):6.0f} requests/s, "
                    f"CPU per request: load generator {own / requests * 1e6:4.0f} us, "
                    f"coordinator {theirs / requests * 1e6:4.0f} us",
                    flush=True,
                )
            gen.close()

        _loadgen.run(main())


def bench_heartbeats(
    n: int, seconds: float, holds: list[float], storage: str, azurite: str, profile: bool
) -> None:
    print(f"\n## Heartbeats: {n} members at 1 Hz, {seconds:.0f} s per hold, {storage}")
    with running(coordinator_for(storage, azurite)) as (coordinator, pid):

        async def main() -> None:
            gen = Loadgen("127.0.0.1", coordinator.port, "beats", n)
            await gen.connect()
            # Members beat once all are assigned: the timeout outlasts a large round.
            # They join 256 at a time, 3 s apart: a burst of 2,048 joins on Azurite queued
            # the driver's storage reads past their deadline (503s, retried in a storm).
            joined = await gen.join(spec(n, timeout=60), waves=(256, 3.0))
            print(f"joined in {joined.seconds:.2f} s, {joined.retries} answers retried")
            for hold in holds:
                cpu0, wall0 = cpu_seconds(pid), time.monotonic()
                spy = Profile(pid, f"beats-{n}-hold{hold:g}-{storage}", profile)
                beats = await gen.heartbeats(seconds, hold=timedelta(seconds=hold))
                spy.stop()
                wall = time.monotonic() - wall0
                cpu = (cpu_seconds(pid) - cpu0) / wall
                report_beats(beats, seconds, hold, cpu, beats.loadgen_cpu / wall)
            gen.close()

        _loadgen.run(main())


def report_beats(beats: Beats, seconds: float, hold: float, cpu: float, own: float) -> None:
    what = f"held {hold:g} s (ElasticClient.heartbeats)" if hold else "not held (heartbeat())"
    print(
        f"{what}: {len(beats.samples)} beats ({len(beats.samples) / seconds:.0f}/s), "
        f"restarts {beats.restarts}; CPU, % of one core: coordinator {cpu * 100:.0f}, "
        f"load generator {own * 100:.0f}"
    )
    # The first seconds hold a thousand connections' first beats: shown apart.
    for label, since in (("all", 0.0), (f"after the first {WARM_S:.0f} s", WARM_S)):
        window = [latency for at, latency in beats.samples if at >= since]
        if len(window) < 2:  # a run shorter than the warm-up (--smoke)
            continue
        q = statistics.quantiles(window, n=100)
        print(
            f"  latency{' beyond the hold' if hold else ''} ms, {label}: p50 {q[49] * 1e3:.1f},"
            f" p99 {q[98] * 1e3:.1f}, max {max(window) * 1e3:.1f}"
        )


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
        stopped(coordinator)
    print(f"median {statistics.median(results):.2f} s, max {max(results):.2f} s")


#: What ``--smoke`` sets (``bench/_smoke.py``): a few nodes and seconds for every part.
SMOKE = {
    "sizes": "8",
    "client_sizes": "4",
    "torch_sizes": "2",
    "transport_nodes": 4,
    "transport_beats": 5,
    "beat_nodes": 8,
    "beat_seconds": 2.0,
    "detect_repeats": 1,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024,4096,10000")
    parser.add_argument("--client-sizes", default="8,32,64,256")
    parser.add_argument("--torch-sizes", default="8,32,64")
    parser.add_argument("--storages", default="local,azurite")
    parser.add_argument("--transport-nodes", type=int, default=64)
    parser.add_argument("--transport-beats", type=int, default=100)
    parser.add_argument("--beat-nodes", type=int, default=2048)
    parser.add_argument("--beat-seconds", type=float, default=30)
    parser.add_argument("--beat-holds", default="1,0")
    parser.add_argument("--beat-storage", default="azurite", choices=["local", "azurite"])
    parser.add_argument("--detect-repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--only", choices=["rounds", "transports", "heartbeats", "detection", "outage"]
    )
    args = parse(parser, SMOKE)

    def ints(text: str) -> list[int]:
        return [int(s) for s in text.split(",") if s]

    (ROOT / "build").mkdir(exist_ok=True)
    largest = max([*ints(args.sizes), args.beat_nodes, args.transport_nodes])
    soft, hard = _loadgen.raise_nofile(largest)
    print(
        f"{os.cpu_count()} CPUs; coordinator, Azurite and the nodes share them; "
        f"RLIMIT_NOFILE {soft}/{hard}"
    )
    ran = True
    with azurite() as conn:
        if args.only in (None, "rounds"):
            ran = bench_rounds(
                ints(args.sizes),
                ints(args.client_sizes),
                ints(args.torch_sizes),
                args.storages.split(","),
                conn,
                args.profile,
            )
        if args.only in (None, "transports"):
            bench_transports(args.transport_nodes, args.transport_beats)
        if args.only in (None, "heartbeats"):
            bench_heartbeats(
                args.beat_nodes,
                args.beat_seconds,
                [float(h) for h in args.beat_holds.split(",")],
                args.beat_storage,
                conn,
                args.profile,
            )
    if args.only in (None, "detection"):
        bench_detection(args.detect_repeats)
    if args.only == "outage" or (args.only is None and not args.smoke):
        # 256 members through HAProxy, storage frozen 30 s, beside a run without it.
        from outage import SMOKE as OUTAGE_SMOKE
        from outage import bench_outage

        bench_outage(**(OUTAGE_SMOKE if args.smoke else {}))
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
