"""A training process's progress: its steps, their pace, and the long phases between.

The coordinator judges hangs and stragglers from what each process reports through its
node's heartbeat (``rallypoint.service``'s health rules). This is the reporting side:
one :class:`StepReporter` per process, fed by hooks on every ``torch.optim.Optimizer``'s
``step`` (``torch.optim.optimizer.register_optimizer_step_post_hook``), so a training
loop reports with no code of its own once a :class:`~rallypoint.trainer.CheckpointManager`
exists, or after one call of :func:`report_steps`. What it keeps:

- the step: the optimizer's steps, counted on from the step a checkpoint restored
  (:meth:`StepReporter.resume_at`);
- the phase: ``start`` until the first step of a generation (start-up, the first step's
  compile), ``train`` after it, and ``save``, ``load`` or ``eval`` inside :func:`phase`
  (the checkpoint manager and the framework integrations mark theirs): each bounded apart
  from training steps by the coordinator;
- the time of the last sign of progress: a step, or the entry into or out of a phase;
- the 95th percentile of the intervals between its recent training steps (the hang
  limit is learned from it);
- its own step time: each step's time less the time it waited for its peers'
  gradients. Hooks on the parameters (``register_post_accumulate_grad_hook``) mark
  when this process's last gradient was ready; the step's pre-hook marks when the
  optimizer could start, after the gradients' all-reduce. The span between is the wait
  for the slowest rank, where a data-parallel rank waits: so a rank slowed down scores
  low and the ranks waiting for it do not. Where no gradient hook fires (ZeRO's flat
  partitions, a closure that runs the backward inside ``step``) there is no own time.
  The waits in the trainer's own collectives (a preemption vote, a generation's check)
  are left out too. On CUDA the times are the host's: a GPU that runs slow shows where
  the host waits for it (a ``loss.item()``).

Under a Rallypoint agent the record goes to a file its agent reads
(:mod:`._record`); in a process that is its own node, to its client's heartbeats.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from rallypoint.client import GENERATION_ENV, ElasticClient, Phase, RankProgress
from rallypoint.client.models import STRAGGLER_WINDOW

from ._record import PROGRESS_ENV, Record, write_record
from ._stacks import STACKS_SIGNAL, stacks_file

__all__ = ["StepReporter", "follow", "phase", "report_steps", "reporter", "waiting"]

log = logging.getLogger("rallypoint.trainer")

#: Step intervals kept for the percentile, and the fewest that make one.
_INTERVALS, _MIN_INTERVALS = 64, 8
#: Own step times kept (with their times), and the fewest in a window that make a mean.
_OWNS, _MIN_OWNS = 64, 3


class StepReporter:
    """This process's progress (see the module's docstring).

    Args:
        folder: The node's progress folder (its agent's), or None: the process is its
            own node, and its client's heartbeats carry :meth:`progress`.
        local_rank: Its rank on the node (its record's name).
        generation: The generation it starts in (0: not known yet).
    """

    def __init__(self, folder: Path | None, local_rank: int = 0, generation: int = 0) -> None:
        self.folder = folder
        self.local_rank = local_rank
        self.generation = generation
        self._lock = threading.Lock()
        self._base = 0  # the step a restore resumed at
        self._count = 0  # the primary optimizer's steps since
        self._phases: list[Phase] = []
        self._trained = False  # a step since the generation began
        self._last = time.monotonic()
        self._prev: float | None = None  # the last training step's end, if no phase since
        self._intervals: deque[float] = deque(maxlen=_INTERVALS)
        self._owns: deque[tuple[float, float]] = deque(maxlen=_OWNS)
        self._pre: float | None = None
        self._grad: float | None = None
        self._grads = 0  # gradients hooked, and accumulated since the last step
        self._seen = 0
        self._ready = False  # this backward's gradients are all ready: it waits for peers
        self._syncs = 0  # the trainer's own collectives it is in
        self._synced = 0.0  # seconds in them since the last step: waits, not its own
        self._primary: weakref.ref[torch.optim.Optimizer] | None = None
        self._hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._handles: list[Any] = []
        self._fd: int | None = None
        self._faults: IO[str] | None = None

    @property
    def path(self) -> Path | None:
        """Its record's file (None: the process is its own node)."""
        return None if self.folder is None else self.folder / str(self.local_rank)

    # --- what the hooks and the loop tell it --------------------------------------------

    def install(self) -> StepReporter:
        """Hooks every optimizer's ``step`` and starts its record (once)."""
        if self._handles:
            return self
        self._handles.append(register_optimizer_step_pre_hook(self._on_pre))
        self._handles.append(register_optimizer_step_post_hook(self._on_post))
        if self.folder is not None and self._fd is None:
            with contextlib.suppress(OSError):
                self.folder.mkdir(parents=True, exist_ok=True)
                path = self.folder / str(self.local_rank)
                self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                if self._faults is None:
                    # The fallback for an agent without py-spy: the stacks on a signal.
                    self._faults = open(stacks_file(self.folder, os.getpid()), "a")  # noqa: SIM115
                    faulthandler.register(STACKS_SIGNAL, file=self._faults, all_threads=True)
        self._write()
        return self

    def follow(self, generation: int) -> None:
        """A new generation: ``start`` until its first step, the pace measured anew."""
        with self._lock:
            self.generation = generation
            self._trained = False
            self._phases.clear()
            self._prev = None
            self._intervals.clear()
            self._owns.clear()
            self._last = time.monotonic()
        self._write()

    def resume_at(self, step: int) -> None:
        """The step a restore resumed at: steps count on from it."""
        with self._lock:
            self._base, self._count = step, 0
        self._write()

    @contextlib.contextmanager
    def phase(self, name: Phase) -> Iterator[None]:
        """Marks a phase that may go long without a step (``save``, ``load``, ``eval``):
        its time counts against the job's ``phase_limit``, not its hang limit."""
        with self._lock:
            self._phases.append(name)
            self._last, self._prev = time.monotonic(), None
        self._write()
        try:
            yield
        finally:
            with self._lock:
                with contextlib.suppress(ValueError):
                    self._phases.remove(name)
                self._last, self._prev = time.monotonic(), None
            self._write()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around one of the trainer's own collectives (a preemption vote, a
        generation's check): the process waits for its peers there, a sign of life, and
        if one of them hangs, the coordinator tells it apart from them by this."""
        with self._lock:
            self._syncs += 1
            self._last = entered = time.monotonic()
        self._write()
        try:
            yield
        finally:
            with self._lock:
                self._syncs -= 1
                self._synced += time.monotonic() - entered
            self._write()

    @property
    def step(self) -> int:
        """The training step reached."""
        return self._base + self._count

    def _on_pre(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        if self._is_primary(optimizer):
            self._pre = time.monotonic()
            if self._ready:
                self._ready = False
                self._write()

    def _on_post(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            primary = self._is_primary(optimizer)
            if primary:
                self._count += 1
                self._measure(now)
                self._trained = True
                self._seen, self._ready = 0, False
            self._last = now
        if primary and optimizer not in self._hooked:
            self._hook_gradients(optimizer)
        self._write()

    def _is_primary(self, optimizer: torch.optim.Optimizer) -> bool:
        """The first optimizer that steps counts the steps (a GAN's second one would
        count each step twice); any optimizer's step is a sign of progress."""
        if self._primary is None or self._primary() is None:
            self._primary = weakref.ref(optimizer)
        return self._primary() is optimizer

    def _measure(self, now: float) -> None:
        prev, pre, grad = self._prev, self._pre, self._grad
        if prev is not None and not self._phases:
            self._intervals.append(now - prev)
            if pre is not None and grad is not None and prev < grad <= pre <= now:
                own = (grad - prev) + (now - pre) - self._synced
                self._owns.append((now, max(0.0, own)))
        self._prev = None if self._phases else now
        self._pre = self._grad = None
        self._synced = 0.0

    def _hook_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        self._hooked.add(optimizer)

        def ready(_: torch.Tensor) -> None:
            # A sign of life too; and once every gradient of this backward is ready, the
            # rank waits for its peers' in the all-reduce: it is not the one that hangs.
            self._grad = self._last = time.monotonic()
            self._seen += 1
            ready = self._seen % self._grads == 0
            if ready != self._ready:
                self._ready = ready
                self._write()

        for group in optimizer.param_groups:
            for p in group["params"]:
                if isinstance(p, torch.Tensor) and p.requires_grad and p.is_leaf:
                    hook = p.register_post_accumulate_grad_hook
                    self._handles.append(hook(ready))  # type: ignore[no-untyped-call]
                    self._grads += 1

    # --- what it says -------------------------------------------------------------------

    def _now(self) -> tuple[Phase, float | None, float | None]:
        phase: Phase = self._phases[-1] if self._phases else "train" if self._trained else "start"
        interval = None
        if len(self._intervals) >= _MIN_INTERVALS:
            ordered = sorted(self._intervals)
            interval = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        own = None
        if self._owns:
            edge = self._owns[-1][0] - STRAGGLER_WINDOW
            recent = [o for t, o in self._owns if t >= edge]
            if len(recent) < _MIN_OWNS:
                recent = [o for _, o in list(self._owns)[-_MIN_OWNS:]]
            if len(recent) >= _MIN_OWNS:
                own = statistics.fmean(recent)
        return phase, interval, own

    def record(self) -> Record:
        """What it says now."""
        with self._lock:
            phase, interval, own = self._now()
            return Record(
                os.getpid(),
                _rank(self.local_rank),
                self.generation,
                self.step,
                phase,
                self._last,
                interval,
                own,
                self._ready or self._syncs > 0,
            )

    def progress(self) -> list[RankProgress]:
        """What a heartbeat carries of this process (for a process that is its node)."""
        return [self.record().progress(time.monotonic())]

    def _write(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                write_record(self._fd, self.record())

    def close(self) -> None:
        """Unhooks it and takes its record away: the process is done training (its
        checkpoint manager closed), and its node reports no progress of it any more,
        so a slow exit is not a hang. :func:`report_steps` starts it again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked = weakref.WeakSet()
        self._grads = self._seen = 0
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
            if self.path is not None:
                self.path.unlink(missing_ok=True)


def _rank(local_rank: int) -> int:
    """This process's global rank: torch.distributed's, else torchrun's."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", local_rank))


_reporter: StepReporter | None = None
_made = threading.Lock()


def reporter() -> StepReporter:
    """This process's reporter, made on first use: its record under the agent's progress
    folder (``RALLYPOINT_PROGRESS_DIR``), else for its own client's heartbeats."""
    global _reporter
    with _made:
        if _reporter is None:
            folder = os.environ.get(PROGRESS_ENV)
            generation = os.environ.get(GENERATION_ENV, "")
            _reporter = StepReporter(
                Path(folder) if folder else None,
                int(os.environ.get("LOCAL_RANK", "0")),
                int(generation) if generation.isdigit() else 0,
            )
        return _reporter


def report_steps(client: ElasticClient | None = None) -> StepReporter:
    """Reports this process's progress with its node's heartbeats: every optimizer's
    steps from now on. A :class:`~rallypoint.trainer.CheckpointManager` calls it; a loop
    without one calls it once. Idempotent.

    Args:
        client: The process's client, if it is its own node (no agent): its
            heartbeats carry the progress. Under an agent, the agent reports.

    Returns:
        The process's reporter (:meth:`StepReporter.follow`, :meth:`~StepReporter.
        resume_at` and :meth:`~StepReporter.phase` tell it more).
    """
    found = reporter().install()
    if client is not None:
        if client.assignment is not None and client.assignment.generation != found.generation:
            found.follow(client.assignment.generation)
        if found.folder is None and client.progress is None:
            client.progress = found.progress
    return found


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Around a collective of the trainer's own, in a process that reports steps
    (:meth:`StepReporter.waiting`)."""
    if _reporter is not None and _reporter._handles:
        with _reporter.waiting():
            yield
    else:
        yield


def follow(generation: int) -> None:
    """Moves this process's reporter, if it reports steps, to ``generation`` (a process
    that regroups in place: ``start`` until the new generation's first step)."""
    if _reporter is not None and _reporter._handles:
        _reporter.follow(generation)


@contextlib.contextmanager
def phase(name: Phase) -> Iterator[None]:
    """Marks a phase of this process that may go long without an optimizer step: its
    time counts against the job's ``phase_limit`` (10 minutes by default), not its hang
    limit. The framework integrations mark their evaluations; a hand-written loop marks
    its own::

        with rallypoint.trainer.phase("eval"):
            evaluate(model)
    """
    with reporter().phase(name):
        yield
