"""``bench/checkpoint.py --mode loop``: what saving costs a training loop, side by side.

One process trains an MLP with Adam on the CPU (or, with ``--device cuda``, on the GPU)
and saves its state (parameters and Adam's moments) every ``SAVE_EVERY`` steps; the batch
is sized so that a step takes about ten times the copy of the state (on the GPU: the copy
into pinned host memory, which is what a save's staging does). In the same run,
alternating rounds of ``--steps`` steps each:

- no saves (the baseline steps/s);
- ``CheckpointManager`` with ``overlap=True`` under a memory tier in /dev/shm (every 5th
  version also to local storage), the same with ``overlap=False``, and with
  ``overlap=True`` without a tier (every version to local storage);
- ``dcp.async_save`` to a ``FileSystemWriter`` with a ``DefaultStager`` that caches its
  buffers and stages synchronously, and with asynchronous staging (the loop waits for
  its ``staging_completion`` before the optimizer's step, as DCP asks).

Per save it reports the time training waited (``save()`` itself, plus the fences: the
optimizer's step waiting for the copy) against a plain copy of the state into
preallocated buffers (pinned, on the GPU), and steps/s against the baseline. On the GPU
every timing ends with ``torch.cuda.synchronize()``: host time alone would count only
the queueing of the work. What the host waited is the figure for a save; whether the
GPU waited shows in steps/s. Every variant's save of the
previous round has finished before the next round starts.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from bench._joined import joined
from rallypoint.trainer import CheckpointManager, SaveHandle
from rallypoint.trainer.memory import MEMORY_ENV

SAVE_EVERY = 5
MiB = 1 << 20
# torch 2.11's DefaultStager fails on its second save (KeyError: <class 'type'> in its
# deep copy), so there the anchor makes a new stager, and new buffers, for every save.
REUSABLE_STAGER = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _model(mib: int) -> torch.nn.Module:
    """An MLP whose parameters take about ``mib / 3`` MiB (Adam's two moments the rest)."""
    width = 1024
    layers = max(1, round(mib * MiB / 3 / 4 / (width * width)))
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *(m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.GELU()))
    )


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in _tensors(v)]
    return []


class _Loop:
    """One model, its optimizer and a batch sized for a step of ``ratio`` copies."""

    def __init__(self, mib: int, ratio: float, device: str = "cpu") -> None:
        self.device = device
        self.model = _model(mib).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.batch = 8
        self.step()  # Adam's moments exist from here on
        tensors = _tensors(_state(self.model, self.optimizer))
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        pinned = device != "cpu"
        buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors]

        def copy() -> float:
            _sync(device)
            start = time.perf_counter()
            for b, t in zip(buffers, tensors, strict=True):
                b.copy_(t, non_blocking=pinned)
            _sync(device)
            return time.perf_counter() - start

        copy()
        self.copy = statistics.median(copy() for _ in range(5))
        while self._timed_step() < ratio * self.copy:
            self.batch *= 2
        self.step_time = statistics.median(self._timed_step() for _ in range(3))

    def _timed_step(self) -> float:
        _sync(self.device)
        start = time.perf_counter()
        self.step()
        _sync(self.device)
        return time.perf_counter() - start

    def forward_backward(self) -> None:
        x = torch.randn(self.batch, 1024, device=self.device)
        self.model(x).square().mean().backward()

    def step(self, saver: _Saver | None = None) -> None:
        self.forward_backward()
        if saver is not None:
            saver.fence()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)


class _Saver:
    """A way of saving; ``waits`` holds what training waited for each save."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def save(self, loop: _Loop, step: int) -> None:
        """Called after the optimizer's step of every ``SAVE_EVERY``th step."""

    def fence(self) -> None:
        """Called between the backward and the optimizer's step."""

    def settle(self) -> None:
        """Waits for the saves in flight; collects the last waits."""


class _Ours(_Saver):
    def __init__(self, manager: CheckpointManager, counter: list[int]) -> None:
        super().__init__()
        self.manager = manager
        self.counter = counter
        self.handles: list[SaveHandle] = []
        self.split: list[tuple[float, float]] = []  # (save() itself, the fences)

    def save(self, loop: _Loop, step: int) -> None:
        self.counter[0] += 1  # a new step for every version, across variants
        handle = self.manager.save(_state(loop.model, loop.optimizer), self.counter[0])
        assert handle is not None
        self.handles.append(handle)
        # The optimizer's next step waits for the copy if needed: handle.waited.

    def settle(self) -> None:
        self.manager.wait()
        self.manager.wait_staged()
        self.waits += [h.blocked + h.waited for h in self.handles]
        self.split += [(h.blocked, h.waited) for h in self.handles]
        self.handles = []


class _Dcp(_Saver):
    def __init__(self, work: Path, asynchronous: bool, device: str = "cpu") -> None:
        super().__init__()
        self.work = work
        # On the GPU, DCP's own best: cached pinned buffers and non-blocking copies.
        gpu = device != "cpu"
        self.options = StagingOptions(gpu, False, asynchronous, gpu)
        self.stager = DefaultStager(self.options)
        self.upload: Future[Any] | None = None
        self.staging: Future[Any] | None = None
        self.counter = 0

    def save(self, loop: _Loop, step: int) -> None:
        start = time.perf_counter()
        if self.upload is not None:
            self.upload.result()  # DCP saves one at a time
            self.upload = None
        shutil.rmtree(self.work / f"dcp-{self.counter - 1}", ignore_errors=True)
        target = self.work / f"dcp-{self.counter}"
        self.counter += 1
        if not REUSABLE_STAGER:
            self.stager = DefaultStager(self.options)
        response = dcp.async_save(
            _state(loop.model, loop.optimizer),
            checkpoint_id=str(target),
            async_stager=self.stager,
            no_dist=True,
        )
        if isinstance(response, Future):
            self.upload = response
        else:
            self.upload, self.staging = response.upload_completion, response.staging_completion
        self.waits.append(time.perf_counter() - start)

    def fence(self) -> None:
        if self.staging is not None:  # the state must not change before it is staged
            start = time.perf_counter()
            self.staging.result()
            self.staging = None
            self.waits[-1] += time.perf_counter() - start

    def settle(self) -> None:
        self.fence()
        if self.upload is not None:
            self.upload.result()
            self.upload = None


def run(url: str, work: Path, mib: int, steps: int, rounds: int, device: str = "cpu") -> None:
    """Runs every variant ``rounds`` times, alternating, and prints the table."""
    loop = _Loop(mib, ratio=10.0, device=device)
    print(
        f"\nloop on {device}: {loop.nbytes / MiB:.0f} MiB of state (an MLP and Adam), a step "
        f"{loop.step_time * 1e3:.0f} ms at batch {loop.batch}, a copy of the state "
        f"{loop.copy * 1e3:.1f} ms ({loop.step_time / loop.copy:.1f} copies per step); "
        f"a save every {SAVE_EVERY} steps, {steps} steps a round, {rounds} rounds"
    )
    client, beats = joined(url, "bench-loop")
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    tier = shm / f"rallypoint-bench-{os.getpid()}"
    counter = [0]

    def manager(memory: bool, overlap: bool) -> CheckpointManager:
        if memory:
            os.environ[MEMORY_ENV] = str(tier)
        else:
            os.environ.pop(MEMORY_ENV, None)
        try:
            return CheckpointManager(
                client, progress=False, overlap=overlap, persist_every=5 if memory else 1
            )
        finally:
            os.environ.pop(MEMORY_ENV, None)

    managers = {
        "ours, memory tier": manager(True, True),
        "ours, memory tier, overlap=False": manager(True, False),
        "ours, no tier (every save to disk)": manager(False, True),
    }
    variants: dict[str, _Saver | None] = {"no saves": None}
    variants.update({name: _Ours(m, counter) for name, m in managers.items()})
    cached = "cached stager" if REUSABLE_STAGER else "new stager per save"
    variants[f"dcp.async_save, {cached}"] = _Dcp(work, asynchronous=False, device=device)
    variants["dcp.async_save, async staging"] = _Dcp(work, asynchronous=True, device=device)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for round_ in range(rounds + 1):  # the first round warms every variant up
            for name, saver in variants.items():
                start = time.perf_counter()
                for step in range(1, steps + 1):
                    loop.step(saver)
                    if saver is not None and step % SAVE_EVERY == 0:
                        saver.save(loop, step)
                _sync(device)
                elapsed = time.perf_counter() - start
                if saver is not None:
                    saver.settle()  # the last save's upload, outside the timed steps
                    if not round_:
                        saver.waits.clear()
                        if isinstance(saver, _Ours):
                            saver.split.clear()
                if round_:
                    rates[name].append(steps / elapsed)
    finally:
        for m in managers.values():
            m.close()
        beats.stop()
        shutil.rmtree(tier, ignore_errors=True)
    base = statistics.median(rates["no saves"])
    print(f"{'':40} {'waited per save':>16} {'x the copy':>10} {'steps/s':>8} {'x no saves':>10}")
    for name, saver in variants.items():
        rate = statistics.median(rates[name])
        if saver is not None:
            wait = statistics.median(saver.waits)
            print(
                f"{name:40} {wait * 1e3:13.1f} ms {wait / loop.copy:10.2f} "
                f"{rate:8.2f} {rate / base:10.3f}"
            )
        else:
            print(f"{name:40} {'':16} {'':10} {rate:8.2f} {1.0:10.3f}")
    for name, saver in variants.items():
        if isinstance(saver, _Ours):
            blocked = statistics.median(b for b, _ in saver.split)
            fences = statistics.median(w for _, w in saver.split)
            print(f"{name}: save() itself {blocked * 1e3:.1f} ms, fences {fences * 1e3:.1f} ms")
