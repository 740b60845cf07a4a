"""``bench/checkpoint.py --mode loop``: what saving costs a training loop, side by side.

One process trains an MLP with Adam on the CPU and saves its state (parameters and
Adam's moments) every ``SAVE_EVERY`` steps; the batch is sized so that a step takes
about ten times the copy of the state. In the same run, alternating rounds of
``--steps`` steps each:

- no saves (the baseline steps/s);
- ``CheckpointManager`` with ``overlap=True`` under a memory tier in /dev/shm (every 5th
  version also to local storage), the same with ``overlap=False``, and with
  ``overlap=True`` without a tier (every version to local storage);
- ``dcp.async_save`` to a ``FileSystemWriter`` with a ``DefaultStager`` that caches its
  buffers and stages synchronously, and with asynchronous staging (the loop waits for
  its ``staging_completion`` before the optimizer's step, as DCP asks).

Per save it reports the time training waited (``save()`` itself, plus the fences: the
optimizer's step waiting for the copy) against a plain copy of the state into
preallocated buffers, and steps/s against the baseline. Every variant's save of the
previous round has finished before the next round starts.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from rallypoint.client import ElasticClient, JobSpec
from rallypoint.trainer import CheckpointManager, SaveHandle
from rallypoint.trainer.memory import MEMORY_ENV

SAVE_EVERY = 5
MiB = 1 << 20


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

    def __init__(self, mib: int, ratio: float) -> None:
        self.model = _model(mib)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.batch = 8
        self.step()  # Adam's moments exist from here on
        tensors = _tensors(_state(self.model, self.optimizer))
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        buffers = [torch.empty_like(t) for t in tensors]

        def copy() -> float:
            start = time.perf_counter()
            for b, t in zip(buffers, tensors, strict=True):
                b.copy_(t)
            return time.perf_counter() - start

        copy()
        self.copy = statistics.median(copy() for _ in range(5))
        while self._timed_step() < ratio * self.copy:
            self.batch *= 2
        self.step_time = statistics.median(self._timed_step() for _ in range(3))

    def _timed_step(self) -> float:
        start = time.perf_counter()
        self.step()
        return time.perf_counter() - start

    def forward_backward(self) -> None:
        x = torch.randn(self.batch, 1024)
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
        self.handles = []


class _Dcp(_Saver):
    def __init__(self, work: Path, asynchronous: bool) -> None:
        super().__init__()
        self.work = work
        self.stager = DefaultStager(StagingOptions(False, False, asynchronous, False))
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


def run(url: str, work: Path, mib: int, steps: int, rounds: int) -> None:
    """Runs every variant ``rounds`` times, alternating, and prints the table."""
    loop = _Loop(mib, ratio=10.0)
    print(
        f"\nloop: {loop.nbytes / MiB:.0f} MiB of state (an MLP and Adam), a step "
        f"{loop.step_time * 1e3:.0f} ms at batch {loop.batch}, a copy of the state "
        f"{loop.copy * 1e3:.1f} ms ({loop.step_time / loop.copy:.1f} copies per step); "
        f"a save every {SAVE_EVERY} steps, {steps} steps a round, {rounds} rounds"
    )
    client = ElasticClient(url, "bench-loop", "n0")
    spec = JobSpec(min_nodes=1, max_nodes=1, last_call=timedelta(0))
    client.join("127.0.0.1", 29500, spec=spec, timeout=timedelta(seconds=60))
    client.heartbeats(timedelta(seconds=1))
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
    variants["dcp.async_save, cached stager"] = _Dcp(work, asynchronous=False)
    variants["dcp.async_save, async staging"] = _Dcp(work, asynchronous=True)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for round_ in range(rounds + 1):  # the first round warms every variant up
            for name, saver in variants.items():
                start = time.perf_counter()
                for step in range(1, steps + 1):
                    loop.step(saver)
                    if saver is not None and step % SAVE_EVERY == 0:
                        saver.save(loop, step)
                elapsed = time.perf_counter() - start
                if saver is not None:
                    saver.settle()  # the last save's upload, outside the timed steps
                    if not round_:
                        saver.waits.clear()
                if round_:
                    rates[name].append(steps / elapsed)
    finally:
        for m in managers.values():
            m.close()
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
