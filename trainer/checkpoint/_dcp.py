"""``torch.distributed.checkpoint`` (DCP) storage over the coordinator's versions.

DCP plans what every rank writes (DTensor and ShardedTensor layouts, one copy of each
replicated tensor) and what every rank reads (resharding to another mesh, placement or
world size). :class:`RallypointWriter` and :class:`RallypointReader` move those bytes
through the coordinator's scoped URLs and commit through its fenced report:

    every rank   prepare_local_plan   begin the step's version (fenced: a zombie stops here)
    every rank   write_data           one file, rank-RRRRR/data.distcp, with a checksum per
                                      item: into this node's memory tier, copied to the
                                      peer the coordinator names, uploaded if the version
                                      is persisted (or the copy failed), and reported
    rank 0       finish               DCP's metadata, rank-00000/dcp.metadata, the same
                                      way; the version commits once all ranks are in

A reader takes each file from the nearest copy: this node's memory, a live peer's, then
blob storage; every item is checked against its checksum wherever it came from.

A file holds each item's bytes as they lie in memory (a tensor's elements in row-major
order, a non-tensor value as ``torch.save`` wrote it), 64-byte aligned, at the offsets
DCP's metadata records, so a reader fetches only the items its plan names and views
local files without a copy. Every item carries its own xxh3-128, checked on read.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import io
import json
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from rallypoint.client import (
    MAX_METADATA_BYTES,
    CheckpointBegun,
    CheckpointInfo,
    ElasticClient,
    KeepBest,
    Manifest,
    PeerGrant,
    ShardFile,
    UnknownCheckpoint,
)
from rallypoint.client.models import rank_folder

from .._bytes import as_memoryview, checksum, own_storage, tensor_bytes
from .._progress import Progress
from ..errors import (
    CheckpointCorrupt,
    CheckpointError,
    TransferDenied,
    TransferError,
    TransferNotFound,
)
from ..memory import INDEX, NodeMemory, map_file, push, read_peer
from ._faults import reached as fault_point
from ._staging import ALIGN, StagedFile, StagedPlanner
from ._transfer import download, read_object, read_range, upload_parts

__all__ = [
    "DATA",
    "METADATA",
    "RallypointReader",
    "RallypointWriter",
    "StoredItem",
    "Summary",
    "retry",
]

log = logging.getLogger("rallypoint.trainer")

#: Every rank's file of a version, in its folder ``rank-RRRRR/``.
DATA = "data.distcp"
#: DCP's metadata (pickled, as DCP's own FileSystemWriter keeps it), in rank 0's folder.
METADATA = "dcp.metadata"
MANIFEST = "manifest.json"
FORMAT = "rallypoint.checkpoint/2"
#: Items closer than this in a file are fetched from Azure in one ranged read: a request
#: costs about what 64 KiB of transfer does, so merging across more wastes bandwidth.
_MERGE_GAP = 64 << 10
#: ... but a span stops growing at this size (an item larger is a span alone): the
#: spans of a file, and the files of a restore, are read in parallel.
_SPAN = 32 << 20
#: Spans or files read at once by one process.
_READERS = 4
T = TypeVar("T")
A = TypeVar("A")


@dataclass(frozen=True)
class StoredItem:
    """Where DCP's metadata finds one item (its ``storage_data``).

    Pickled inside the version's metadata: renaming this class or its module breaks
    every version saved before.
    """

    #: The file, relative to the version's folder (``rank-00003/data.distcp``).
    path: str
    offset: int
    length: int
    checksum: str
    #: For tensors: the dtype's name and the saved chunk's shape; None for bytes items.
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Summary:
    """What a version is, as its manifest (or this node's memory) records it."""

    version: int
    step: int
    generation: int
    world_size: int
    #: The ``metadata`` rank 0 passed to the save.
    metadata: dict[str, Any] | None


def _unpickle(raw: bytes, label: str) -> Metadata:
    # Pickle, as DCP's FileSystemReader reads its own; the bytes are the ones the
    # coordinator's manifest vouches for, or this node's own copy.
    try:
        metadata = pickle.loads(raw)
    except Exception as exc:
        raise CheckpointCorrupt(f"{label}: {METADATA} is unreadable: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointCorrupt(f"{label}: {METADATA} is not DCP metadata")
    return metadata


def retry(action: Callable[[], T], what: str, attempts: int) -> T:
    """Runs ``action``, retrying transfer errors with capped exponential backoff.

    Raises:
        TransferDenied, TransferNotFound: At once; retrying cannot help.
        TransferError: The last attempt failed too.
    """
    for attempt in range(1, attempts + 1):
        try:
            return action()
        except (TransferDenied, TransferNotFound):
            raise
        except TransferError as exc:
            if attempt == attempts:
                raise TransferError(
                    f"{what} failed {attempts} times; storage unreachable? {exc}"
                ) from exc
            delay = min(2.0 ** (attempt - 1), 10.0)
            log.warning("%s failed (%s); retry %d in %.0f s", what, exc, attempt, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def global_rank() -> tuple[int, int]:
    """This process's rank and the number of processes: the default process group's,
    or 0 of 1 without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _done(value: T) -> Future[T]:
    fut: Future[T] = Future()
    fut.set_result(value)
    return fut


class RallypointWriter(StorageWriter):
    """A DCP ``StorageWriter`` that saves one step as a version of the coordinator's.

    Every rank of the job's default process group passes its own writer to the same
    ``dcp.save`` or ``dcp.async_save``; the version commits, and becomes the job's latest
    if its generation still runs and its step is newer, once every rank's files are in::

        writer = RallypointWriter(client, step)
        dcp.save(state, storage_writer=writer)
        writer.info  # this rank's view of the version: "committed" once all are in

    Args:
        client: The node's client, joined.
        step: The training step the version holds.
        generation: Defaults to the client's.
        metadata: Small JSON values kept in the manifest (rank 0's are kept).
        metrics: Finite numbers the version carries (rank 0's are kept).
        keep_best: The rule the job keeps its best versions by (rank 0's is kept).
        keep_last: How many of its newest good versions the job keeps (rank 0's; None:
            the coordinator's setting).
        progress: Show progress of uploads that take more than a second.
        attempts: Tries per upload before giving up.
        memory: This node's memory tier: each file lands there first, and is copied to
            a peer node's.
        persist: Send this version to blob storage whatever the policy.
        persist_every: The policy: every Nth version goes to blob storage (1: all).
        persist_after: ... and any version this many seconds after the last one that
            did.

    Raises:
        TypeError, ValueError: ``metadata`` is not JSON or is over its limit.
    """

    def __init__(
        self,
        client: ElasticClient,
        step: int,
        *,
        generation: int | None = None,
        metadata: dict[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
        keep_best: KeepBest | None = None,
        keep_last: int | None = None,
        progress: bool = False,
        attempts: int = 3,
        memory: NodeMemory | None = None,
        persist: bool = False,
        persist_every: int = 1,
        persist_after: float | None = None,
    ) -> None:
        super().__init__()
        check_metadata(metadata)
        self.persist = persist
        self.persist_every = persist_every
        self.persist_after = persist_after
        self.client = client
        self.step = step
        self.generation = generation
        self.metadata = metadata
        self.metrics = metrics
        self.keep_best = keep_best
        self.keep_last = keep_last
        self.progress = progress
        self.attempts = attempts
        self.memory = memory
        self.rank, self.world_size = 0, 1
        #: This rank's report's answer, once written.
        self.info: CheckpointInfo | None = None
        self._urls: dict[str, str] = {}
        #: When (monotonic) the write URLs are due for renewal: half their lifetime.
        self._renew_at = float("inf")
        self._renewing = threading.Lock()
        #: How many times this rank renewed its write URLs (a long save renews).
        self.renewals = 0
        self._version = 0
        self._committed = False
        self._data: ShardFile | None = None
        self._begun: CheckpointBegun | None = None
        #: Where this rank's files went: blob storage, and the nodes whose memory holds
        #: them (this one, the replica).
        self.storage = False
        self.holders: list[str] = []
        self._parts: list[memoryview] = []
        #: The memory tier's file this rank's tensors were staged into, until adopted.
        self._staged: Path | None = None

    @property
    def version(self) -> int:
        """The version being written (0 before the plan)."""
        return self._version

    def reset(self, checkpoint_id: Any = None) -> None:
        """See base class. ``checkpoint_id`` is not used: the coordinator names versions."""
        self.info, self._urls, self._data, self._committed = None, {}, None, False
        self._begun, self.storage, self.holders, self._parts = None, False, [], []
        self._staged = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """See base class."""
        self.rank, self.world_size = global_rank()
        if is_coordinator != (self.rank == 0):
            raise ValueError(
                "RallypointWriter saves through the job's default process group, with "
                f"global rank 0 as DCP's coordinator (this is rank {self.rank})"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """See base class. Begins the version: a rank of an ended generation stops here."""
        begun = self._begin()
        self._begun = begun
        self._version = begun.version
        self._committed = begun.state == "committed"  # a retried save of a saved step
        return plan

    def _begin(self) -> CheckpointBegun:
        """Begins the step's version (again, to renew the write URLs: the same version
        comes back, and the same claim of this rank)."""
        files = [DATA, METADATA] if self.rank == 0 else [DATA]
        begun = self.client.begin_checkpoint(
            self.step,
            files,
            generation=self.generation,
            rank=self.rank,
            world_size=self.world_size,
            persist=self.persist,
            persist_every=self.persist_every,
            persist_after=self.persist_after,
            memory=self.memory is not None,
        )
        self._urls = begun.upload_urls
        # Renewed at half their lifetime, on this machine's clock: the coordinator's
        # and storage's may differ from it, so a refusal renews too (see _url).
        ttl = begun.upload_ttl
        self._renew_at = float("inf") if ttl is None else time.monotonic() + ttl / 2
        return begun

    def _url(self, name: str, *, renew: bool = False) -> str:
        """The write URL of ``name``, renewed if due or if asked (storage refused it)."""
        with self._renewing:  # parallel block uploads renew once, not once each
            if renew or time.monotonic() >= self._renew_at:
                begun = self._begin()
                self.renewals += 1
                if begun.version != self._version or begun.state != "pending":
                    raise TransferDenied(
                        f"checkpoint v{self._version} step {self.step}: its write URLs "
                        f"cannot be renewed (the step's version is v{begun.version}, "
                        f"{begun.state})"
                    )
            url = self._urls.get(name)
        if url is None:
            raise TransferDenied(f"version {self._version} gave no write URL for {name}")
        return url

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """See base class."""
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """See base class. Uploads this rank's file; ranks other than 0 report it."""
        if self._committed:
            return _done([])
        path = f"{rank_folder(self.rank)}/{DATA}"
        staged = None
        if isinstance(planner, StagedPlanner):
            planner.staged.ready()  # the copy has landed (raises what it raised)
            staged = planner.staged.file
        if staged is not None:
            parts, results, offset = self._in_staged_file(staged, plan, planner, path)
            self._staged = staged.path
        else:
            parts, results, offset = self._laid_out(plan, planner, path)
        # The file's checksum covers its items' checksums: hashing the bytes twice would
        # double the cost of the only CPU-bound part of a save.
        digest = checksum([json.dumps([r.storage_data.checksum for r in results]).encode()])
        self._data = ShardFile(name=DATA, size=offset, checksum=digest)
        self._parts = parts
        items = [
            (r.storage_data.offset, r.storage_data.length, r.storage_data.checksum) for r in results
        ]
        self._place(DATA, parts, offset, items)
        if self.rank != 0:
            self.info = self._report([self._data], None)
        return _done(results)

    @staticmethod
    def _laid_out(
        plan: SavePlan, planner: SavePlanner, path: str
    ) -> tuple[list[memoryview], list[WriteResult], int]:
        """The data file as parts in plan order: each item's bytes, 64-byte aligned."""
        parts: list[memoryview] = []
        results: list[WriteResult] = []
        offset = 0
        for item in plan.items:
            raw, dtype, shape = _item_bytes(item, planner)
            pad = -offset % ALIGN
            if pad:
                parts.append(memoryview(bytes(pad)))
                offset += pad
            parts.append(raw)
            stored = StoredItem(path, offset, len(raw), checksum([raw]), dtype, shape)
            results.append(
                WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=stored)
            )
            offset += len(raw)
        return parts, results, offset

    @staticmethod
    def _in_staged_file(
        staged: StagedFile, plan: SavePlan, planner: SavePlanner, path: str
    ) -> tuple[list[memoryview], list[WriteResult], int]:
        """The data file made of the memory tier's file the tensors were staged into:
        the tensors stay where the copy put them, so nothing is copied again, unless the
        plan leaves some out (a replicated tensor another rank writes): then the rest
        move down over the gaps, in place. Other items (non-tensor values) follow."""
        base = staged.mapping.data_ptr()
        in_file: list[tuple[int, WriteItem, int, str | None, tuple[int, ...] | None]] = []
        others: list[tuple[WriteItem, memoryview, str | None, tuple[int, ...] | None]] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if isinstance(data, torch.Tensor) and data.device.type == "cpu":
                start = data.data_ptr() - base
                nbytes = data.numel() * data.element_size()
                if start >= 0 and start + nbytes <= staged.size and data.is_contiguous():
                    in_file.append(
                        (start, item, nbytes, _dtype_name(data.dtype), tuple(data.shape))
                    )
                    continue
            others.append((item, *_item_bytes(item, planner, data)))
        whole = as_memoryview(staged.mapping)
        results: list[WriteResult] = []
        moved: dict[int, int] = {}
        end = 0
        for start, item, nbytes, kind, dims in sorted(in_file, key=lambda t: t[0]):
            if start not in moved:  # a tensor saved under two names lies there once
                end += -end % ALIGN
                if end != start:  # down over a gap: memmove handles the overlap
                    ctypes.memmove(base + end, base + start, nbytes)
                moved[start] = end
                end += nbytes
            at = moved[start]
            raw = whole[at : at + nbytes]
            stored = StoredItem(path, at, nbytes, checksum([raw]), kind, dims)
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=stored))
        parts: list[memoryview] = [whole[:end]]
        offset = end
        with open(staged.path, "r+b") as f:
            for item, raw, dtype, shape in others:
                pad = -offset % ALIGN
                if pad:
                    parts.append(memoryview(bytes(pad)))
                    offset += pad
                os.pwrite(f.fileno(), raw, offset)
                parts.append(raw)
                stored = StoredItem(path, offset, len(raw), checksum([raw]), dtype, shape)
                results.append(
                    WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=stored)
                )
                offset += len(raw)
            # Nothing reads the mapping past ``end`` from here on (pages past the new
            # end of the file would fault).
            os.truncate(f.fileno(), offset)
        return parts, results, offset

    def _place(
        self, name: str, parts: list[memoryview], size: int, items: list[tuple[int, int, str]]
    ) -> None:
        """Puts one of this rank's files where the version's tier wants it: this node's
        memory, the peer's, and blob storage if the version is persisted or the copies
        are too few (a peer that failed, a node without a memory tier)."""
        begun = self._begun
        assert begun is not None
        path = f"{rank_folder(self.rank)}/{name}"
        # The data file goes first; a later one (rank 0's metadata) goes where it went.
        # A place counts (is named in the report) only once the file can be read there:
        # here once the version's index is written too, on the peer once it took the
        # whole file, in storage once uploaded. A node that dies right after the commit
        # then leaves copies that every rank of the next generation can read.
        first = name == DATA
        if first and self.memory is not None and self._staged is not None:
            # Staged straight into the tier: the file becomes the version's by a rename.
            self.memory.adopt(self._version, path, self._staged)
            self._staged = None
            placed = True
        else:
            placed = self.memory is not None and self.memory.write(self._version, path, parts)
        if placed:
            fault_point("memory", self.step, self.rank)
            if first and self._index():
                self.holders = sorted({*self.holders, self.client.node_id})
                fault_point("indexed", self.step, self.rank)
        elif self.client.node_id in self.holders:
            self.holders.remove(self.client.node_id)
        # The ring's next node, then the standby that would take this node's slot: a
        # copy on the standby lets the node that replaces this one restore from its own
        # memory.
        for peer in (begun.replica, begun.standby):
            if peer is not None and (first or peer.node_id in self.holders):
                self._push(peer, path, parts, items)
        if name == METADATA and begun.standby is not None:
            # With DCP's metadata, what the version is (the index a node writes of its
            # own versions): the standby then reads the whole version from its memory.
            raw = json.dumps(dataclasses.asdict(self._summary())).encode()
            index = f"{rank_folder(self.rank)}/{INDEX}"
            with contextlib.suppress(TransferError):  # it reads the manifest instead
                push(
                    begun.standby,
                    self._version,
                    index,
                    [memoryview(raw)],
                    [(0, len(raw), checksum([raw]))],
                )
        nodes = self.client.assignment.world_size if self.client.assignment else 1
        wanted = begun.persist or len(self.holders) < min(2, nodes)
        if wanted and not self.storage and not first:
            # Rank 0's data stayed in memory, but its metadata must go to storage: the
            # two go together, or the rank's report could not say where both are.
            assert self._data is not None
            self._upload(DATA, self._parts, self._data.size)
        if wanted or self.storage:
            self._upload(name, parts, size)
            self.storage = True
            fault_point("uploaded", self.step, self.rank)

    def _push(
        self, peer: PeerGrant, path: str, parts: list[memoryview], items: list[tuple[int, int, str]]
    ) -> None:
        """Copies one file to ``peer``'s memory; it counts as a holder once it took it."""
        try:
            # One try: storage is the fallback, and waiting to retry a peer that
            # refused the connection would only delay the save.
            push(peer, self._version, path, parts, items)
        except TransferError as exc:
            log.warning(
                "checkpoint v%d: no copy on node %s (%s); storage takes one if the "
                "copies are too few",
                self._version,
                peer.node_id,
                exc,
            )
            if peer.node_id in self.holders:
                self.holders.remove(peer.node_id)
        else:
            self.holders = sorted({*self.holders, peer.node_id})
            fault_point("peer", self.step, self.rank)

    def _index(self) -> bool:
        """Writes the version's index into this node's memory (see ``NodeMemory``)."""
        assert self.memory is not None
        return self.memory.index(self._version, dataclasses.asdict(self._summary()))

    def _summary(self) -> Summary:
        assert self._begun is not None
        return Summary(
            self._version, self.step, self._begun.generation, self.world_size, self.metadata
        )

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """See base class. Rank 0 uploads DCP's metadata and reports last."""
        if self._committed:
            self.info = self.client.checkpoint(self._version)
            return
        storage: dict[MetadataIndex, Any] = {}
        for rank_results in results:
            storage.update({r.index: r.storage_data for r in rank_results})
        metadata.storage_data = storage
        raw = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        if self.memory is not None:
            # This node's own copy of DCP's metadata, beside the index, before the report
            # that commits: a restarted process of this node then reads the version from
            # memory alone, even if this one dies the moment it commits. Other nodes'
            # processes get theirs once dcp.save returns (CheckpointManager).
            self.memory.write(self._version, METADATA, [raw])
        self._place(METADATA, [memoryview(raw)], len(raw), [(0, len(raw), checksum([raw]))])
        assert self._data is not None
        files = [self._data, ShardFile(name=METADATA, size=len(raw), checksum=checksum([raw]))]
        self.info = self._report(files, self.metadata)
        fault_point("committed", self.step, self.rank)

    def _upload(self, name: str, parts: list[memoryview], size: int) -> None:
        label = f"checkpoint v{self._version} step {self.step} rank {self.rank}: {name}"

        def url(*, renew: bool = False) -> str:
            return self._url(name, renew=renew)

        def upload() -> None:
            progress = Progress(f"{label}: upload", size, enabled=self.progress)
            upload_parts(url, parts, progress)
            progress.close()

        retry(upload, f"uploading {label}", self.attempts)

    def _report(self, files: list[ShardFile], metadata: dict[str, Any] | None) -> CheckpointInfo:
        info = self.client.report_checkpoint(
            self._version,
            files,
            metadata={"user": metadata} if self.rank == 0 else None,
            metrics=self.metrics if self.rank == 0 else None,
            keep_best=self.keep_best if self.rank == 0 else None,
            keep_last=self.keep_last if self.rank == 0 else None,
            generation=self.generation,
            rank=self.rank,
            storage=self.storage,
            memory=self.holders,
        )
        log.info(
            "checkpoint v%d step %d rank %d: %s (%d of %d ranks in); files %s%s",
            self._version,
            self.step,
            self.rank,
            info.state,
            info.reported,
            info.world_size,
            "in storage" if self.storage else "in memory",
            f" on {', '.join(self.holders)}" if self.holders else "",
        )
        fault_point("reported", self.step, self.rank)
        return info

    def storage_meta(self) -> None:
        """See base class."""
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """See base class: versions are named by the coordinator, never by an id."""
        return False


class RallypointReader(StorageReader):
    """A DCP ``StorageReader`` of one committed version of the coordinator's.

    With ``version=None`` it reads the version this generation resumes from (the one the
    coordinator named in the client's assignment, the same for every rank), else the
    job's latest. Each rank fetches only the items its load plan names, and checks each
    against its checksum::

        dcp.load(state, storage_reader=RallypointReader(client))

    Args:
        client: The node's client.
        version: The version to read; see above for None.
        progress: Show progress of downloads that take more than a second.
        attempts: Tries per download before giving up.
        memory: This node's memory tier: files held there are read from there.

    Raises:
        UnknownCheckpoint: ``version`` is None and the job has no checkpoint.
    """

    def __init__(
        self,
        client: ElasticClient,
        version: int | None = None,
        *,
        progress: bool = False,
        attempts: int = 3,
        memory: NodeMemory | None = None,
    ) -> None:
        super().__init__()
        if version is None and client.assignment is not None:
            pointer = client.assignment.checkpoint
            if pointer is None:
                raise UnknownCheckpoint("this generation resumes from no checkpoint")
            version = pointer.version
        self.client = client
        self.version = version
        self.progress = progress
        self.attempts = attempts
        self.memory = memory
        #: Bytes read, by source: ``"memory"`` (this node's), ``"peer"`` (another
        #: node's memory) and ``"storage"`` (the manifest's and metadata's too).
        self.bytes_from = {"memory": 0, "peer": 0, "storage": 0}
        self._counting = threading.Lock()  # spans and files are read in parallel
        #: What the version is: from its manifest, or from this node's memory.
        self.summary: Summary | None = None
        self._info: CheckpointInfo | None = None
        self._metadata: Metadata | None = None

    @property
    def label(self) -> str:
        return f"checkpoint v{self.version}" if self.version else "the latest checkpoint"

    def reset(self, checkpoint_id: Any = None) -> None:
        """See base class. ``checkpoint_id`` is not used: pass ``version``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """See base class. Reads the manifest, then DCP's metadata, checked against it.

        Raises:
            CheckpointCorrupt: Either is missing or does not match.
        """
        if self._metadata is not None:
            return self._metadata
        held = self._from_memory()
        if held is not None:
            return held
        info = self._checkpoint()
        manifest = self._manifest(info)
        if manifest.format != FORMAT:
            # Not corrupt: readable by the release that wrote it (so never reported as
            # unrecoverable, which would move the job's pointers back for good).
            raise CheckpointError(
                f"{self.label} was saved by a release of Rallypoint before 0.2 (format "
                f"{manifest.format}); this release reads only {FORMAT} (DCP) versions"
            )
        files = {f.name: f for f in manifest.shards[0].files} if manifest.shards else {}
        if METADATA not in files:
            raise CheckpointCorrupt(f"{self.label}: rank 0 reported no {METADATA}")
        meta_file = files[METADATA]
        whole = StoredItem(f"{rank_folder(0)}/{METADATA}", 0, meta_file.size, meta_file.checksum)
        kept = self._checked(whole.path, [whole])(whole)  # held: the view borrows its memory
        raw = bytes(as_memoryview(kept))
        self.summary = Summary(
            manifest.version,
            manifest.step,
            manifest.generation,
            manifest.world_size,
            (manifest.metadata or {}).get("user"),
        )
        self._metadata = _unpickle(raw, self.label)
        return self._metadata

    def _from_memory(self) -> Metadata | None:
        """DCP's metadata and the summary from this node's memory, if it holds the
        version (a committed one: its summary is written after the commit)."""
        if self.memory is None or self.version is None:
            return None
        summary = self.memory.summary(self.version)
        # Its own copy, or a standby's replica of rank 0's files.
        path = self.memory.find(self.version, METADATA) or self.memory.find(
            self.version, f"{rank_folder(0)}/{METADATA}"
        )
        if summary is None or path is None:
            return None
        raw = path.read_bytes()
        try:
            metadata = _unpickle(raw, self.label)
            self.summary = Summary(**summary)
        except (CheckpointCorrupt, TypeError):
            log.warning("%s: this node's memory copy is unreadable; reading storage", self.label)
            return None
        self.bytes_from["memory"] += len(raw)
        self._metadata = metadata
        return metadata

    def _checkpoint(self) -> CheckpointInfo:
        """The version's record, read URLs included (asked for once)."""
        if self._info is None:
            self._info = self.client.checkpoint(self.version)
            self.version = self._info.version
        return self._info

    def _manifest(self, info: CheckpointInfo) -> Manifest:
        try:
            raw = self._download(MANIFEST)
        except TransferNotFound:
            raise CheckpointCorrupt(f"{self.label}: its manifest is missing") from None
        try:
            manifest = Manifest.model_validate_json(raw)
        except ValueError as exc:
            raise CheckpointCorrupt(f"{self.label}: unreadable manifest: {exc}") from exc
        if manifest.version != info.version or len(manifest.shards) != manifest.world_size:
            raise CheckpointCorrupt(f"{self.label}: the manifest does not describe this version")
        return manifest

    def _url(self, name: str) -> str:
        url = self._checkpoint().urls.get(name)
        if url is None:
            raise CheckpointCorrupt(f"{self.label}: {name} is missing from storage")
        return url

    def _download(self, name: str) -> bytes:
        url = self._url(name)
        try:
            raw = retry(lambda: download(url), f"reading {self.label} {name}", self.attempts)
        except TransferNotFound:
            raise CheckpointCorrupt(f"{self.label}: {name} is missing from storage") from None
        self._count("storage", len(raw))
        return raw

    def _count(self, source: str, n: int) -> None:
        with self._counting:
            self.bytes_from[source] += n

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """See base class."""
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """See base class."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """See base class."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """See base class. Fetches the items of ``plan``, file by file, each checked
        against its checksum before it is used.

        Raises:
            CheckpointCorrupt: A file is missing or short, or an item fails its checksum.
        """
        assert self._metadata is not None
        storage = self._metadata.storage_data
        items: list[tuple[ReadItem, StoredItem]] = []
        for req in plan.items:
            stored = storage.get(req.storage_index)
            if not isinstance(stored, StoredItem):
                raise CheckpointCorrupt(f"{self.label}: {req.storage_index.fqn} has no place")
            items.append((req, stored))
        for req, stored, raw in self._read_items(items):
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(bytes(as_memoryview(raw))))
                continue
            assert stored.dtype is not None and stored.shape is not None
            tensor = raw.view(_dtype(stored.dtype)).view(stored.shape)
            for dim, (start, length) in enumerate(
                zip(req.storage_offsets, req.lengths, strict=True)
            ):
                tensor = tensor.narrow(dim, start, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                # The caller's layout, not the version, is at fault: not reported.
                raise CheckpointError(
                    f"{self.label}: {req.storage_index.fqn} holds {tuple(tensor.size())}, "
                    f"the load plan wants {tuple(target.size())}"
                )
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        return _done(None)

    def _read_items(
        self, items: Sequence[tuple[A, StoredItem]]
    ) -> Iterator[tuple[A, StoredItem, torch.Tensor]]:
        """Each ``(key, item)`` with the item's checked bytes: read file by file, files
        in parallel, each from the nearest copy that checks out (:meth:`_checked`)."""
        per_file: dict[str, list[tuple[A, StoredItem]]] = {}
        for key, stored in items:
            per_file.setdefault(stored.path, []).append((key, stored))
        files = _parallel(
            lambda entry: self._checked(entry[0], [s for _, s in entry[1]]),
            list(per_file.items()),
        )
        for entries, fetched in zip(per_file.values(), files, strict=True):
            for key, stored in entries:
                yield key, stored, fetched(stored)

    def _fetch(
        self, path: str, items: Sequence[StoredItem]
    ) -> Callable[[StoredItem], torch.Tensor]:
        """The bytes of ``items`` of one file: a local file is mapped (its pages read as
        they are used); from Azure, items close together come in one ranged read."""
        url = self._url(path)
        what = f"{self.label} {path}"
        wanted = sorted({(s.offset, s.length) for s in items})
        end = max(o + n for o, n in wanted)
        try:
            if url.startswith("file:"):
                whole = retry(lambda: read_object(url, end), f"reading {what}", self.attempts)
                if whole.numel() < end:
                    raise CheckpointCorrupt(
                        f"{what} holds {whole.numel()} bytes; items end at {end}"
                    )
                self._count("storage", sum(n for _, n in wanted))
                return lambda s: whole[s.offset : s.offset + s.length]
            spans = _merged(items)
            total = sum(stop - start for start, stop in spans)
            progress = Progress(f"{what}: download", total, enabled=self.progress)

            def ranged(start: int, length: int) -> torch.Tensor:
                data = read_range(url, start, length, progress)
                self._count("storage", data.numel())
                return data

            fetched = self._spans(spans, ranged, what)
            progress.close()
        except TransferNotFound:
            raise CheckpointCorrupt(f"{what} is missing from storage") from None
        return fetched

    def read_whole(self, fqns: Sequence[str]) -> dict[str, torch.Tensor]:
        """The tensors of ``fqns`` that were saved whole (one chunk: replicated state),
        each with a storage of its own over what was read: for local files, a
        copy-on-write mapping, so nothing is copied and writing to them never reaches
        the file. They are ordinary tensors (``torch.save`` and safetensors write each
        as itself). Each is checked against its checksum. Others are left to DCP's
        planner.

        Raises:
            CheckpointCorrupt: As for :meth:`read_data`.
        """
        metadata = self.read_metadata()
        wanted: dict[str, StoredItem] = {}
        for fqn in fqns:
            md = metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata) or len(md.chunks) != 1:
                continue
            chunk = md.chunks[0]
            if any(chunk.offsets) or tuple(chunk.sizes) != tuple(md.size):
                continue
            stored = metadata.storage_data.get(MetadataIndex(fqn, chunk.offsets))
            if isinstance(stored, StoredItem) and stored.dtype is not None:
                wanted[fqn] = stored
        out: dict[str, torch.Tensor] = {}
        for fqn, stored, raw in self._read_items(list(wanted.items())):
            assert stored.dtype is not None and stored.shape is not None
            # Each tensor its own storage over the same memory: an ordinary tensor that
            # torch.save and safetensors write as itself (see own_storage).
            out[fqn] = own_storage(raw).view(_dtype(stored.dtype)).view(stored.shape)
        return out

    def _checked(
        self, path: str, items: Sequence[StoredItem]
    ) -> Callable[[StoredItem], torch.Tensor]:
        """The bytes of ``items`` of one file, each checked against its checksum, from
        the nearest copy that checks out: this node's memory, a live peer's memory (the
        holders the coordinator names), then storage.

        Raises:
            CheckpointCorrupt: No copy checks out.
        """
        unique = list({(s.offset, s.length): s for s in items}.values())
        size = sum(s.length for s in unique)
        held = None
        if self.memory is not None and self.version is not None:
            held = self.memory.find(self.version, path)
        if held is not None:
            data = map_file(held)

            def mapped(s: StoredItem) -> torch.Tensor:
                return data[s.offset : s.offset + s.length]

            try:
                self._verify(unique, mapped, f"{self.label} {path} in this node's memory")
            except CheckpointCorrupt as exc:
                log.warning("%s; reading another copy", exc)
            else:
                self._count("memory", size)
                return mapped
        info = self._checkpoint()
        for node in self._holders(info, path):
            grant = info.peers[node]
            what = f"{self.label} {path} on node {node}"
            try:
                fetched = self._spans(
                    _merged(unique),
                    lambda a, n: read_peer(grant, info.version, path, a, n),  # noqa: B023
                    what,
                )
                self._verify(unique, fetched, what)
            except (TransferError, CheckpointCorrupt) as exc:
                log.warning("%s; reading another copy", exc)
                continue
            self._count("peer", size)
            return fetched
        fetched = self._fetch(path, unique)
        self._verify(unique, fetched, f"{self.label}: {path}")
        return fetched

    def _holders(self, info: CheckpointInfo, path: str) -> list[str]:
        """The live nodes other than this one whose memory holds ``path``'s rank."""
        if not path.startswith("rank-"):
            return []
        rank = str(int(path[5:10]))
        return [
            n for n in info.holders.get(rank, []) if n != self.client.node_id and n in info.peers
        ]

    def _spans(
        self,
        spans: Sequence[tuple[int, int]],
        read: Callable[[int, int], torch.Tensor],
        what: str,
    ) -> Callable[[StoredItem], torch.Tensor]:
        """Reads each ``(start, stop)`` of :func:`_merged` through ``read(start, length)``;
        the result gives an item's bytes from the span that holds it."""

        def fetch(span: tuple[int, int]) -> tuple[int, torch.Tensor]:
            start, stop = span
            data = retry(lambda: read(start, stop - start), f"reading {what}", self.attempts)
            if data.numel() != stop - start:
                raise CheckpointCorrupt(f"{what} is shorter than its items")
            return start, data

        fetched = _parallel(fetch, list(spans))

        def item(s: StoredItem) -> torch.Tensor:
            for start, data in fetched:
                if start <= s.offset and s.offset + s.length <= start + data.numel():
                    return data[s.offset - start : s.offset - start + s.length]
            raise AssertionError("an item outside the fetched spans")

        return item

    @staticmethod
    def _verify(
        items: Sequence[StoredItem], fetched: Callable[[StoredItem], torch.Tensor], what: str
    ) -> None:
        for stored in items:
            raw = fetched(stored)
            if raw.numel() != stored.length or checksum([as_memoryview(raw)]) != stored.checksum:
                raise CheckpointCorrupt(f"{what} at {stored.offset} fails its checksum")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """See base class: versions are named by the coordinator, never by an id."""
        return False


def _merged(items: Sequence[StoredItem]) -> list[tuple[int, int]]:
    """The byte spans that cover ``items``, items closer than 64 KiB apart in one (a
    ranged request costs about what 64 KiB of transfer does)."""
    spans: list[list[int]] = []
    for offset, length in sorted({(s.offset, s.length) for s in items}):
        if (
            spans
            and offset - spans[-1][1] <= _MERGE_GAP
            and offset + length - spans[-1][0] <= _SPAN
        ):
            spans[-1][1] = max(spans[-1][1], offset + length)
        else:
            spans.append([offset, offset + length])
    return [(start, stop) for start, stop in spans]


def _parallel(action: Callable[[A], T], work: list[A]) -> list[T]:
    """``action`` over ``work``, up to :data:`_READERS` at once, results in order; the
    first error raised is raised."""
    if len(work) <= 1:
        return [action(w) for w in work]
    with ThreadPoolExecutor(min(_READERS, len(work)), thread_name_prefix="rallypoint-read") as pool:
        return list(pool.map(action, work))


def check_metadata(metadata: dict[str, Any] | None) -> None:
    """Refuses ``metadata`` that is not JSON or too large for a report, before any upload.

    Raises:
        TypeError: It holds what JSON cannot (tensors, NaN).
        ValueError: It is over :data:`~rallypoint.client.MAX_METADATA_BYTES`.
    """
    try:
        size = len(json.dumps({"user": metadata}, allow_nan=False, separators=(",", ":")))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metadata must be JSON values: {exc}") from None
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is {size} bytes as JSON; at most {MAX_METADATA_BYTES}")


def _item_bytes(
    item: WriteItem, planner: SavePlanner, data: Any = None
) -> tuple[memoryview, str | None, tuple[int, ...] | None]:
    """One write item's bytes, with its dtype and shape if it is a tensor."""
    if data is None:
        data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        assert isinstance(data, io.BytesIO)
        return data.getbuffer(), None, None
    assert isinstance(data, torch.Tensor)
    cpu = data if data.device.type == "cpu" else data.cpu()
    return tensor_bytes(cpu), _dtype_name(cpu.dtype), tuple(cpu.shape)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorrupt(f"unknown dtype {name!r} in a checkpoint's metadata")
    return dtype
