"""CheckpointManager: async, sharded saves to the version the coordinator names.

Saving, on every rank of a generation::

    copy this rank's tensors into a reused staging buffer     <- training waits for this
    ---- background thread ----
    begin the step's version (every rank gets the same one, with write URLs)
    hash, upload the shard straight to storage (retried)
    report it; the last rank's report commits the version

Replicated state (identical on every rank, as under DDP) is split so that each rank
writes about ``1/world_size`` of its bytes; ``rank_state`` (RNG, a sampler's iterator)
is written by each rank for itself. Non-tensor values travel in the manifest.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypeVar

import torch

from rallypoint.client import Assignment, ElasticClient, Manifest, ShardFile
from rallypoint.client._models import CheckpointInfo

from ._progress import Progress
from ._shard import Staging, as_memoryview, checksum, layout, read_shard
from ._state import balance, flatten, unflatten
from ._transfer import download, read_object, upload_parts
from .errors import (
    CheckpointCorrupt,
    TransferDenied,
    TransferError,
    TransferNotFound,
)

__all__ = ["CheckpointManager", "Restored", "SaveHandle"]

log = logging.getLogger("rallypoint.trainer")

SHARD = "shard.safetensors"
MANIFEST = "manifest.json"
_HASH_CHUNK = 64 << 20
T = TypeVar("T")


@dataclass(frozen=True)
class Restored:
    """What :meth:`CheckpointManager.load_latest` restored.

    Attributes:
        version: The checkpoint version.
        step: The training step it was saved at.
        generation: The generation that saved it.
        world_size: The number of ranks that saved it (may differ from today's).
        state: The replicated state, as passed to ``save``.
        rank_state: This rank's ``rank_state``; None if no rank of this number saved one
            (the world grew).
        metadata: The ``metadata`` passed to ``save``.
    """

    version: int
    step: int
    generation: int
    world_size: int
    state: Any
    rank_state: Any
    metadata: dict[str, Any] | None


class SaveHandle:
    """A save in flight; :meth:`result` waits for it and raises what it raised."""

    def __init__(self, step: int, future: Future[CheckpointInfo], blocked: float) -> None:
        self.step = step
        self.blocked = blocked
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        """The version once every rank reported (``state == "committed"``) or this
        rank's part is in (``"pending"``).

        Raises:
            StaleGeneration: The generation ended before the save completed; the
                version will never become latest.
            TransferError, CheckpointError: Storage failed after retries.
        """
        return self._future.result(timeout)


class CheckpointManager:
    """Saves and restores a training process's state through the coordinator.

    Args:
        client: The node's client, joined (its assignment names rank, world size,
            generation and the checkpoint to resume from).
        assignment: Overrides ``client.assignment``.
        if_busy: What ``save`` does while the previous save is in flight: ``"wait"``
            for it (the default; training pauses) or ``"skip"`` this save. The staging
            buffer is never overwritten while it is being uploaded.
        progress: Show progress of transfers that take more than a second.
        attempts: Tries per upload or download before giving up.

    Raises:
        ValueError: The client has not joined and no assignment was given.
    """

    def __init__(
        self,
        client: ElasticClient,
        assignment: Assignment | None = None,
        *,
        if_busy: Literal["wait", "skip"] = "wait",
        progress: bool = True,
        attempts: int = 3,
    ) -> None:
        assignment = assignment or client.assignment
        if assignment is None:
            raise ValueError("join() the job first, or pass its assignment")
        if if_busy not in ("wait", "skip"):
            raise ValueError(f"if_busy must be 'wait' or 'skip', not {if_busy!r}")
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.client = client
        self.assignment = assignment
        self.rank = assignment.rank
        self.world_size = assignment.world_size
        self.generation = assignment.generation
        self.if_busy = if_busy
        self.progress = progress
        self.attempts = attempts
        self._staging = Staging()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rallypoint-save")
        self._inflight: SaveHandle | None = None

    # --- saving -------------------------------------------------------------------------

    def save(
        self,
        state: Any,
        step: int,
        *,
        rank_state: Any = None,
        metadata: dict[str, Any] | None = None,
        blocking: bool = False,
    ) -> SaveHandle | None:
        """Saves ``state`` as the checkpoint of ``step``; every rank must call it.

        Returns once the tensors are copied to the staging buffer (or, if ``blocking``,
        once the save is complete); the upload runs in the background.

        Args:
            state: Replicated state, identical on every rank: nested dicts, lists and
                tuples of tensors and plain values (model, optimizer, scheduler,
                sampler position, counters).
            step: The training step; a version becomes latest only if its step is
                newer than the latest's.
            rank_state: This rank's own state (RNG states, an iterator position).
            metadata: Small JSON values to keep in the manifest (loss, epoch).
            blocking: Wait for the upload and the commit.

        Returns:
            A handle on the save, or None if ``if_busy="skip"`` skipped it.

        Raises:
            TypeError: A value cannot be checkpointed (the message says where).
            Anything the previous save raised, if ``blocking``.
        """
        if self._inflight is not None and not self._inflight.done():
            if self.if_busy == "skip":
                log.info("step %d: skipped, step %d is still saving", step, self._inflight.step)
                return None
            self._settle()
        started = time.perf_counter()
        tree, tensors = flatten(state, "s")
        rank_tree, rank_tensors = flatten(rank_state, "k") if rank_state is not None else (None, [])
        try:
            json.dumps([tree, rank_tree, metadata], allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"metadata must be JSON values: {exc}") from None
        owner = balance([t.numel() * t.element_size() for _, t in tensors], self.world_size)
        mine = [nt for nt, rank in zip(tensors, owner, strict=True) if rank == self.rank]
        plan = layout(mine + rank_tensors)
        data = self._staging.stage(plan, dict(mine + rank_tensors))
        blocked = time.perf_counter() - started
        shared = {"state": tree, "user": metadata} if self.rank == 0 else None
        own = {"state": rank_tree}
        future = self._executor.submit(
            self._persist, step, [memoryview(plan.header), data], shared, own
        )
        handle = SaveHandle(step, future, blocked)
        self._inflight = handle
        if blocking:
            handle.result()
        return handle

    def wait(self) -> CheckpointInfo | None:
        """Waits for the save in flight, if any.

        Raises:
            What the save raised.
        """
        return None if self._inflight is None else self._inflight.result()

    def _settle(self) -> None:
        with contextlib.suppress(Exception):  # logged by _persist; the next save goes on
            self.wait()

    def _persist(
        self,
        step: int,
        parts: list[memoryview],
        shared: dict[str, Any] | None,
        own: dict[str, Any],
    ) -> CheckpointInfo:
        try:
            begun = self.client.begin_checkpoint(step, [SHARD], generation=self.generation)
            if begun.state == "committed":
                return self.client.checkpoint(begun.version)
            size = sum(len(p) for p in parts)
            digest = checksum(parts)
            label = f"checkpoint v{begun.version} step {step} rank {self.rank}"

            def upload() -> None:
                progress = Progress(f"{label}: upload", size, enabled=self.progress)
                upload_parts(begun.upload_urls[SHARD], parts, progress)
                progress.close()

            self._retry(upload, f"uploading {label}")
            info = self.client.report_checkpoint(
                begun.version,
                [ShardFile(name=SHARD, size=size, checksum=digest)],
                metadata=shared,
                rank_metadata=own,
                generation=self.generation,
            )
            log.info(
                "%s: %s (%d of %d ranks in)", label, info.state, info.reported, info.world_size
            )
            return info
        except Exception as exc:
            log.error("checkpoint of step %d failed: %s", step, exc)
            raise

    def _retry(self, action: Callable[[], T], what: str) -> T:
        for attempt in range(1, self.attempts + 1):
            try:
                return action()
            except (TransferDenied, TransferNotFound):
                raise  # retrying cannot help
            except TransferError as exc:
                if attempt == self.attempts:
                    raise TransferError(
                        f"{what} failed {self.attempts} times; storage unreachable? {exc}"
                    ) from exc
                delay = min(2.0 ** (attempt - 1), 10.0)
                log.warning("%s failed (%s); retry %d in %.0f s", what, exc, attempt, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    # --- loading ------------------------------------------------------------------------

    def load_latest(self, map_location: str | torch.device | None = None) -> Restored | None:
        """Restores the checkpoint this generation resumes from: the one the coordinator
        named when it sealed the generation, the same for every rank, whatever older or
        newer files any cache holds.

        Args:
            map_location: Where tensors go; by default they stay on the CPU, as
                copy-on-write views of the checkpoint (``load_state_dict`` copies them).

        Returns:
            The restored state, or None if the job has no checkpoint yet.

        Raises:
            CheckpointCorrupt: A shard is missing, truncated or fails its checksum.
            TransferError: Storage failed after retries.
        """
        pointer = self.assignment.checkpoint
        if pointer is None:
            return None
        return self.load(pointer.version, map_location=map_location)

    def load(self, version: int, map_location: str | torch.device | None = None) -> Restored:
        """Restores one version (see :meth:`load_latest`), at any world size.

        Raises:
            UnknownCheckpoint: No such version (or it was collected).
            CheckpointCorrupt: A shard is missing, truncated or fails its checksum.
        """
        info = self.client.checkpoint(version)
        label = f"checkpoint v{version}"
        manifest = self._manifest(info, label)
        replicated: dict[str, torch.Tensor] = {}
        own: dict[str, torch.Tensor] = {}
        for shard in manifest.shards:
            for f in shard.files:
                name = f"rank-{shard.rank:05d}/{f.name}"
                tensors = self._read(info.urls.get(name), f.size, f.checksum, f"{label} {name}")
                for key, tensor in tensors.items():
                    if key.startswith("s"):
                        replicated[key] = tensor
                    elif shard.rank == self.rank:
                        own[key] = tensor

        def resolve(table: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
            def tensor(key: str) -> torch.Tensor:
                if key not in table:
                    raise CheckpointCorrupt(f"{label}: tensor {key} is in no shard")
                found = table[key]
                return found if map_location is None else found.to(map_location)

            return tensor

        shared = manifest.metadata or {}
        rank_state = None
        if self.rank < len(manifest.shards):
            mine = manifest.shards[self.rank].metadata or {}
            rank_state = unflatten(mine.get("state"), resolve(own))
        restored = Restored(
            version=manifest.version,
            step=manifest.step,
            generation=manifest.generation,
            world_size=manifest.world_size,
            state=unflatten(shared.get("state"), resolve(replicated)),
            rank_state=rank_state,
            metadata=shared.get("user"),
        )
        log.info(
            "restored %s (step %d, saved by %d ranks) as rank %d of %d",
            label,
            manifest.step,
            manifest.world_size,
            self.rank,
            self.world_size,
        )
        return restored

    def _manifest(self, info: CheckpointInfo, label: str) -> Manifest:
        url = info.urls.get(MANIFEST)
        if url is None:
            raise CheckpointCorrupt(f"{label} has no manifest in storage")
        try:
            raw = self._retry(lambda: download(url), f"reading {label} manifest")
        except TransferNotFound:
            raise CheckpointCorrupt(f"{label}: its manifest is missing") from None
        try:
            manifest = Manifest.model_validate_json(raw)
        except ValueError as exc:
            raise CheckpointCorrupt(f"{label}: unreadable manifest: {exc}") from exc
        if manifest.version != info.version or len(manifest.shards) != manifest.world_size:
            raise CheckpointCorrupt(f"{label}: the manifest does not describe this version")
        return manifest

    def _read(
        self, url: str | None, size: int, expected: str, what: str
    ) -> dict[str, torch.Tensor]:
        if url is None:
            raise CheckpointCorrupt(f"{what} is missing from storage")

        def fetch() -> torch.Tensor:
            progress = Progress(f"{what}: download", size, enabled=self.progress)
            data = read_object(url, size, progress)
            progress.close()
            return data

        try:
            data = self._retry(fetch, f"reading {what}")
        except TransferNotFound:
            raise CheckpointCorrupt(f"{what} is missing from storage") from None
        if data.numel() != size:
            raise CheckpointCorrupt(f"{what} holds {data.numel()} bytes; the manifest says {size}")
        view = as_memoryview(data)
        progress = Progress(f"{what}: verify", size, enabled=self.progress)
        chunks = (view[i : i + _HASH_CHUNK] for i in range(0, size, _HASH_CHUNK))

        def counted() -> Any:
            for chunk in chunks:
                yield chunk
                progress.update(len(chunk))

        actual = checksum(counted())
        progress.close()
        if actual != expected:
            raise CheckpointCorrupt(f"{what} fails its checksum ({actual}, expected {expected})")
        return read_shard(data, what)

    # --- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Waits for the save in flight and stops the background thread."""
        self._settle()
        self._executor.shutdown(wait=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
