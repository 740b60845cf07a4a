"""Staging: the copy of a rank's tensors that a save writes from, made while training goes
on.

State does not change the moment ``save()`` returns: parameters and optimizer state stay
as they are until the optimizer's next ``step()``. So :meth:`Staging.stage` only lays
out the copy and hands it to a copy thread (CPU tensors: torch's copies release the GIL;
CUDA tensors: on a side stream, after an event recorded at the ``save()`` call), and
returns. :meth:`Staged.fence` is what has to wait: the manager calls it before anything
can change the saved tensors (an optimizer's step, a ``load_state_dict``, the next save,
an explicit ``wait_staged()``). On CUDA the fence makes the training stream wait for the
copy's event, so even then the host does not block.

Tensors smaller than :data:`EAGER_BYTES` are copied before ``save()`` returns: a forward
pass changes small buffers in place (batch norm's running statistics, a step counter),
and the copy costs next to nothing.

Where the copy goes:

- CPU tensors, into the memory tier's file for this rank
  (:meth:`NodeMemory.staging_file`), mapped shared, when the node runs the tier: the file
  becomes the version's data file, so a save to memory is one copy from the training
  state, and the peer copy and the upload read from it;
- else into buffers kept from one save to the next (pinned for CUDA): fresh memory costs
  a page fault per 4 KiB on first touch. CUDA tensors always go here, tier or not: an
  asynchronous copy needs pinned memory, and pinning the tier's file
  (``cudaHostRegister``) for each save made the next optimizer step wait 311.7 ms for 517
  MiB on an H200, where the fences of the pinned-buffer path took 0.1 ms (``save()``
  itself took 50 ms in that training loop, not explained: alone it held 1.1 ms for 4 GiB,
  and 1.7 ms with 215 ms of GPU work queued, no synchronizing call in it); with the tier
  on the machine's disk rather than tmpfs the registration failed, and the copies into
  the mapping failed with "CUDA error: invalid argument". The tier's file is then written
  from the buffers by the save's writer, in the background.

DCP's ``DefaultStager`` deep-copies the state, DTensors included, through DTensor's
dispatch; here only each tensor's local data is copied. The DTensors themselves stay in
the staged state for DCP to plan from (their shapes and placements, never their values),
and :class:`StagedPlanner` hands DCP the copies when it writes.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from .._bytes import map_shared
from ..memory import NodeMemory

__all__ = ["ALIGN", "EAGER_BYTES", "Staged", "StagedFile", "StagedPlanner", "Staging"]

log = logging.getLogger("rallypoint.trainer")

#: Tensors under this size are copied before ``save()`` returns (see the module's doc).
EAGER_BYTES = 64 << 10
#: Items' offsets in a data file are multiples of this.
ALIGN = 64


@dataclass
class _Item:
    """One tensor of the state to copy."""

    key: int  # id() of the tensor object in the staged state (DCP resolves by it)
    path: str  # its place in the state: buffers are kept per place
    source: torch.Tensor  # its local data (a clone, for an eager one)
    offset: int  # in the staged file


@dataclass
class StagedFile:
    """The memory tier's file one save staged into (see the module's doc)."""

    path: Path
    #: The file mapped shared, as bytes; the items lie at their offsets.
    mapping: torch.Tensor
    #: Bytes the tensors take (the file's size as staged).
    size: int
    #: Where each tensor's copy lies, by ``id`` of the tensor in the staged state.
    offsets: dict[int, int]


class Staged:
    """One save's copy, scheduled or done.

    Attributes:
        state: The state to plan from: the caller's own tensors, every other value a
            deep copy.
        file: The memory tier's file it was staged into, once the copy made it; None
            when it went to process memory.
        copy_seconds: How long the copy took, once done.
    """

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.file: StagedFile | None = None
        self.copy_seconds = 0.0
        self._copies: dict[int, torch.Tensor] = {}
        self._future: Future[None] | None = None
        self._event: Any = None  # a torch.cuda.Event: the side stream's copies are done
        self._fenced = threading.Event()
        #: Seconds the training thread waited in fences for this copy.
        self.waited = 0.0

    def copies(self) -> dict[int, torch.Tensor]:
        """The copy of each tensor, by ``id`` of the tensor in :attr:`state`; waits for
        the copy, and raises what it raised."""
        self.ready()
        return self._copies

    def done(self) -> bool:
        """Whether the copy is done (on CUDA: whether its copies are queued)."""
        return self._future is None or self._future.done()

    def fence(self) -> float:
        """Waits until the saved tensors may change: for the copy thread, then, on CUDA,
        makes the current stream wait for the copy's event (the host does not wait for
        the GPU). Errors of the copy are left to the save, which raises them.

        Returns:
            The seconds the host waited.
        """
        if self._fenced.is_set():
            return 0.0
        started = time.perf_counter()
        if self._future is not None:
            with contextlib.suppress(Exception):
                self._future.result()
        if self._event is not None:
            torch.cuda.current_stream(self._event.device).wait_event(self._event)
        self._fenced.set()
        waited = time.perf_counter() - started
        self.waited += waited
        return waited

    def ready(self) -> None:
        """Waits until the copy has landed in host memory (the save's writer)."""
        if self._future is not None:
            self._future.result()
        if self._event is not None:
            self._event.synchronize()

    def close(self, memory: NodeMemory | None) -> None:
        """Ends the save's hold on the copy: a staged file no version adopted (the save
        failed, or its step was saved already) goes back to the tier for reuse."""
        with contextlib.suppress(Exception):
            self.ready()  # a copy still running must not write into a reused file
        staged = self.file
        if staged is None:
            return
        if memory is not None and staged.path.exists():
            memory.discard(staged.path)
        self._copies = {}


class Staging:
    """Copies a state's tensors for a save (see the module's doc).

    Args:
        memory: This node's memory tier, if it runs one: saves stage into its files.
        rank: This process's global rank (it names the staging files).
    """

    def __init__(self, memory: NodeMemory | None = None, rank: Callable[[], int] = lambda: 0):
        self._memory = memory
        self._rank = rank
        self._buffers: dict[str, torch.Tensor] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, Any] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held in process memory from one save to the next."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @torch.no_grad()
    def stage(self, state: Mapping[str, Any], *, overlap: bool = True) -> Staged:
        """Schedules the copy of ``state`` for a save in the background.

        Args:
            state: The state to save.
            overlap: Return before the copy is done (see the module's doc); False copies
                before returning, as releases before 0.9 did.

        Returns:
            The staged state; :meth:`Staged.fence` before ``state``'s tensors change.
        """
        items: list[_Item] = []
        offset = 0
        accelerated = False
        devices: set[torch.device] = set()

        def walk(value: Any, path: str) -> Any:
            nonlocal offset, accelerated
            if isinstance(value, DTensor) or type(value) in (torch.Tensor, torch.nn.Parameter):
                local = value.to_local() if isinstance(value, DTensor) else value
                local = local.detach()
                nbytes = local.numel() * local.element_size()
                if local.device.type != "cpu":
                    accelerated = True
                    devices.add(local.device)
                if nbytes < EAGER_BYTES:
                    local = local.clone()  # changed in place by the next forward, maybe
                offset += -offset % ALIGN
                items.append(_Item(id(value), path, local, offset))
                offset += nbytes
                return value
            if isinstance(value, Mapping):
                return {k: walk(v, f"{path}.{k}") for k, v in value.items()}
            if isinstance(value, list):
                return [walk(v, f"{path}.{i}") for i, v in enumerate(value)]
            # Plain values, tuples (DCP stores them whole) and other tensor types.
            return copy.deepcopy(value)

        staged = Staged({k: walk(v, k) for k, v in state.items()})
        cuda = accelerated and all(d.type == "cuda" for d in devices)
        if accelerated and not cuda:
            overlap = False  # no stream to order the copy after save() on: copy now
        marker = None
        if cuda:
            # The copies read the tensors as of this point of the training stream(s).
            marker = {d: torch.cuda.current_stream(d).record_event() for d in devices}

        def run() -> None:
            started = time.perf_counter()
            self._copy(staged, items, offset, marker)
            staged.copy_seconds = time.perf_counter() - started

        if overlap:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="rallypoint-stage")
            staged._future = self._executor.submit(run)
        else:
            run()
            if staged._event is not None:
                staged._event.synchronize()
            staged._fenced.set()
        return staged

    def _copy(
        self,
        staged: Staged,
        items: list[_Item],
        size: int,
        marker: dict[torch.device, Any] | None,
    ) -> None:
        # CUDA tensors go to pinned buffers, never into the tier's file (the module's doc).
        to_file = self._memory is not None and marker is None
        targets = self._file_targets(staged, items, size) if to_file else None
        if targets is None:
            targets = self._buffer_targets(items)
        if marker is None:
            for item, target in zip(items, targets, strict=True):
                target.copy_(item.source)
        else:
            staged._event = self._cuda_copy(items, targets, marker)
        staged._copies = {item.key: target for item, target in zip(items, targets, strict=True)}
        items.clear()  # the sources are no longer needed: let them go

    def _file_targets(
        self, staged: Staged, items: list[_Item], size: int
    ) -> list[torch.Tensor] | None:
        """Views of a staging file of the memory tier, one per item, or None if the tier
        cannot hold it."""
        assert self._memory is not None
        path = self._memory.staging_file(self._rank(), size)
        if path is None:
            return None
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = map_shared(fd)
        finally:
            os.close(fd)
        staged.file = StagedFile(path, mapping, size, {i.key: i.offset for i in items})
        views = []
        for item in items:
            nbytes = item.source.numel() * item.source.element_size()
            raw = mapping[item.offset : item.offset + nbytes]
            views.append(raw.view(item.source.dtype).view(item.source.shape))
        return views

    def _buffer_targets(self, items: list[_Item]) -> list[torch.Tensor]:
        """Buffers kept from one save to the next, one per item, by its place."""
        seen = set()
        targets = []
        for item in items:
            local = item.source
            buffer = self._buffers.get(item.path)
            if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                self._buffers.pop(item.path, None)  # the old one goes first: peak memory
                pin = local.device.type == "cuda"
                buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=pin)
                self._buffers[item.path] = buffer
            seen.add(item.path)
            targets.append(buffer)
        for gone in self._buffers.keys() - seen:  # the state lost a tensor: free its copy
            del self._buffers[gone]
        return targets

    def _cuda_copy(
        self, items: list[_Item], targets: list[torch.Tensor], marker: dict[torch.device, Any]
    ) -> Any:
        """Queues the device-to-host copies on a side stream of each device, after the
        ``save()`` call's point of the training stream; returns an event for all."""
        done = None
        for device, event in marker.items():
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            side.wait_event(event)
            with torch.cuda.stream(side):
                for item, target in zip(items, targets, strict=True):
                    if item.source.device != device:
                        continue
                    target.copy_(item.source, non_blocking=True)
                    # The caching allocator must not hand the source's memory to the
                    # training stream before this stream has read it.
                    item.source.record_stream(side)
                done = side.record_event()
        for item, target in zip(items, targets, strict=True):
            if item.source.device.type == "cpu":
                target.copy_(item.source)
        if len(marker) > 1:
            for device in marker:
                self._streams[device].synchronize()
        return done

    def close(self) -> None:
        """Frees the buffers and stops the copy thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._buffers.clear()


class StagedPlanner(DefaultSavePlanner):
    """DCP's default planner, writing tensors from the copies :class:`Staging` made."""

    def __init__(self, staged: Staged) -> None:
        super().__init__()
        self.staged = staged

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | Any:
        """See base class. Waits for the copy first."""
        if write_item.type != WriteItemType.BYTE_IO:
            copies = self.staged.copies()
            staged = copies.get(id(self.state_dict[write_item.index.fqn]))
            if staged is not None:
                return staged
        return super().resolve_data(write_item)
