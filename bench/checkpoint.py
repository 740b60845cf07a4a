"""CheckpointManager, side by side with torch.save, DCP async_save, dd and azure-storage-blob.

One process saves a state dict of ``--mib`` MiB in ``--tensors`` float32 tensors through
a real coordinator (uvicorn) on local storage and on Azurite:

1. blocked: how long ``save()`` keeps training waiting, beside the copy of the same
   tensors into preallocated buffers, the blocking part of
   ``torch.distributed.checkpoint.async_save``, and ``torch.save``.
2. persisted: MiB/s from ``save()`` to the version committed, beside ``dd bs=8M
   conv=fdatasync`` of as many bytes on the same disk (local) and a plain
   azure-storage-blob ``upload_blob(max_concurrency=8)`` of the same bytes (Azurite).
3. load: MiB/s of ``load()`` (checksums verified), beside ``dd`` of the shard to
   /dev/null (local) and ``download_blob(max_concurrency=8).readall()`` (Azurite).
4. peak memory: in a fresh process, the peak RSS over three saves, less the RSS before
   the state was made, as a multiple of the state's size.

Each figure is the median of ``--repeat`` rounds after one warm-up (for our saves,
after four: from then on retention collects a version per save, as in a long job);
pairs alternate. The first saves' rates are printed too.

With ``--device cuda`` (single and loop modes) the state is made on the GPU and the same
anchors run on the same tensors: the copy goes into preallocated pinned host buffers
(non-blocking, then a synchronize: what DCP's async_save blocks on), ``torch.save`` and
``dcp.async_save`` take the GPU tensors as they are, and ``load()`` restores into GPU
tensors of the same shapes (templates; on the CPU it restores the state as saved). Peak
memory is then the host's, counted from after the CUDA context was made.

The sharded run (``--mode sharded``): 4 processes, each its own node with a gloo
process group, hold 1 GiB of float32 DTensors in all (16 tensors, ``Shard(0)``).
Side by side in the same processes: ``dcp.async_save`` with ``FileSystemWriter`` (as it
comes, and with a ``DefaultStager`` that caches its buffers), ``torch.save`` of the state
gathered on rank 0, a copy of each rank's shards into preallocated buffers, and
``dcp.load`` with ``FileSystemReader``, at world 4 and resharded at world 2. On Azurite,
the anchors are every rank's ``upload_blob`` / ``download_blob`` of its own bytes.

The file format (``--mode formats``, local only): one process writes the same state
with ``dcp.save`` (no staging), each writer in a fresh process, median of ``--repeat``:
``RallypointWriter`` (raw item bytes at offsets DCP's metadata records, through the
coordinator), DCP's ``FileSystemWriter`` with its
default ``torch.save`` per item, and with ``SerializationFormat.SAFETENSORS`` (the
format of its Hugging Face storage layer); MiB/s to fsynced files and peak RSS.

The training loop (``--mode loop``, local only; see ``bench/_loop.py``): what saving
every 5 steps costs an MLP's training loop with Adam, ``--mib`` MiB of state, beside no
saves and ``dcp.async_save``: time waited per save against a plain copy, and steps/s.

``--mode all`` runs every mode; ``--smoke`` runs them all at tiny sizes, the sharded
run on 2 processes (``--world``) restored on 1.

Usage: python bench/checkpoint.py [--mib 1024] [--tensors 64] [--repeat 3]
       [--only local|azurite] [--mode single|sharded|both|formats|loop|all]
       [--device cpu|cuda] [--steps 30] [--world 4] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # last: its rallypoint/ folder must not hide an installed package
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
# The DCP anchors run without a process group on purpose.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

import torch  # noqa: E402

from bench._joined import joined  # noqa: E402
from bench._smoke import azurite, parse  # noqa: E402
from rallypoint.trainer import CheckpointManager  # noqa: E402
from tests._coordinator import Coordinator  # noqa: E402
from tests._ranks import run_ranks  # noqa: E402

MiB = 1 << 20
KEEP = 3  # the coordinator's default retention (RALLYPOINT_CHECKPOINT_KEEP)


def make_state(mib: int, tensors: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    per = mib * MiB // tensors // 4
    return {
        f"layer{i}.weight": torch.randn(per // 1024, 1024, device=device) for i in range(tensors)
    }


def synchronize(state: dict[str, torch.Tensor]) -> None:
    """Waits for the GPU's queued work, if the state lives there (else nothing)."""
    if any(t.device.type == "cuda" for t in state.values()):
        torch.cuda.synchronize()


def median(f: Callable[[], float], repeat: int) -> float:
    f()  # warm-up
    return statistics.median(f() for _ in range(repeat))


def paired(
    ours: Callable[[], float], anchor: Callable[[], float], repeat: int, warmup: int = 1
) -> tuple[float, float]:
    """Medians of both, alternating so that both see the same disk weather."""
    for _ in range(warmup):
        ours()
    anchor()
    a, b = [], []
    for _ in range(repeat):
        a.append(ours())
        b.append(anchor())
    return statistics.median(a), statistics.median(b)


def joined_manager(url: str) -> CheckpointManager:
    """The manager of a joined node whose heartbeats run for the rest of the process (the
    bench's child processes); :class:`Rallypoint` keeps and stops its own."""
    return CheckpointManager(joined(url, "bench")[0], progress=False)


class Rallypoint:
    def __init__(self, url: str, state: dict[str, torch.Tensor]) -> None:
        client, self.beats = joined(url, "bench")
        self.manager = CheckpointManager(client, progress=False)
        self.state = state
        self.step = 0
        self.blocked: list[float] = []
        self.persisted: list[float] = []
        self.version = 0
        # On an accelerator, load() restores into tensors of the same shapes there, as a
        # trainer does; on the CPU, the state as saved.
        on_cpu = all(t.device.type == "cpu" for t in state.values())
        self.templates = None if on_cpu else {k: torch.empty_like(v) for k, v in state.items()}

    def save(self) -> float:
        self.step += 1
        start = time.perf_counter()
        handle = self.manager.save(self.state, self.step)
        blocked = time.perf_counter() - start
        assert handle is not None
        info = handle.result()
        persisted = time.perf_counter() - start
        assert info.state == "committed"
        self.version = info.version
        self.blocked.append(blocked)
        self.persisted.append(persisted)
        return persisted

    def load(self) -> float:
        start = time.perf_counter()
        restored = self.manager.load(self.version, self.templates)
        if self.templates is not None:
            synchronize(self.templates)
        elapsed = time.perf_counter() - start
        assert restored.state.keys() == self.state.keys()
        return elapsed


def copy_anchor(state: dict[str, torch.Tensor]) -> Callable[[], float]:
    """Copies into buffers allocated once: on the CPU, plain ones; from a GPU, pinned host
    buffers, non-blocking copies and a synchronize, the blocking part of DCP's async_save."""
    pinned = any(t.device.type != "cpu" for t in state.values())
    buffers = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pinned) for k, v in state.items()}

    def run() -> float:
        start = time.perf_counter()
        for k, v in state.items():
            buffers[k].copy_(v, non_blocking=pinned)
        synchronize(state)
        return time.perf_counter() - start

    return run


def torch_save_anchor(state: dict[str, torch.Tensor], work: Path) -> Callable[[], float]:
    def run() -> float:
        synchronize(state)
        start = time.perf_counter()
        torch.save(state, work / "torch_save.pt")
        return time.perf_counter() - start

    return run


def dcp_anchor(state: dict[str, torch.Tensor], work: Path) -> Callable[[], float]:
    import torch.distributed.checkpoint as dcp

    # Without a process group DCP saves as a single process (numpy-free, as here).
    rounds = iter(range(1_000_000))

    def run() -> float:
        target = work / f"dcp{next(rounds)}"
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(target))
        blocked = time.perf_counter() - start
        future.result()
        subprocess.run(["rm", "-rf", str(target)], check=True)
        return blocked

    return run


def dd_write(source: Callable[[], Path], work: Path) -> Callable[[], float]:
    """dd of the latest shard: the same bytes, from the page cache, into a new file as
    every checkpoint is (rewriting an allocated file took 1.2 s here where a new one took
    2.0-4.3 s, and dd from /dev/zero was faster than any real data)."""

    def run() -> float:
        (work / "dd.bin").unlink(missing_ok=True)
        start = time.perf_counter()
        subprocess.run(
            [
                "dd",
                f"if={source()}",
                f"of={work / 'dd.bin'}",
                "bs=8M",
                "conv=fdatasync",
                "status=none",
            ],
            check=True,
        )
        return time.perf_counter() - start

    return run


def dd_read(path: Path) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=8M", "status=none"], check=True)
        return time.perf_counter() - start

    return run


def sdk_blob(conn: str, nbytes: int) -> tuple[Callable[[], float], Callable[[], float]]:
    from azure.storage.blob import BlobServiceClient

    service = BlobServiceClient.from_connection_string(conn)
    container = service.get_container_client("anchor")
    if not container.exists():
        container.create_container()
    blob = container.get_blob_client("state.bin")
    data = os.urandom(nbytes)

    def put() -> float:
        start = time.perf_counter()
        blob.upload_blob(data, overwrite=True, max_concurrency=8)
        return time.perf_counter() - start

    def get() -> float:
        start = time.perf_counter()
        blob.download_blob(max_concurrency=8).readall()
        return time.perf_counter() - start

    return put, get


def peak_memory(url: str, mib: int, tensors: int, device: str) -> float:
    """Runs three saves in a fresh process; peak RSS growth over the state's size (with
    a GPU, counted from after its CUDA context was made)."""
    code = f"""
import sys, warnings
warnings.filterwarnings("ignore")
sys.path.append({str(ROOT)!r})
import torch
from bench.checkpoint import joined_manager, make_state
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
if {device!r} != "cpu":
    torch.ones(1, device={device!r}).sum().item()  # the context is not the checkpoint's
before = rss("VmRSS:")
manager = joined_manager({url!r})
state = make_state({mib}, {tensors}, {device!r})
for step in range(1, 4):
    manager.save(state, 1000 + step, blocking=True)
print((rss("VmHWM:") - before) / sum(t.numel() * 4 for t in state.values()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def shard_path(root: Path, version: int) -> Path:
    (path,) = root.glob(f"**/v{version:010d}/rank-00000/data.distcp")
    return path


def bench(
    kind: str,
    url: str,
    state: dict[str, torch.Tensor],
    work: Path,
    repeat: int,
    conn: str | None,
    root: Path | None,
) -> None:
    nbytes = sum(t.numel() * 4 for t in state.values())
    rp = Rallypoint(url, state)
    device = next(iter(state.values())).device.type
    where = "" if device == "cpu" else f" on {device}"
    print(f"\n== {kind}: {nbytes / MiB:.0f} MiB in {len(state)} tensors{where} ==")
    if kind == "local":
        assert root is not None

        def shard() -> Path:
            return shard_path(root, rp.version)

        put, get = dd_write(shard, work), lambda: dd_read(shard())()
        write_name, read_name = "dd conv=fdatasync", "dd to /dev/null"
    else:
        assert conn is not None
        put, get = sdk_blob(conn, nbytes)
        write_name, read_name = "upload_blob", "download_blob"
    rate = nbytes / MiB
    # A training job saves hundreds of times; from the (KEEP + 1)th save on, retention
    # deletes a version per save and the file system hands its blocks to the next one.
    # The first saves instead write blocks the disk never held (thin-provisioned and
    # trimmed, 200 MiB/s here against 1,100 for reused blocks), which is not what a
    # long job sees and not what dd, rewriting its own file, is measured on.
    persisted, write_anchor = paired(rp.save, put, repeat, warmup=KEEP + 1)
    print(f"first saves {', '.join(f'{rate / s:.0f}' for s in rp.persisted[: KEEP + 1])} MiB/s")
    blocked = statistics.median(rp.blocked[1:])
    load, read_anchor = paired(rp.load, get, repeat)
    print(
        f"persisted   {rate / persisted:8.0f} MiB/s   {write_name} {rate / write_anchor:8.0f} MiB/s"
        f"   ratio {write_anchor / persisted:.2f}"
    )
    print(
        f"load        {rate / load:8.0f} MiB/s   {read_name} {rate / read_anchor:8.0f} MiB/s"
        f"   ratio {read_anchor / load:.2f}"
    )
    if kind == "local":
        copy = median(copy_anchor(state), repeat)
        dcp = median(dcp_anchor(state, work), repeat)
        tsave = median(torch_save_anchor(state, work), repeat)
        buffers = "preallocated buffers" if device == "cpu" else "preallocated pinned buffers"
        print(
            f"blocked     {blocked:8.3f} s      copy into {buffers} {copy:.3f} s"
            f"   ratio {blocked / copy:.2f}"
        )
        print(
            f"            DCP async_save blocked {dcp:.3f} s ({dcp / blocked:.1f}x ours),"
            f" torch.save {tsave:.3f} s ({tsave / blocked:.1f}x ours)"
        )
        first = rp.blocked[0]
        print(f"            first save (allocates the staging buffer) blocked {first:.3f} s")
        peak = peak_memory(url, nbytes // MiB, len(state), device)
        if device == "cpu":
            print(f"peak memory {peak:.2f}x the state (state + staging + everything else)")
        else:
            print(f"peak memory {peak:.2f}x the state in host RSS (pinned staging + the rest)")
    else:
        print(f"blocked     {blocked:8.3f} s")
    # Before the coordinator stops: beats that outlive it retry for minutes and say so.
    rp.beats.stop()


SHARDED_WORLD = 4  # processes of the sharded run (--world)

_FORMAT_RUN = """
import json, os, sys, time, warnings
warnings.filterwarnings("ignore")
sys.path.append({root!r})
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import SerializationFormat
from bench.checkpoint import joined_manager, make_state
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
state = make_state({mib}, {tensors})
before = rss("VmRSS:")
if {kind!r} == "rallypoint":
    from rallypoint.trainer import RallypointWriter
    writer = RallypointWriter(joined_manager({url!r}).client, {step})
    start = time.perf_counter()
    dcp.save(state, storage_writer=writer, no_dist=True)
else:
    fmt = getattr(SerializationFormat, {kind!r})
    writer = dcp.FileSystemWriter({target!r}, serialization_format=fmt)
    start = time.perf_counter()
    dcp.save(state, storage_writer=writer, no_dist=True)
elapsed = time.perf_counter() - start
print(json.dumps({{"s": elapsed, "peak": rss("VmHWM:") - before}}))
"""


def formats(url: str, work: Path, args: argparse.Namespace) -> None:
    """Each writer in a fresh process (so peak memory is its own), alternating."""
    nbytes = args.mib * MiB
    runs: dict[str, list[dict[str, float]]] = {
        "rallypoint": [],
        "TORCH_SAVE": [],
        "SAFETENSORS": [],
    }
    warm = 0 if args.smoke else 1  # a smoke run's figures need no warm page cache
    for i in range(args.repeat + warm):
        for kind, results in runs.items():
            target = work / f"fmt-{kind}"
            subprocess.run(["rm", "-rf", str(target)], check=True)
            code = _FORMAT_RUN.format(
                root=str(ROOT),
                mib=args.mib,
                tensors=args.tensors,
                kind=kind,
                url=url,
                step=100 + i,
                target=str(target),
            )
            done = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            )
            if i >= warm:  # the first round warms the page cache and the disk's blocks
                results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"\n== file format: {args.mib} MiB in {args.tensors} tensors, one process ==")
    ours = statistics.median(r["s"] for r in runs["rallypoint"])
    for kind, results in runs.items():
        s = statistics.median(r["s"] for r in results)
        peak = max(r["peak"] for r in results) / nbytes
        print(
            f"{kind:12} {nbytes / MiB / s:7.0f} MiB/s   peak RSS {peak:.2f}x the state"
            f"   ours / this {s / ours:.2f}"
        )


def sharded(kind: str, url: str, work: Path, args: argparse.Namespace, conn: str | None) -> None:
    """The ``--world``-process DTensor run (see the module's docstring)."""
    world = args.world
    body = (ROOT / "bench" / "_sharded_body.py").read_text()
    params: dict[str, object] = {
        "rows": args.mib * MiB // 4 // 1024 // 16,
        "tensors": 16,
        "repeat": args.repeat,
        # Azurite keeps the space of overwritten and deleted blobs past a run this size
        # (a 12 GiB in-memory cap), and its saves reuse no disk blocks: 1 warm-up there.
        "warmup": KEEP + 1 if conn is None else 1,
        "work": str(work),
        "conn": conn,
    }

    def phase(name: str, nodes: list[str], job: str = "", **extra: object) -> dict[str, float]:
        os.environ["BENCH_PARAMS"] = json.dumps({**params, **extra, "phase": name})
        job = job or f"sharded-{kind}"
        results = run_ranks(url, job, nodes, body, work / "ranks", timeout=1800)
        errors = [r["error"] for r in results if "error" in r]
        assert not errors, errors
        # Spans between barriers are the same on every rank: rank 0 speaks for them.
        # Blocked times are each rank's own (4 processes share 2 CPUs here): their
        # median over the ranks. Peak memory is the worst rank's.
        out: dict[str, float] = dict(results[0])
        for key in ("ours_blocked", "dcp_blocked", "dcp_cached_blocked", "copy"):
            if key in out:
                out[key] = statistics.median(float(r[key]) for r in results)
        out["peak_rss_x"] = max(float(r.get("peak_rss_x", 0.0)) for r in results)
        out["bytes_read_mib"] = max(float(r.get("bytes_read_mib", 0.0)) for r in results)
        return out

    saved = phase("save", [f"s{i}" for i in range(world)])
    # Peak memory in fresh processes that only save, as a trainer does: the save phase
    # also holds the anchors' buffers and the gathered state.
    memory = (
        phase("memory", [f"m{i}" for i in range(world)], job=f"memory-{kind}")
        if conn is None
        else None
    )
    total = saved["total_mib"]
    print(f"\n== {kind}, sharded: {total:.0f} MiB of DTensors over {world} processes ==")
    ours_b, copy = saved["ours_blocked"], saved["copy"]
    print(
        f"blocked     {ours_b:8.3f} s      copy into preallocated buffers {copy:.3f} s"
        f"   ratio {ours_b / copy:.2f}"
    )
    persisted = saved["ours_persisted_mibs"]
    if conn is None:
        for name, label in (
            ("dcp", "DCP async_save"),
            ("dcp_cached", "DCP async_save, cached stager"),
        ):
            theirs = saved[f"{name}_blocked"]
            print(f"            {label} blocked {theirs:.3f} s   ratio {ours_b / theirs:.2f}")
        for name, label in (("dcp", "FileSystemWriter"), ("dcp_cached", "FileSystemWriter cached")):
            theirs = saved[f"{name}_persisted_mibs"]
            print(
                f"persisted   {persisted:8.0f} MiB/s   {label} {theirs:6.0f} MiB/s"
                f"   ratio {persisted / theirs:.2f}"
            )
        gathered = saved["torch_save_gathered"]
        print(
            f"            torch.save of the gathered state {total / gathered:.0f} MiB/s"
            f" ({gathered:.2f} s, all of it blocking)"
        )
    else:
        theirs = saved["upload_blob_persisted_mibs"]
        print(
            f"persisted   {persisted:8.0f} MiB/s   upload_blob {theirs:6.0f} MiB/s"
            f"   ratio {persisted / theirs:.2f}"
        )
    if memory is not None:
        print(f"peak memory {memory['peak_rss_x']:.2f}x a rank's state, 3 saves (worst rank)")
    version = int(saved["version"])
    anchor = "FileSystemReader" if conn is None else "download_blob"
    # The smoke run restores at the other world only: the same path, in fewer processes.
    for at in (world // 2,) if args.smoke else (world, world // 2):
        nodes = [f"w{at}-{i}" for i in range(at)]
        loaded = phase("load", nodes, version=version, total_mib=total, saved_by=world)
        ours_l, theirs_l = loaded["ours_load_mibs"], loaded["anchor_load_mibs"]
        print(
            f"restore @{at} {ours_l:7.0f} MiB/s   {anchor} {theirs_l:6.0f} MiB/s"
            f"   ratio {ours_l / theirs_l:.2f}"
            f"   read per process {loaded['bytes_read_mib']:.0f} MiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", choices=["local", "azurite"])
    parser.add_argument(
        "--mode", choices=["single", "sharded", "both", "formats", "loop", "all"], default="both"
    )
    parser.add_argument("--steps", type=int, default=30, help="loop mode: steps per round")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where the state lives"
    )
    parser.add_argument("--world", type=int, default=SHARDED_WORLD, help="sharded: processes")
    smoke = {"mib": 1, "tensors": 4, "repeat": 1, "steps": 5, "mode": "all", "world": 2}
    args = parse(parser, smoke)
    if args.device != "cpu" and args.mode not in ("single", "loop"):
        parser.error("--device cuda runs in one process only: add --mode single or --mode loop")
    every = args.mode == "all"
    single = every or args.mode in ("single", "both")
    shard = every or args.mode in ("sharded", "both")
    formats_, loop_ = every or args.mode == "formats", every or args.mode == "loop"
    if args.mode in ("formats", "loop"):
        args.only = "local"
    state = make_state(args.mib, args.tensors, args.device) if args.mode != "loop" else {}
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, median of {args.repeat} after a warm-up"
    )
    if args.device == "cuda":
        print(f"GPU {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}")
    with tempfile.TemporaryDirectory(
        dir=ROOT / "build" if (ROOT / "build").is_dir() else None
    ) as tmp:
        work = Path(tmp)
        if args.only in (None, "local"):
            root = work / "storage"
            coordinator = Coordinator(["--storage", f"local:{root}"], {}).start()
            try:
                if single:
                    bench("local", coordinator.url, state, work, args.repeat, None, root)
                if shard:
                    sharded("local", coordinator.url, work, args, None)
                if formats_:
                    formats(coordinator.url, work, args)
                if loop_:
                    from bench._loop import run as loop

                    loop(coordinator.url, work, args.mib, args.steps, args.repeat, args.device)
            finally:
                coordinator.stop()
        # A fresh Azurite for each run: its in-memory storage does not give back the
        # space of deleted blobs soon enough for both (a 12 GiB cap).
        for run in ("single", "sharded") if args.only in (None, "azurite") else ():
            if not {"single": single, "sharded": shard}[run]:
                continue
            with azurite() as conn:
                prefix = "bench" + uuid.uuid4().hex[:8]  # an Azurite of the tests' is shared
                coordinator = Coordinator(
                    ["--storage", "azure"],
                    {"AZURE_STORAGE_CONNECTION_STRING": conn, "RALLYPOINT_STORAGE_PREFIX": prefix},
                ).start()
                try:
                    if run == "single":
                        bench("azurite", coordinator.url, state, work, args.repeat, conn, None)
                    else:
                        sharded("azurite", coordinator.url, work, args, conn)
                finally:
                    coordinator.stop()


if __name__ == "__main__":
    main()
