"""A model's and Adam's state on the GPU: how long a save blocks, and how fast a restore
fills device memory, beside DCP, ``torch.save`` and a pinned copy (CI has no GPU).

For each size in ``--gib`` (default 4 and 16 GiB), one process holds bias-free
``--width`` x ``--width`` linear layers and Adam's two moments after one step (the step
counters on the CPU, as Adam keeps them), all float32 on the device, and saves
``{"model": ..., "optim": ...}`` through each of, in one run:

1. a copy into pinned host buffers allocated once, non-blocking, then a synchronize: the
   physical reference (a device-to-host DMA of every byte);
2. ``CheckpointManager`` with this node's memory tier (``RALLYPOINT_MEMORY_DIR`` in
   /dev/shm): what ``save()`` held the caller, and apart from it, how long a
   ``wait_staged()`` right after it waited (what an update by hand right after a save
   would wait; an optimizer's step only orders the GPU's stream after the copy). The
   first version also goes to local storage, the rest stay in memory
   (``persist_every``), as a routine save does. Its first save, which allocates the
   pinned buffers, is reported apart;
3. ``torch.distributed.checkpoint.async_save`` as it comes (no stager given: DCP copies
   to pageable memory), and with ``DefaultStager`` staging into pinned shared memory
   (``StagingOptions(use_pinned_memory=True, use_shared_memory=True,
   use_async_staging=False)``). On torch < 2.13 a ``DefaultStager`` fails its second
   save, so there each save gets a new one (and pins its buffers again);
4. ``torch.save`` to a file on local disk.

Blocked is the time from the call until it returned (DCP: until its staging was done),
each call after a ``torch.cuda.synchronize()``; each save finishes before the next.
The goal: ours <= 0.1x the pinned copy.

Then the same state is restored into device tensors of its shapes (templates filled
with other values), timed to a ``synchronize()`` after, and compared bit for bit on the
device: ours from the memory tier (0 bytes from storage is checked), ours from local
storage on disk (a manager with no tier, the first version), and DCP's
``FileSystemReader`` of the directory its last ``async_save`` wrote. Before each read
from disk the page cache is dropped where the process may (root), and the line says
which it was. MB/s is 10^6 bytes per second.

A size that the disk or /dev/shm cannot hold (about 2.2x the state on each) is skipped,
saying so. Without CUDA the script says CUDA is absent and measures nothing;
``--device cpu`` runs the same paths on the CPU, to try them out.

Usage: python bench/cuda_state.py [--gib 4,16] [--repeat 2] [--width 4096]
       [--device cuda|cpu] [--work DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # last: its rallypoint/ folder must not hide an installed package
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
# The DCP anchors run without a process group on purpose.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402

from bench._joined import joined  # noqa: E402
from bench._smoke import parse  # noqa: E402
from rallypoint.trainer import CheckpointManager  # noqa: E402
from rallypoint.trainer.memory import KEEP_ENV, MEMORY_ENV  # noqa: E402
from tests._coordinator import Coordinator  # noqa: E402

GiB = 1 << 30
MB = 1e6
GOAL = 0.1  # ours blocked <= GOAL x the pinned copy
# torch 2.11's DefaultStager fails on its second save (KeyError: <class 'type'> in its
# deep copy), so there the anchor makes a new stager, and new buffers, for every save.
REUSABLE_STAGER = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_state(gib: float, width: int, device: str) -> dict[str, Any]:
    """Linear layers and Adam after one step: about ``gib`` GiB in all (3 floats per
    parameter)."""
    per_layer = 3 * width * width * 4
    count = max(1, round(gib * GiB / per_layer))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(torch.nn.Linear(width, width, bias=False, device=device) for _ in range(count))
    )
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    sync(device)
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def tensors(value: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of ``value`` by its path."""
    if isinstance(value, torch.Tensor):
        return {path: value}
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, (list, tuple))
        else ()
    )
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(tensors(v, f"{path}.{k}" if path else str(k)))
    return out


def templates(value: Any) -> Any:
    """``value`` with every tensor replaced by one of its shape, dtype and device holding
    other values (NaN, or 123 for integers)."""
    if isinstance(value, torch.Tensor):
        out = torch.empty_like(value)
        return out.fill_(float("nan") if value.dtype.is_floating_point else 123)
    if isinstance(value, dict):
        return {k: templates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [templates(v) for v in value]
    return value


def mismatches(got: Any, want: Any) -> list[str]:
    """The paths whose tensors are not bit for bit ``want``'s (compared on the device)."""
    have, expected = tensors(got), tensors(want)
    bad = [p for p in expected if p not in have]
    for path, w in expected.items():
        h = have.get(path)
        if h is None:
            continue
        if h.dtype != w.dtype or h.shape != w.shape or h.device != w.device:
            bad.append(f"{path} ({h.dtype} {tuple(h.shape)} on {h.device})")
        elif not torch.equal(h.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)):
            bad.append(path)
    return bad


def timed(f: Callable[[], Any], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    f()
    sync(device)
    return time.perf_counter() - start


class Ours:
    """``CheckpointManager`` under a memory tier; versions after the first stay in memory."""

    def __init__(self, url: str, tier: Path, device: str) -> None:
        self.client, self.beats = joined(url, "bench-cuda")
        self.device = device
        os.environ[MEMORY_ENV] = str(tier)
        try:
            self.manager = CheckpointManager(self.client, progress=False, persist_every=1_000_000)
        finally:
            os.environ.pop(MEMORY_ENV, None)
        self.step = 0
        self.held: list[float] = []
        self.staged: list[float] = []
        self.persisted: list[float] = []
        self.versions: list[int] = []

    def save(self, state: dict[str, Any]) -> float:
        self.step += 1
        sync(self.device)
        start = time.perf_counter()
        handle = self.manager.save(state, self.step)
        held = time.perf_counter() - start
        assert handle is not None
        staged = self.manager.wait_staged()
        info = handle.result()
        assert info.state == "committed", info
        self.persisted.append(time.perf_counter() - start)
        self.held.append(held)
        self.staged.append(staged)
        self.versions.append(info.version)
        return held

    def restore(self, version: int, into: Any, nbytes: int, where: str) -> Any:
        """Loads ``version`` into ``into``; checks where its bytes came from."""
        if where == "memory":
            manager = self.manager
        else:  # a manager with no tier reads storage
            manager = CheckpointManager(self.client, progress=False)
        restored = manager.load(version, into)
        sources = restored.bytes_from
        if where == "memory":
            assert sources.get("storage", 0) == 0 and sources.get("memory", 0) >= nbytes, sources
        else:
            assert sources.get("storage", 0) >= nbytes, sources
            manager.close()
        return restored.state

    def close(self) -> None:
        self.manager.close()
        self.beats.stop()
        self.client.close()


class Dcp:
    """``dcp.async_save`` to a ``FileSystemWriter``; its last directory stays for the
    restore's anchor."""

    def __init__(self, work: Path, name: str, options: StagingOptions | None) -> None:
        self.work, self.name, self.options = work, name, options
        self.stager = DefaultStager(options) if options is not None else None
        self.count = 0
        self.last: Path | None = None

    def save(self, state: dict[str, Any], device: str) -> float:
        if self.last is not None:
            shutil.rmtree(self.last, ignore_errors=True)
        target = self.work / f"{self.name}-{self.count}"
        self.count += 1
        if self.options is not None and not REUSABLE_STAGER:
            self.stager = DefaultStager(self.options)
        sync(device)
        start = time.perf_counter()
        response = dcp.async_save(
            state, checkpoint_id=str(target), async_stager=self.stager, no_dist=True
        )
        if isinstance(response, Future):
            blocked = time.perf_counter() - start
            response.result()
        else:
            response.staging_completion.result()
            blocked = time.perf_counter() - start
            response.upload_completion.result()
        self.last = target
        return blocked

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
        if self.last is not None:
            shutil.rmtree(self.last, ignore_errors=True)


def busy_save(ours: Ours, state: dict[str, Any]) -> None:
    """One more save with the GPU busy, as a training loop calls it (its step's kernels
    still queued), under torch's sync debug mode: does ``save()`` wait for the queue?
    Each synchronizing call it makes is printed with the frame that made it."""
    a = torch.randn(8192, 8192, device="cuda")
    out = torch.empty_like(a)
    torch.mm(a, a, out=out)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        torch.mm(a, a, out=out)
    torch.cuda.synchronize()
    queued = time.perf_counter() - start
    for _ in range(10):  # queued again; the host does not wait for it
        torch.mm(a, a, out=out)
    ours.step += 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            start = time.perf_counter()
            handle = ours.manager.save(state, ours.step)
            held = time.perf_counter() - start
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert handle is not None
    ours.versions.append(handle.result().version)  # the newest: the tier keeps it
    ours.manager.wait_staged()
    # The mode's own notice that it is a prototype is no synchronizing call.
    caught = [w for w in caught if "is a prototype feature" not in str(w.message)]
    print(
        f"ours with {queued * 1e3:.0f} ms of GPU work queued ahead: save() held "
        f"{held * 1e3:.1f} ms; synchronizing calls in it: {len(caught)}"
    )
    for w in caught[:3]:
        print(f"  {w.filename}:{w.lineno}: {str(w.message)[:160]}")


def drop_caches() -> bool:
    """Empties the page cache (root on Linux), so a read from disk reads the disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def free_gib(path: Path) -> float:
    return shutil.disk_usage(path).free / GiB


def one_size(url: str, work: Path, shm: Path, gib: float, args: argparse.Namespace) -> None:
    device = args.device
    state = make_state(gib, args.width, device)
    flat = tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in flat.values())
    size = f"{nbytes / GiB:.2f} GiB"
    print(
        f"\n== {size} of model + Adam state in {len(flat)} tensors on {device}, "
        f"{args.width}x{args.width} layers =="
    )
    repeat = args.repeat if gib <= 4 else 1  # 16 GiB: one timed save each, after warm-ups
    results: dict[str, list[float]] = {}

    def run(name: str, f: Callable[[], float], rounds: int) -> None:
        try:
            results[name] = [f() for _ in range(rounds)]
        except Exception as e:  # one anchor's failure leaves the others' figures
            print(f"{name}: FAILED {type(e).__name__}: {e}")

    # 1. The pinned copy.
    start = time.perf_counter()
    pinned = {
        k: torch.empty(v.shape, dtype=v.dtype, pin_memory=device == "cuda") for k, v in flat.items()
    }
    print(f"pinned host buffers allocated once in {time.perf_counter() - start:.2f} s")

    def copy() -> float:
        sync(device)
        start = time.perf_counter()
        for k, v in flat.items():
            pinned[k].copy_(v, non_blocking=device == "cuda")
        sync(device)
        return time.perf_counter() - start

    copy()  # warm-up
    run("pinned copy (device to host)", copy, max(3, repeat))
    pinned.clear()

    # 2. Ours.
    ours = Ours(url, shm / "tier", device)
    run("ours (memory tier)", lambda: ours.save(state), repeat + 1)
    # 3. DCP.
    dcp_plain = Dcp(work, "dcp-plain", None)
    run("dcp.async_save as it comes", lambda: dcp_plain.save(state, device), repeat)
    gpu = device == "cuda"  # pinning and non-blocking copies need an accelerator
    shared = StagingOptions(gpu, True, False, gpu)
    dcp_pinned = Dcp(work, "dcp-pinned", shared)
    per_save = "" if REUSABLE_STAGER else ", a new stager per save"
    run(
        f"dcp.async_save, pinned shared-memory stager{per_save}",
        lambda: dcp_pinned.save(state, device),
        repeat,
    )
    dcp_pinned.close()

    # 4. torch.save.
    def torch_save() -> float:
        target = work / "torch_save.pt"
        sync(device)
        start = time.perf_counter()
        torch.save(state, target)
        elapsed = time.perf_counter() - start
        target.unlink()
        return elapsed

    run("torch.save", torch_save, repeat)

    copy_s = statistics.median(results.get("pinned copy (device to host)", [float("nan")]))
    print(f"{'blocked per save':<58}{'median':>10}{'x the copy':>12}{'rounds':>8}")
    for name, values in results.items():
        if name.startswith("ours"):
            first, values = values[0], values[1:]
        median = statistics.median(values)
        print(f"{name:<58}{median * 1e3:>8.1f} ms{median / copy_s:>12.3f}{len(values):>8}")
    if "ours (memory tier)" in results:
        held = statistics.median(results["ours (memory tier)"][1:])
        staged = statistics.median(ours.staged[1:])
        persisted = statistics.median(ours.persisted[1:])
        verdict = "met" if held <= GOAL * copy_s else "NOT met"
        print(
            f"ours: save() held {held * 1e3:.1f} ms = {held / copy_s:.3f}x the pinned copy "
            f"(goal <= {GOAL}x: {verdict}); a wait_staged() right after waited "
            f"{staged * 1e3:.1f} ms; in the memory tier (committed) after "
            f"{persisted:.2f} s, {nbytes / persisted / MB:,.0f} MB/s"
        )
        print(
            f"ours: the first save (pinned buffers allocated) held {first * 1e3:.1f} ms, "
            f"committed after {ours.persisted[0]:.2f} s (to local storage too)"
        )

    if device == "cuda":
        busy_save(ours, state)

    # Restores into device memory.
    into = templates(state)
    rates: dict[str, float] = {}

    def restore(name: str, load: Callable[[], Any]) -> None:
        try:
            label = name
            if "disk" in name:
                label += " (cold)" if drop_caches() else " (page cache: not dropped)"
            for t in tensors(into).values():
                t.fill_(float("nan") if t.dtype.is_floating_point else 123)
            got: list[Any] = []
            elapsed = timed(lambda: got.append(load()), device)
            bad = mismatches(got[0], state)
            rates[name] = nbytes / elapsed / MB
            equal = "bit for bit" if not bad else f"{len(bad)} DIFFER: {bad[:3]}"
            print(f"{label:<58}{rates[name]:>10,.0f} MB/s  {elapsed:.2f} s  {equal}")
        except Exception as e:
            print(f"{name}: FAILED {type(e).__name__}: {e}")

    print(f"{'restore into device memory':<58}{'rate':>15}")
    if ours.versions:
        restore(
            "ours, from the memory tier",
            lambda: ours.restore(ours.versions[-1], into, nbytes, "memory"),
        )
        restore(
            "ours, from local disk",
            lambda: ours.restore(ours.versions[0], into, nbytes, "storage"),
        )
    if dcp_plain.last is not None:
        last = dcp_plain.last

        def dcp_load() -> Any:
            dcp.load(into, checkpoint_id=str(last), no_dist=True)
            return into

        restore("dcp.load, FileSystemReader, from local disk", dcp_load)
    anchor = rates.get("dcp.load, FileSystemReader, from local disk")
    for name in ("ours, from the memory tier", "ours, from local disk"):
        if anchor and name in rates:
            print(f"{name}: {rates[name] / anchor:.2f}x DCP's FileSystemReader")
    dcp_plain.close()
    ours.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", default="4,16", help="sizes of the state, comma-separated")
    parser.add_argument("--repeat", type=int, default=2, help="timed saves at 4 GiB or less")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--work", type=Path, default=ROOT / "build", help="local disk")
    args = parse(parser, {"device": "cpu", "gib": "0.02", "width": 128, "repeat": 1})
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print(
            "CUDA is absent: nothing measured (this bench is for a GPU; "
            "--device cpu runs its paths on the CPU)"
        )
        return 0
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        print(
            f"torch {torch.__version__}, {props.name} ({props.total_memory / GiB:.0f} GiB), "
            f"{os.cpu_count()} CPUs"
        )
    else:
        print(f"torch {torch.__version__}, the CPU ({os.cpu_count()} CPUs)")
    args.work.mkdir(parents=True, exist_ok=True)
    shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else args.work
    os.environ[KEEP_ENV] = "1"  # the tier holds the newest version (2 while one is written)
    for gib in (float(g) for g in args.gib.split(",")):
        with tempfile.TemporaryDirectory(dir=args.work) as tmp:
            work = Path(tmp)
            shm = Path(tempfile.mkdtemp(dir=shm_root, prefix="rallypoint-bench-"))
            need = 2.2 * gib
            disk, memory = free_gib(work), free_gib(shm)
            if disk < need or memory < need:
                print(
                    f"\n== {gib:g} GiB skipped: needs ~{need:.0f} GiB free on the disk and "
                    f"in {shm_root}; {disk:.0f} and {memory:.0f} GiB are =="
                )
                shutil.rmtree(shm, ignore_errors=True)
                continue
            coordinator = Coordinator(["--storage", f"local:{work / 'storage'}"], {}).start()
            try:
                one_size(coordinator.url, work, shm, gib, args)
                if device == "cuda":
                    torch.cuda.empty_cache()  # the last size's state is gone
            finally:
                coordinator.stop()
                shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
