"""Checkpoint versions as plain code over the table and blob ports.

Rows live in the job's partition of the ``jobs`` table, beside the job entity, so the
latest-pointer moves in one atomic batch with the version's commit:

- ``ckseq``                      the next version number (CAS): numbers are never reused.
- ``ckpt:VVVVVVVVVV``            one per version: generation, step, world size, state,
                                 and when and why an operator quarantined it.
- ``ckstep:GGGGGGGGGG:SSS...``   (generation, step) to version, so every rank that asks
                                 for the same step of a generation gets the same version.
- ``ckrep:VVVVVVVVVV:RRRRR``     one per global rank: claimed by a node at ``begin`` (only
                                 that node may write and report the rank's files), then
                                 its files and metadata once it reported, and where they
                                 are: in blob storage, in which nodes' memory tiers.
- ``peerkey``                    the job's Ed25519 key for peer grants.
- ``cklog:SSS``                  what a committed version was, once collected (its row as
                                 it was, and when): slot ``version % 256``, so the job's
                                 timeline shows the last 256 without any row to trim.

Tiers: a version is created ``persist`` or not by the job's policy (every Nth version,
or after T seconds). A rank's files are safe once they are in blob storage or in the
memory of two nodes (its own node's and the peer's the coordinator named; one node in a
one-node job). A version commits when every rank's files are safe, and is durable when
all are in blob storage. At a seal, :meth:`Checkpoints.resume` names the newest version
every rank of which the new members' memory or blob storage still holds.

Quarantine: an operator marks a committed version bad (:meth:`Checkpoints.quarantine`).
It is never named again (not by a seal, not as the latest) until unquarantined; a
pointer at it moves back, in the same batch, to the newest good version no newer by step.

Unrecoverable: a rank of the running generation could not load the version it was
named (a holder gone, a file missing or failing its checksum: :meth:`Checkpoints.unreadable`).
The version is marked so, with the reason, exactly as a quarantine marks it, and the
generation ends: the next seal names the newest version still recoverable, and no job
seals a second generation on a version that failed to load. The mark stays.

Ranks are global: every process of the job (torchrun's ``RANK``) saves its own files,
and a version commits when all ``world_size`` processes reported. A node may run several.

Blobs, in the ``checkpoints`` container: ``JOB/vVVVVVVVVVV/rank-RRRRR/FILE``, written by
the ranks through write URLs (the coordinator never carries checkpoint bytes), and
``JOB/vVVVVVVVVVV/manifest.json``, written here before the pointer moves, so a version
that is latest is always complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Literal

from rallypoint.client import GrantClaims, new_signing_key, public_key, sign_grant
from rallypoint.client.models import (
    MAX_METADATA_BYTES,
    BeginCheckpoint,
    CheckpointBegun,
    CheckpointInfo,
    CheckpointPointer,
    KeepBest,
    LoadFailure,
    Manifest,
    ManifestFile,
    ManifestShard,
    PeerGrant,
    ReportShard,
    RestoreFailure,
    RestoreReport,
    RestoreSource,
    ShardFile,
    TimelineVersion,
    rank_folder,
)

from . import _retention as retention
from . import _seal as seal
from ._packed import MAX_PACKED, pack, unpack
from ._records import Node
from ._rendezvous import Generation, Job, Member, Rendezvous
from ._timeline import as_entry
from .errors import (
    AccessDenied,
    AlreadyExists,
    CheckpointConflict,
    IncompleteUpload,
    InvalidRequest,
    Modified,
    NotFound,
    StorageError,
    StorageUnavailable,
    UnknownCheckpoint,
)
from .storage import BatchOp, BlobStore, Cond, Entity, Value

__all__ = ["Checkpoints", "Version"]

log = logging.getLogger("rallypoint.checkpoints")

CKSEQ = "ckseq"
CKPT = "ckpt:"
CKSTEP = "ckstep:"
CKREP = "ckrep:"
PEERKEY = "peerkey"
CKLOG = "cklog:"
#: Collected versions the log remembers (its slots).
LOG_SLOTS = 256
MANIFEST = "manifest.json"
#: Tries of a read-judge-CAS loop on the job entity before giving up (commits and
#: seals rewrite it, rarely more than a few times in a row).
_CAS_TRIES = 100

State = Literal["pending", "committed", "deleting"]
Durability = Literal["pending", "memory", "durable"]


@dataclass(frozen=True)
class Version:
    """A snapshot of one version's row."""

    job_id: str
    version: int
    generation: int
    step: int
    world_size: int
    state: State
    created_at: float
    committed_at: float | None
    etag: str = ""
    #: Whether the policy sends this version to blob storage.
    persist: bool = True
    #: Whether every rank's files are in blob storage (once committed).
    durable: bool = True
    #: When an operator quarantined it (None: it is not), and why.
    quarantined_at: float | None = None
    quarantine_reason: str | None = None
    #: When a rank reported it could not load it (None: none did), and why.
    unrecoverable_at: float | None = None
    unrecoverable_reason: str | None = None
    #: What rank 0 reported with it (set at the commit).
    metrics: Mapping[str, float] = field(default_factory=dict)
    #: The rule the job keeps its best versions by, as this version was saved under.
    keep_best: KeepBest | None = None
    #: How many of its newest good versions the job keeps, as this version was saved
    #: with (None: the coordinator's ``keep``).
    keep_last: int | None = None

    @property
    def quarantined(self) -> bool:
        return self.quarantined_at is not None

    @property
    def unrecoverable(self) -> bool:
        return self.unrecoverable_at is not None

    @property
    def good(self) -> bool:
        """Committed, not quarantined and not unrecoverable: a version a pointer may
        name."""
        return self.state == "committed" and not self.quarantined and not self.unrecoverable

    @property
    def folder(self) -> str:
        return f"{self.job_id}/v{self.version:010d}/"

    @property
    def durability(self) -> Durability:
        """``pending`` until committed; then ``durable`` if every rank's files are in
        blob storage, else ``memory``."""
        if self.state != "committed":
            return "pending"
        return "durable" if self.durable else "memory"

    @property
    def pointer(self) -> CheckpointPointer:
        return CheckpointPointer(
            version=self.version, step=self.step, generation=self.generation, durable=self.durable
        )


@dataclass(frozen=True)
class Report:
    rank: int
    node_id: str
    files: list[ShardFile]
    metadata: dict[str, Any] | None
    rank_metadata: dict[str, Any] | None
    holding: Holding
    metrics: dict[str, float] | None = None
    keep_best: KeepBest | None = None
    keep_last: int | None = None


@dataclass(frozen=True)
class Holding:
    """Where one rank's files of a version are."""

    storage: bool
    #: (node id, its replica server's URL when it reported): the URL tells a node's
    #: later agent, whose memory starts empty, from the one that held the files.
    memory: tuple[tuple[str, str | None], ...]

    def alive(self, members: Mapping[str, str | None]) -> list[str]:
        """The holders among ``members`` (node id to replica server URL). A holder
        without a replica server cannot prove it is the agent that took the copy, so
        it never counts."""
        return [n for n, peer in self.memory if peer is not None and members.get(n) == peer]


def _holding(data: Mapping[str, Value | None]) -> Holding:
    memory = json.loads(str(data.get("memory") or "[]"))
    return Holding(
        storage=bool(data.get("storage", True)),  # rows from before tiers were in storage
        memory=tuple((str(n), None if p is None else str(p)) for n, p in memory),
    )


def _step_key(generation: int, step: int) -> str:
    return f"{CKSTEP}{generation:010d}:{step:020d}"


def _rep_key(version: int, rank: int) -> str:
    return f"{CKREP}{version:010d}:{rank:05d}"


def _rank_folder(version: Version, rank: int) -> str:
    return f"{version.folder}{rank_folder(rank)}/"


def _find(job_id: str, versions: list[Version], number: int) -> Version:
    """Version ``number`` among ``versions`` (one query's rows), if not being collected."""
    for v in versions:
        if v.version == number:
            if v.state == "deleting":
                raise UnknownCheckpoint(f"version {number} of job {job_id!r} was collected")
            return v
    raise UnknownCheckpoint(f"job {job_id!r} has no checkpoint version {number}")


def _newest(versions: list[Version], step: int) -> Version | None:
    """The newest of ``versions`` no newer than ``step``, in the order a seal names
    them: by step, then by version."""
    return max(
        (v for v in versions if v.step <= step), key=lambda v: (v.step, v.version), default=None
    )


def _version(job_id: str, e: Entity) -> Version:
    d = e.data
    committed_at = d.get("committed_at")
    persist, durable = d.get("persist"), d.get("durable")
    quarantined_at, reason = d.get("quarantined_at"), d.get("quarantine_reason")
    unrecoverable_at, unreadable = d.get("unrecoverable_at"), d.get("unrecoverable_reason")
    metrics, keep_best, keep_last = d.get("metrics"), d.get("keep_best"), d.get("keep_last")
    state = str(d["state"])
    if state not in ("pending", "committed", "deleting"):
        raise TypeError(f"stored checkpoint state {state!r} is unknown")
    return Version(
        job_id=job_id,
        version=int(str(d["version"])),
        generation=int(str(d["generation"])),
        step=int(str(d["step"])),
        world_size=int(str(d["world_size"])),
        state=state,  # type: ignore[arg-type]  # checked above
        created_at=float(str(d["created_at"])),
        committed_at=None if committed_at is None else float(str(committed_at)),
        etag=e.etag or "",
        # Rows from before tiers: every version went to storage.
        persist=True if persist is None else bool(persist),
        durable=True if durable is None else bool(durable),
        quarantined_at=None if quarantined_at is None else float(str(quarantined_at)),
        quarantine_reason=None if reason is None else str(reason),
        unrecoverable_at=None if unrecoverable_at is None else float(str(unrecoverable_at)),
        unrecoverable_reason=None if unreadable is None else str(unreadable),
        metrics={} if metrics is None else json.loads(str(metrics)),
        keep_best=None if keep_best is None else KeepBest.model_validate_json(str(keep_best)),
        keep_last=None if keep_last is None else int(str(keep_last)),
    )


def _entity(v: Version) -> Entity:
    return Entity(
        v.job_id,
        f"{CKPT}{v.version:010d}",
        {
            "kind": "ckpt",
            "version": v.version,
            "generation": v.generation,
            # Steps may pass 2^31; Azure stores a Python int above it as Int64 either way.
            "step": v.step,
            "world_size": v.world_size,
            "state": v.state,
            "created_at": v.created_at,
            "committed_at": v.committed_at,
            "persist": v.persist,
            "durable": v.durable,
            "quarantined_at": v.quarantined_at,
            "quarantine_reason": v.quarantine_reason,
            "unrecoverable_at": v.unrecoverable_at,
            "unrecoverable_reason": v.unrecoverable_reason,
            # JSON: a table row holds no maps (rows from before metrics have neither).
            "metrics": json.dumps(dict(v.metrics)) if v.metrics else None,
            "keep_best": None if v.keep_best is None else v.keep_best.model_dump_json(),
            "keep_last": v.keep_last,
        },
    )


def _log_entity(v: Version, collected_at: float) -> Entity:
    """The log's record of a committed version being collected: its row as it was, in
    the slot of its number (overwriting the record of the version ``LOG_SLOTS`` older)."""
    row = _entity(replace(v, state="committed"))
    data = {**row.data, "kind": "cklog", "collected_at": collected_at}
    return Entity(v.job_id, f"{CKLOG}{v.version % LOG_SLOTS:03d}", data)


def _report(data: Mapping[str, Value | None]) -> Report:
    payload = unpack(data)
    keep = payload.get("keep_best")
    return Report(
        rank=int(str(data["rank"])),
        node_id=str(data["node_id"]),
        files=[ShardFile.model_validate(f) for f in payload["files"]],
        metadata=payload.get("metadata"),
        rank_metadata=payload.get("rank_metadata"),
        holding=_holding(data),
        metrics=payload.get("metrics"),
        keep_best=None if keep is None else KeepBest.model_validate(keep),
        keep_last=payload.get("keep_last"),
    )


class Checkpoints:
    """Begins, commits, lists and collects a job's checkpoint versions.

    Like :class:`Rendezvous`, every method reads what it needs and writes with ETag
    conditions, so coordinator replicas may share the storage.

    Args:
        rdzv: The job's rendezvous (for the job entity, fencing and the clock).
        blobs: Where shards and manifests live.
        keep: Committed versions to retain; the latest is kept regardless.
        timeout: How long a version may stay unfinished before it is collected.
        write_ttl: How long upload URLs are valid (never past the version's timeout):
            a rank renews them by beginning the same step again. They end sooner when
            the version commits or is collected (see :meth:`BlobStore.revoke`).
        read_ttl: How long read URLs (and peer read grants) are valid.
        on_commit: Called with the job and the version's total bytes when this process
            commits a version (metrics).
        on_restore: Called with the job and the bytes a rank's restore read, by source,
            when a member reports one (metrics).
    """

    def __init__(
        self,
        rdzv: Rendezvous,
        blobs: BlobStore,
        *,
        keep: int = 3,
        timeout: timedelta = timedelta(hours=1),
        write_ttl: timedelta = timedelta(minutes=5),
        read_ttl: timedelta = timedelta(hours=1),
        on_commit: Callable[[str, int], None] | None = None,
        on_restore: Callable[[str, Mapping[RestoreSource, int]], None] | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.rdzv = rdzv
        self.table = rdzv.table
        self.blobs = blobs
        self.keep = keep
        self.timeout = timeout.total_seconds()
        if write_ttl <= timedelta(0) or read_ttl <= timedelta(0):
            raise ValueError("URL lifetimes must be positive")
        self.write_ttl = write_ttl.total_seconds()
        self.read_ttl = read_ttl
        self.on_commit = on_commit
        self.on_restore = on_restore
        rdzv.resume = self.resume

    # --- writing ------------------------------------------------------------------------

    def begin(
        self, job_id: str, request: BeginCheckpoint, credential: str | None
    ) -> CheckpointBegun:
        """The version of ``request.step`` in the node's generation, created by the first
        rank that asks, and write URLs for this rank's files.

        Args:
            credential: The node's, as the request carried it.

        Raises:
            UnknownJob, UnknownNode: As the names say.
            InvalidCredential: Not the node's credential.
            StaleGeneration: The generation is not the job's running one (fencing).
            CheckpointConflict: The version is being collected.
        """
        job = self.rdzv.get_job(job_id)
        gen, node_rank = self.rdzv.member(job, request.node_id, request.generation, credential)
        rank, world_size = node_rank, len(gen.members)
        if request.rank is not None and request.world_size is not None:
            rank, world_size = request.rank, request.world_size
            if world_size < len(gen.members):
                raise InvalidRequest(
                    f"world_size {world_size} is below the {len(gen.members)} nodes of "
                    f"generation {request.generation}: every node runs at least one rank"
                )
        version = self._version_for(job_id, request, world_size)
        if version.state == "deleting":
            raise CheckpointConflict(
                f"version {version.version} (step {version.step}) expired and is being "
                "collected; save a later step"
            )
        if version.world_size != world_size:
            raise CheckpointConflict(
                f"version {version.version} (step {version.step}) was begun by "
                f"{version.world_size} ranks, not {world_size}"
            )
        urls: dict[str, str] = {}
        replica = standby = None
        upload_ttl = None
        expires_at = version.created_at + self.timeout
        if version.state == "pending":
            self._claim(version, rank, request.node_id)
            # Minutes at most, renewed by asking again, and never past the version's own
            # expiry: nothing can be written into a collected version.
            upload_ttl = max(1.0, min(self.write_ttl, expires_at - self.rdzv.clock()))
            try:
                urls = self.blobs.grant(
                    _rank_folder(version, rank),
                    request.files,
                    access="write",
                    ttl=timedelta(seconds=upload_ttl),
                    scope=version.folder,  # revoked when the version commits or goes
                )
            except AccessDenied:
                # Its writes closed since it was read: it committed, or is being collected.
                version = self._get(job_id, version.version)
                if version.state != "committed":
                    raise CheckpointConflict(
                        f"version {version.version} (step {version.step}) expired and is "
                        "being collected; save a later step"
                    ) from None
                upload_ttl = None
            if request.memory and version.state == "pending":
                replica = self._replica(gen, request.node_id, version, rank, expires_at)
                standby = self._standby(job, gen, request.node_id, version, rank, expires_at)
        return CheckpointBegun(
            version=version.version,
            step=version.step,
            generation=version.generation,
            rank=rank,
            world_size=version.world_size,
            state="committed" if version.state == "committed" else "pending",
            upload_urls=urls,
            expires_at=expires_at,
            upload_ttl=upload_ttl,
            persist=version.persist,
            replica=replica,
            standby=standby,
        )

    def _replica(
        self, gen: Generation, node_id: str, version: Version, rank: int, expires_at: float
    ) -> PeerGrant | None:
        """A grant to copy ``rank``'s files to the next member (in rank order) with a
        replica server: a ring, so every node holds one other node's files and two
        adjacent nodes are what it takes to lose a version's only copies."""
        members = gen.members
        start = gen.ranks[node_id]
        for i in range(1, len(members)):
            holder = members[(start + i) % len(members)]
            if holder.peer:
                return self._grant(holder, gen.generation, version, "write", expires_at, [rank])
        return None

    def _standby(
        self, job: Job, gen: Generation, node_id: str, version: Version, rank: int, at: float
    ) -> PeerGrant | None:
        """A grant to copy ``rank``'s files to the standby that would take its node's
        slot (:func:`._seal.keeper`), if the job has one parked with a replica server:
        the node that replaces this one then restores from its own memory. Only beside
        the generation that runs (a standby parks beside that one alone)."""
        if job.generation != gen.generation:
            return None
        holder = seal.keeper(gen.ranks[node_id], self.rdzv.standbys(job))
        if holder is None or not holder.peer:
            return None
        return self._grant(holder, gen.generation, version, "write", at, [rank])

    def _grant(
        self,
        holder: Member | Node,
        generation: int,
        version: Version,
        op: Literal["read", "write"],
        expires_at: float,
        ranks: list[int] | None = None,
    ) -> PeerGrant:
        """A grant, issued in ``generation``, to ``op`` ``version``'s files (for writes,
        ``ranks``' only) on ``holder``'s replica server."""
        assert holder.peer is not None
        claims = GrantClaims(
            job=version.job_id,
            gen=generation,
            node=holder.node_id,
            peer=holder.peer,
            version=version.version,
            op=op,
            exp=expires_at,
            ranks=ranks or [],
        )
        return PeerGrant(
            node_id=holder.node_id,
            url=holder.peer,
            token=sign_grant(self._key(claims.job), claims),
            expires_at=claims.exp,
        )

    def _key(self, job_id: str) -> bytes:
        """The job's grant-signing key, made by the first coordinator that needs it."""
        return self.rdzv.secrets.get(job_id, PEERKEY, new_signing_key)

    def peer_key(self, job_id: str) -> str:
        """The public half of the job's grant-signing key.

        Raises:
            UnknownJob: No such job.
        """
        self.rdzv.get_job(job_id)
        return public_key(self._key(job_id))

    def _version_for(self, job_id: str, request: BeginCheckpoint, world_size: int) -> Version:
        generation, step = request.generation, request.step
        key = _step_key(generation, step)
        for _ in range(100):
            try:
                number = self.table.get(job_id, key).data["version"]
                found = self._get(job_id, int(str(number)))
            except (NotFound, UnknownCheckpoint):
                pass  # not begun yet, or collected between the two reads
            else:
                if found.state != "pending" or not self._expired(found):
                    return found
                self.collect(job_id)
                continue
            now = self.rdzv.clock()
            last: int | None = None
            last_at = 0.0
            try:
                seq = self.table.get(job_id, CKSEQ)
                number = int(str(seq.data["next"]))
                if seq.data.get("persisted") is not None:
                    last = int(str(seq.data["persisted"]))
                    last_at = float(str(seq.data["persisted_at"]))
            except NotFound:
                seq, number = None, 1
            # The policy: the first version goes to storage, so there is always a
            # durable one to fall back to; then every Nth, or after T seconds.
            persist = (
                request.persist
                or last is None
                or number - last >= request.persist_every
                or (request.persist_after is not None and now - last_at >= request.persist_after)
            )
            counter = {
                "next": number + 1,
                "persisted": number if persist else last,
                "persisted_at": now if persist else last_at,
            }
            seq_op = (
                BatchOp("insert", Entity(job_id, CKSEQ, counter))
                if seq is None
                else BatchOp("replace", Entity(job_id, CKSEQ, counter), seq.etag)
            )
            version = Version(
                job_id,
                number,
                generation,
                step,
                world_size,
                "pending",
                now,
                None,
                persist=persist,
                durable=False,
            )
            try:
                stored = self.table.batch(
                    [
                        seq_op,
                        BatchOp("insert", _entity(version)),
                        BatchOp(
                            "insert", Entity(job_id, key, {"kind": "ckstep", "version": number})
                        ),
                    ]
                )
            except (Modified, AlreadyExists):
                continue  # another rank created it (or another step took the number)
            self.collect(job_id)  # a new version is when old ones may go
            entity = stored[1]
            return replace(version, etag=entity.etag if entity and entity.etag else "")
        raise StorageUnavailable(f"could not allocate a checkpoint version for job {job_id!r}")

    def _claim(self, version: Version, rank: int, node_id: str) -> None:
        """Makes ``node_id`` the only node that may write and report ``rank``'s files: two
        processes that took one rank would overwrite each other's files.

        Raises:
            CheckpointConflict: Another node holds the rank.
        """
        key = _rep_key(version.version, rank)
        claim: dict[str, Value] = {
            "kind": "ckrep",
            "version": version.version,
            "rank": rank,
            "node_id": node_id,
            "reported": False,
        }
        try:
            self.table.insert(Entity(version.job_id, key, claim))
            return
        except AlreadyExists:
            holder = str(self.table.get(version.job_id, key).data["node_id"])
        if holder != node_id:
            raise CheckpointConflict(
                f"rank {rank} of version {version.version} belongs to node {holder!r}, "
                f"not {node_id!r}: two processes were given one rank"
            )

    def report(
        self, job_id: str, number: int, request: ReportShard, credential: str | None
    ) -> CheckpointInfo:
        """Records a rank's uploaded files; the last rank's report commits the version.

        Args:
            credential: The reporting node's, as the request carried it.

        Raises:
            InvalidCredential: Not the node's credential.
            StaleGeneration: The generation ended (a zombie's report changes nothing).
            UnknownCheckpoint: No such version.
            CheckpointConflict: The version belongs to another generation, or expired.
            IncompleteUpload: A file is not in storage at its reported size.
            InvalidRequest: The metadata is too large, a node named in ``memory`` is not
                a member, or the files are neither in storage nor on enough nodes.
        """
        version = self._get(job_id, number)
        job = self.rdzv.get_job(job_id)
        gen, rank = self.rdzv.member(job, request.node_id, request.generation, credential)
        rank = rank if request.rank is None else request.rank
        if version.generation != request.generation:
            raise CheckpointConflict(
                f"version {number} belongs to generation {version.generation}, "
                f"not {request.generation}"
            )
        if version.state == "committed":
            return self._info(job, version)  # a retried report
        if version.state != "pending" or self._expired(version):
            raise CheckpointConflict(f"version {number} expired before every rank reported")
        if rank >= version.world_size:
            raise InvalidRequest(f"rank {rank} is not a rank of version {number}")
        # Each holder with its replica server as it is now: a later agent of the node
        # starts with empty memory, and must not count as a holder.
        peers = {m.node_id: m.peer for m in gen.members}
        if any(n not in peers for n in request.memory):
            peers.update({n.node_id: n.peer for n in self.rdzv.standbys(job)})
        strangers = [n for n in request.memory if n not in peers]
        if strangers:
            raise InvalidRequest(
                f"{', '.join(strangers)} not a member of generation {gen.generation} nor "
                "a standby beside it: only they hold replicas"
            )
        needed = min(2, len(gen.members))
        if not request.storage and len(request.memory) < needed:
            raise InvalidRequest(
                f"rank {rank}'s files are in memory on {len(request.memory)} node(s) and not "
                f"in storage: a version needs each rank's in storage or on {needed} nodes"
            )
        self._claim(version, rank, request.node_id)
        payload = {
            "files": [f.model_dump() for f in request.files],
            "metadata": request.metadata if rank == 0 else None,
            "rank_metadata": request.rank_metadata,
            # Rank 0's become the version's, like its metadata.
            **(
                request.model_dump(include={"metrics", "keep_best", "keep_last"})
                if rank == 0
                else {}
            ),
        }
        size = len(json.dumps(payload, separators=(",", ":")))
        if size > MAX_METADATA_BYTES:
            raise InvalidRequest(f"metadata is {size} bytes; at most {MAX_METADATA_BYTES}")
        packed = pack(payload)
        if sum(len(chunk) for chunk in packed.values()) > MAX_PACKED:
            raise InvalidRequest("metadata does not compress to fit a report")
        folder = _rank_folder(version, rank)
        for f in request.files if request.storage else ():
            try:
                stored = self.blobs.info(folder + f.name)
            except NotFound:
                raise IncompleteUpload(f"rank {rank} reported {f.name!r}, never uploaded") from None
            if stored.size != f.size:
                raise IncompleteUpload(
                    f"rank {rank} reported {f.name!r} as {f.size} bytes; storage holds "
                    f"{stored.size}"
                )
        self.table.upsert(
            Entity(
                job_id,
                _rep_key(number, rank),
                {
                    "kind": "ckrep",
                    "version": number,
                    "rank": rank,
                    "node_id": request.node_id,
                    "reported": True,
                    "storage": request.storage,
                    "memory": json.dumps([[n, peers[n]] for n in request.memory]),
                    **packed,
                },
            )
        )
        reports = self._reports(version)
        if len(reports) == version.world_size:
            version = self._commit(version, reports)
            job = self.rdzv.get_job(job_id)
        return self._info(job, version, reports)

    def _commit(self, version: Version, reports: dict[int, Report]) -> Version:
        durable = all(r.holding.storage for r in reports.values())
        first = reports[0]

        def ruled(v: Version) -> Version:
            # Rank 0's metrics and rules become the version's (see _retention.py).
            return replace(
                v,
                durable=durable,
                metrics=first.metrics or {},
                keep_best=first.keep_best,
                keep_last=first.keep_last,
            )

        version = ruled(version)
        manifest = Manifest(
            job_id=version.job_id,
            version=version.version,
            step=version.step,
            generation=version.generation,
            world_size=version.world_size,
            created_at=version.created_at,
            metadata=reports[0].metadata,
            metrics=first.metrics or None,
            shards=[
                ManifestShard(
                    rank=r.rank,
                    node_id=r.node_id,
                    files=[ManifestFile(**f.model_dump()) for f in r.files],
                    metadata=r.rank_metadata,
                )
                for r in sorted(reports.values(), key=lambda r: r.rank)
            ],
        )
        # Racing committers write the same bytes: the manifest holds nothing per-writer.
        self.blobs.put(version.folder + MANIFEST, manifest.model_dump_json(indent=1).encode())
        while True:
            job = self.rdzv.get_job(version.job_id)
            committed = replace(version, state="committed", committed_at=self.rdzv.clock())
            ops = [BatchOp("replace", _entity(committed), if_match=version.etag)]
            # Fencing: only the running generation moves the pointers, and only forwards.
            if job.generation == version.generation and job.status == "sealed":
                moved = job
                if job.checkpoint is None or version.step > job.checkpoint.step:
                    moved = replace(moved, checkpoint=version.pointer)
                if version.durable and (job.durable is None or version.step > job.durable.step):
                    moved = replace(moved, durable=version.pointer)
                if moved is not job:
                    ops.append(self.rdzv.pointers(job, moved.checkpoint, moved.durable))
            try:
                stored = self.table.batch(ops)
            except Modified:
                version = self._get(version.job_id, version.version)
                if version.state == "committed":
                    return version  # a racing report committed it
                if version.state != "pending":
                    raise CheckpointConflict(
                        f"version {version.version} was collected before it committed"
                    ) from None
                # The row read back is the pending one: it knows neither the tier nor
                # the metrics yet.
                version = ruled(version)
                continue  # the job entity changed: judge the pointer again
            entity = stored[0]
            committed = replace(committed, etag=entity.etag if entity and entity.etag else "")
            self._close(committed)
            if self.on_commit is not None:
                size = sum(f.size for r in reports.values() for f in r.files)
                self.on_commit(version.job_id, size)
            self.collect(version.job_id)
            return committed

    def _close(self, version: Version) -> None:
        """Ends the write URLs of a version that committed: its files are final, and a
        stale writer (a zombie, a retried upload) must not change them."""
        try:
            self.blobs.revoke(version.folder)
        except StorageError as exc:
            # The commit stands; the URLs still end at their expiry, minutes away.
            log.warning(
                "version %d of job %r committed, but its write URLs were not revoked: %s",
                version.version,
                version.job_id,
                exc,
            )

    def restored(
        self, job_id: str, number: int, report: RestoreReport, credential: str | None
    ) -> None:
        """Counts what a rank's restore of a version read, by source. Only a member of
        the running generation is heard: a zombie's numbers would be about a restore
        that no longer matters.

        Raises:
            StaleGeneration: The generation is not the job's running one.
            UnknownNode: The node is not a member of it.
            InvalidCredential: Not the node's credential.
            UnknownCheckpoint: No such version, or it is being collected.
            CheckpointConflict: The version is not committed: nothing restores from it.
        """
        job = self.rdzv.get_job(job_id)
        self.rdzv.member(job, report.node_id, report.generation, credential)
        version = self._get(job_id, number)
        if version.state == "deleting":
            raise UnknownCheckpoint(f"version {number} of job {job_id!r} was collected")
        if version.state != "committed":
            raise CheckpointConflict(f"version {number} is not committed: nothing restores it")
        if self.on_restore is not None:
            self.on_restore(job_id, report.bytes_from)

    # --- quarantine ---------------------------------------------------------------------

    def quarantine(
        self, job_id: str, number: int, reason: str = "", *, restart: bool = False
    ) -> CheckpointInfo:
        """Marks a committed version bad: no seal names it, and it is not the latest or
        the durable version again until :meth:`unquarantine`.

        A pointer at it moves back as :meth:`_mark` says. The running generation is
        not affected (its ranks resumed already, and a worker restarted within it loads
        what the others loaded) unless ``restart``: then it ends, and its members regroup
        and load the version the pointer moved back to.
        Quarantining a quarantined version changes nothing: its first mark stands.

        Args:
            reason: Why, for whoever reads the version list.
            restart: End the running generation now.

        Returns:
            The version, marked.

        Raises:
            UnknownJob: No such job.
            UnknownCheckpoint: No such version, or it is being collected.
            CheckpointConflict: The version is not committed (a pending one becomes the
                latest only when it commits: quarantine it then).
        """
        job, version = self._mark(
            job_id,
            number,
            "quarantined",
            lambda v: (
                None
                if v.quarantined
                else replace(v, quarantined_at=self.rdzv.clock(), quarantine_reason=reason or None)
            ),
        )
        if restart:
            why = f"checkpoint v{number} quarantined" + (f": {reason}" if reason else "")
            self._restart(job_id, job.generation, why)
        return self._info(job, version)

    def unreadable(
        self, job_id: str, number: int, failure: RestoreFailure, credential: str | None
    ) -> CheckpointInfo:
        """Marks a version unrecoverable because a rank of the running generation could
        not load it, and ends that generation: its members regroup, and the seal names
        the newest version still recoverable. Pointers move back as for
        :meth:`quarantine`, in the same batch. Fenced like every report of a member.
        Marking a marked version again keeps the first mark (and still ends the
        generation, if it runs).

        Returns:
            The version, marked.

        Raises:
            StaleGeneration: The generation is not the job's running one.
            UnknownNode: The node is not a member of it.
            InvalidCredential: Not the node's credential.
            UnknownCheckpoint: No such version, or it is being collected.
            CheckpointConflict: The version is not committed (nothing loads it).
        """
        job = self.rdzv.get_job(job_id)
        self.rdzv.member(job, failure.node_id, failure.generation, credential)
        reason = f"rank {failure.rank} of generation {failure.generation}: {failure.reason}"
        job, version = self._mark(
            job_id,
            number,
            "marked unrecoverable",
            lambda v: (
                None
                if v.unrecoverable
                else replace(v, unrecoverable_at=self.rdzv.clock(), unrecoverable_reason=reason)
            ),
        )
        log.warning("job %r: checkpoint v%d is unrecoverable: %s", job_id, number, reason)
        self._restart(job_id, failure.generation, f"checkpoint v{number} unrecoverable: {reason}")
        return self._info(job, version)

    def load_failed(
        self, job_id: str, number: int, failure: RestoreFailure, credential: str | None
    ) -> LoadFailure:
        """Records that a rank of the running generation read the version it was named
        but could not load it (a ZeRO partition count that does not match, a model that
        does not fit, an error in the user's load code), and ends the generation with the
        error's first line. The version is not marked: it is whole, and another world
        may load it. The job counts such ends in a row (:func:`._seal.load_streak`); the
        second of the same version at the same size keeps a round of that size from
        sealing again (:func:`._seal.load_blocked`). Fenced like every report of a
        member; of the ranks that report the same failure, the first names it.

        Returns:
            The generation's load failure as recorded (the first rank's, if another rank
            reported first).

        Raises:
            StaleGeneration: The generation is not the job's running one (it ended: a
                rank reported before this one, or a member died).
            UnknownNode: The node is not a member of it.
            InvalidCredential: Not the node's credential.
            CheckpointConflict: The generation was not named this version: a rank acts
                only for what its generation resumes from.
        """
        first_line = failure.reason.strip().splitlines()[0] if failure.reason.strip() else "?"
        for _ in range(_CAS_TRIES):
            job = self.rdzv.get_job(job_id)
            running, _ = self.rdzv.member(job, failure.node_id, failure.generation, credential)
            if running.checkpoint is None or running.checkpoint.version != number:
                named = f"v{running.checkpoint.version}" if running.checkpoint else "no version"
                raise CheckpointConflict(
                    f"generation {failure.generation} of job {job_id!r} resumes from "
                    f"{named}, not v{number}"
                )
            failed = LoadFailure(
                version=number,
                world_size=len(running.members),
                rank=failure.rank,
                reason=first_line,
            )
            why = f"rank {failure.rank} could not load v{number}: {first_line}"
            if self.rdzv.end_generation(job, why, failed):
                log.warning("job %r: generation %d %s", job_id, failure.generation, why)
                return failed
        raise StorageUnavailable(f"could not end generation {failure.generation} of {job_id!r}")

    def _mark(
        self, job_id: str, number: int, what: str, mark: Callable[[Version], Version | None]
    ) -> tuple[Job, Version]:
        """The one CAS loop that takes a committed version out of the good ones: writes
        ``mark(version)`` (None: it is marked already, nothing to write), and moves a
        pointer at it back to the newest good version no newer by step (for the durable
        pointer, the newest good durable one; None if there is none). The mark, the
        pointers and the row the pointer moves to are written in one batch with the job
        entity's CAS: a commit or seal that read the job before it fails its own CAS and
        judges again, and a collect that read the row before fails to mark it.

        Raises:
            UnknownCheckpoint: No such version, or it is being collected.
            CheckpointConflict: The version is not committed.
        """
        for _ in range(_CAS_TRIES):
            job = self.rdzv.get_job(job_id)
            rows = self._rows(job_id)
            version = _find(job_id, rows, number)
            if version.state != "committed":
                raise CheckpointConflict(
                    f"version {number} is not committed: only a committed version can be "
                    f"{what} (a pending one is never named)"
                )
            marked = mark(version)
            if marked is None:
                return job, version
            good = [v for v in rows if v.good and v.version != number]
            moved, targets = job, {}
            if job.checkpoint is not None and job.checkpoint.version == number:
                back = _newest(good, job.checkpoint.step)
                moved = replace(moved, checkpoint=None if back is None else back.pointer)
                targets.update({back.version: back} if back else {})
            if job.durable is not None and job.durable.version == number:
                back = _newest([v for v in good if v.durable], job.durable.step)
                moved = replace(moved, durable=None if back is None else back.pointer)
                targets.update({back.version: back} if back else {})
            ops = [BatchOp("replace", _entity(marked), if_match=version.etag)]
            # Rewritten as they are, for a new ETag: a collect's mark of one now fails.
            ops += [BatchOp("replace", _entity(v), if_match=v.etag) for v in targets.values()]
            # Always, even when no pointer moves: a seal that read the job before this
            # (and may name this version) must fail its CAS and read the rows again.
            ops.append(self.rdzv.pointers(job, moved.checkpoint, moved.durable))
            try:
                self.table.batch(ops)
            except (Modified, NotFound):
                continue  # a commit, seal or collect came first: judge again
            return moved, marked
        raise StorageUnavailable(f"version {number} of {job_id!r} could not be {what}")

    def unquarantine(self, job_id: str, number: int) -> CheckpointInfo:
        """Clears a version's quarantine: it may be named again (see :meth:`_unmark`).
        Unquarantining a version that is not quarantined changes nothing.

        Raises:
            UnknownJob: No such job.
            UnknownCheckpoint: No such version, or it is being collected.
        """
        return self._unmark(job_id, number, "quarantine")

    def recover(self, job_id: str, number: int) -> CheckpointInfo:
        """Clears a version's ``unrecoverable`` mark (the operator's, once the copies a
        rank could not read are back, or the cause was elsewhere): it may be named again
        (see :meth:`_unmark`). A version not marked changes nothing.

        Raises:
            UnknownJob: No such job.
            UnknownCheckpoint: No such version, or it is being collected.
        """
        return self._unmark(job_id, number, "unrecoverable")

    def _unmark(
        self, job_id: str, number: int, mark: Literal["quarantine", "unrecoverable"]
    ) -> CheckpointInfo:
        """Clears one of a version's marks.

        Once the version is good again (a version may carry both marks), the latest
        pointer moves forward to it, as its commit moved it, if it is newer by step and
        its generation is the job's latest (running, or ended with none sealed since);
        so does the durable pointer if it is durable. A version of an older generation
        moves no pointer: the generations since resumed from another version, and a
        pointer ahead of their steps would hold back their commits. The next seal judges
        whether the version can still be recovered, as for any latest.
        """
        for _ in range(_CAS_TRIES):
            job = self.rdzv.get_job(job_id)
            version = self._get(job_id, number)
            if version.state == "deleting":
                raise UnknownCheckpoint(f"version {number} of job {job_id!r} was collected")
            if mark == "quarantine":
                if not version.quarantined:
                    break
                cleared = replace(version, quarantined_at=None, quarantine_reason=None)
            else:
                if not version.unrecoverable:
                    break
                cleared = replace(version, unrecoverable_at=None, unrecoverable_reason=None)
            moved = job
            if cleared.good and version.generation == job.generation:
                if job.checkpoint is None or version.step > job.checkpoint.step:
                    moved = replace(moved, checkpoint=version.pointer)
                if version.durable and (job.durable is None or version.step > job.durable.step):
                    moved = replace(moved, durable=version.pointer)
            try:
                self.table.batch(
                    [
                        BatchOp("replace", _entity(cleared), if_match=version.etag),
                        self.rdzv.pointers(job, moved.checkpoint, moved.durable),
                    ]
                )
            except (Modified, NotFound):
                continue
            version, job = cleared, moved
            break
        else:
            raise StorageUnavailable(f"could not clear the {mark} of v{number} of {job_id!r}")
        return self._info(job, version)

    def _restart(self, job_id: str, generation: int, reason: str) -> None:
        """Ends ``generation`` if it still runs (one sealed since resumed correctly)."""
        for _ in range(_CAS_TRIES):
            job = self.rdzv.get_job(job_id)
            if job.generation != generation or job.status != "sealed":
                return
            if self.rdzv.end_generation(job, reason):
                return
        raise StorageUnavailable(f"could not end generation {generation} of {job_id!r}")

    # --- reading ------------------------------------------------------------------------

    def get(
        self,
        job_id: str,
        number: int | None = None,
        *,
        urls: bool = True,
        places: Mapping[int, int] | None = None,
    ) -> CheckpointInfo:
        """One version (the latest if ``number`` is None), with read URLs if committed.

        ``best_place`` only where the caller read every row (``places``: see
        :meth:`best`): every rank reads its version here at a restore, and a query of
        the job's rows each time would be work on that path for a mark it does not use.

        Raises:
            UnknownCheckpoint: No such version, or no version committed yet.
        """
        job = self.rdzv.get_job(job_id)
        latest = number is None
        if number is None:
            if job.checkpoint is None:
                raise UnknownCheckpoint(f"job {job_id!r} has no committed checkpoint yet")
            number = job.checkpoint.version
        version = self._get(job_id, number)
        if version.state == "deleting":
            raise UnknownCheckpoint(f"version {number} of job {job_id!r} was collected")
        if latest and not version.good:
            # Not expected: a mark moves the pointer in the batch that marks the row.
            raise UnknownCheckpoint(f"the latest of job {job_id!r}, v{number}, is marked bad")
        # A quarantined version keeps its read URLs here, by number: whoever investigates
        # it may read it, and a worker restarted within a generation that was told to
        # resume from it loads what its generation's other ranks loaded.
        info = self._info(job, version, places=places)
        if urls and version.state == "committed":
            grant = self.blobs.grant(version.folder, None, access="read", ttl=self.read_ttl)
            info = info.model_copy(update={"urls": grant, **self._copies(job, version)})
        return info

    def best(self, job_id: str, *, urls: bool = True) -> CheckpointInfo:
        """The job's best version by its ``keep_best`` rule (see ``_best.py``), with read
        URLs.

        Raises:
            UnknownJob: No such job.
            UnknownCheckpoint: The job keeps no best (its newest version was saved
                without ``keep_best``), or no good version carries the metric yet.
        """
        self.rdzv.get_job(job_id)
        rows = self._rows(job_id)
        keep = retention.rule(rows)
        if keep is None:
            raise UnknownCheckpoint(
                f"job {job_id!r} keeps no best version: its newest was saved without keep_best"
            )
        ranked = retention.best(rows, keep)
        if not ranked:
            raise UnknownCheckpoint(
                f"job {job_id!r} has no best version yet: no good version carries {keep.metric!r}"
            )
        return self.get(job_id, ranked[0].version, urls=urls, places=retention.places(rows))

    def _copies(self, job: Job, version: Version) -> dict[str, Any]:
        """Where a committed version's files are: ranks in storage, and the live holders
        of the others (members of the running generation, as they were when they took
        the copies), with read grants for their replica servers."""
        holdings = self._holdings(version)
        members: dict[str, Member] = {}
        if job.status == "sealed" and job.generation:
            members = {m.node_id: m for m in self.rdzv.sealed(job.job_id, job.generation).members}
        peers = {n: m.peer for n, m in members.items()}
        holders = {str(r): h.alive(peers) for r, h in sorted(holdings.items())}
        grants: dict[str, PeerGrant] = {}
        expires = self.rdzv.clock() + self.read_ttl.total_seconds()
        for node in sorted({n for alive in holders.values() for n in alive}):
            grants[node] = self._grant(members[node], job.generation, version, "read", expires)
        return {
            "holders": {r: alive for r, alive in holders.items() if alive},
            "peers": grants,
            "in_storage": sorted(r for r, h in holdings.items() if h.storage),
        }

    def resume(self, job: Job, members: tuple[Member, ...]) -> CheckpointPointer | None:
        """The version a generation of ``members`` resumes from: the newest, by step and
        no newer than the job's pointer, whose every rank's files are in blob storage or
        in the memory of one of ``members``. A version whose only holders are gone is
        never named, nor a quarantined one; the durable pointer always qualifies (it is
        never quarantined: a quarantine moves it back).
        """
        if job.checkpoint is None:
            return None
        peers = {m.node_id: m.peer for m in members}
        candidates = sorted(
            (v for v in self._rows(job.job_id) if v.good and v.step <= job.checkpoint.step),
            key=lambda v: (v.step, v.version),
            reverse=True,
        )
        for version in candidates:
            if version.durable:
                return version.pointer
            holdings = self._holdings(version)
            if len(holdings) == version.world_size and all(
                h.storage or h.alive(peers) for h in holdings.values()
            ):
                return version.pointer
        return job.durable  # None only if nothing durable was ever committed

    def versions(self, job_id: str) -> list[CheckpointInfo]:
        """Every version not being collected, oldest first (no URLs)."""
        job = self.rdzv.get_job(job_id)
        rows = self._rows(job_id)
        places = retention.places(rows)
        return [self._info(job, v, places=places) for v in rows if v.state != "deleting"]

    def collected(self, job_id: str) -> list[TimelineVersion]:
        """The committed versions collected lately (the last :data:`LOG_SLOTS`), as
        they were when collected: oldest first, for the job's timeline."""
        logged = []
        for e in self.table.query(job_id, [Cond("kind", "eq", "cklog")]):
            collected_at = float(str(e.data["collected_at"]))
            logged.append(as_entry(_version(job_id, e), collected_at))
        return sorted(logged, key=lambda v: v.version)

    def durabilities(self, job_id: str) -> dict[str, int]:
        """How many versions not being collected are pending, committed in memory and
        durable, and (besides) how many of them are ``quarantined`` and ``unrecoverable``:
        one query and no
        rank reports read, for the metrics at every scrape. A job deleted meanwhile has
        none."""
        counts = {"pending": 0, "memory": 0, "durable": 0, "quarantined": 0, "unrecoverable": 0}
        for version in self._rows(job_id):
            if version.state != "deleting":
                counts[version.durability] += 1
                counts["quarantined"] += version.quarantined
                counts["unrecoverable"] += version.unrecoverable
        return counts

    def _info(
        self,
        job: Job,
        version: Version,
        reports: Mapping[int, Report] | None = None,
        places: Mapping[int, int] | None = None,
    ) -> CheckpointInfo:
        """``reports`` if the caller read them already; read here only while pending (a
        committed version has all of them). ``places``: the job's best versions' places
        (:func:`._retention.places`), where the caller read every row."""
        if reports is None and version.state != "committed":
            reports = self._reports(version)
        return CheckpointInfo(
            version=version.version,
            step=version.step,
            generation=version.generation,
            world_size=version.world_size,
            state="committed" if version.state == "committed" else "pending",
            created_at=version.created_at,
            committed_at=version.committed_at,
            reported=version.world_size if reports is None else len(reports),
            latest=job.checkpoint is not None and job.checkpoint.version == version.version,
            latest_durable=job.durable is not None and job.durable.version == version.version,
            durability=version.durability,
            quarantined=version.quarantined,
            quarantined_at=version.quarantined_at,
            quarantine_reason=version.quarantine_reason,
            unrecoverable=version.unrecoverable,
            unrecoverable_at=version.unrecoverable_at,
            unrecoverable_reason=version.unrecoverable_reason,
            metrics=dict(version.metrics),
            best_place=None if places is None else places.get(version.version),
        )

    def _get(self, job_id: str, number: int) -> Version:
        try:
            return _version(job_id, self.table.get(job_id, f"{CKPT}{number:010d}"))
        except NotFound:
            raise UnknownCheckpoint(f"job {job_id!r} has no checkpoint version {number}") from None

    def _rows(self, job_id: str) -> list[Version]:
        return [_version(job_id, e) for e in self.table.query(job_id, [Cond("kind", "eq", "ckpt")])]

    def _report_rows(self, version: Version) -> list[Entity]:
        where = [Cond("kind", "eq", "ckrep"), Cond("version", "eq", version.version)]
        return list(self.table.query(version.job_id, where))

    def _holdings(self, version: Version) -> dict[int, Holding]:
        """Where each reported rank's files are (without unpacking their metadata)."""
        rows = (e.data for e in self._report_rows(version) if e.data.get("reported", True))
        return {int(str(d["rank"])): _holding(d) for d in rows}

    def _reports(self, version: Version) -> dict[int, Report]:
        # Claims (``reported`` False) hold no files yet; rows from before claims existed
        # have no flag and were all reports.
        rows = (e for e in self._report_rows(version) if e.data.get("reported", True))
        reports = (_report(e.data) for e in rows)
        return {r.rank: r for r in reports}

    def _expired(self, version: Version) -> bool:
        return self.rdzv.clock() >= version.created_at + self.timeout

    # --- collecting ---------------------------------------------------------------------

    def collect(self, job_id: str) -> list[int]:
        """Deletes unfinished versions past their timeout and committed ones beyond the
        last ``keep`` good (neither quarantined nor unrecoverable) ones (the job's own
        ``keep_last`` if its newest version carries one: :func:`._retention.keep_last`);
        never the latest, the durable one or the job's best (:func:`._retention.best`).
        Marked versions are kept while they are among the last ``keep`` committed, for
        whoever investigates them, and never push a good one out.

        Returns:
            The versions deleted.
        """
        job = self.rdzv.get_job(job_id)
        versions = self._rows(job_id)
        latest = job.checkpoint.version if job.checkpoint else None
        durable = job.durable.version if job.durable else None
        committed = [v for v in versions if v.state == "committed"]
        good = [v.version for v in committed if v.good]
        last = retention.keep_last(versions, self.keep)
        suspect = {v.version for v in committed[-last:] if not v.good}
        # The durable pointer is what a job falls back to when memory copies are lost.
        # (A quarantine that moves a pointer back rewrites the row it moves to, so a
        # collect that read the pointer before fails to mark that row deleting.)
        # The best by the job's rule stay too, however old (see _retention.py).
        best = {v.version for v in retention.best(versions)}
        keep = set(good[-last:]) | suspect | best | {latest, durable}
        doomed = [
            v
            for v in versions
            if v.version not in keep
            and (v.state != "pending" or self._expired(v))  # committed, deleting or stale
        ]
        return [v.version for v in doomed if self._delete(v)]

    def _delete(self, version: Version) -> bool:
        if version.state != "deleting":
            mark = BatchOp(
                "replace", _entity(replace(version, state="deleting")), if_match=version.etag
            )
            # A committed version's record goes to the log in the same transaction, so
            # the job's timeline keeps it without another storage call.
            log_op = (
                [BatchOp("upsert", _log_entity(version, self.rdzv.clock()))]
                if version.state == "committed"
                else []
            )
            try:
                # Marked first, by CAS: a commit racing this either lands before (and the
                # mark fails) or fails itself; the blobs go only after the mark.
                self.table.batch([mark, *log_op])
            except (Modified, NotFound):
                return False
        if version.state != "committed":  # a committed one's were revoked at its commit
            # Before the blobs go: a write under way must not bring one back.
            self.blobs.revoke(version.folder)
        for blob in self.blobs.list(version.folder):
            with contextlib.suppress(NotFound):  # a concurrent collector got there first
                self.blobs.delete(blob.name)
        self.blobs.forget(version.folder)  # before the version row: a retry redoes it
        job_id = version.job_id
        # Only the keys are needed: unpacking every rank's metadata would be wasted.
        reports = [e.row_key for e in self._report_rows(version)]
        # The version row goes last, so a half-collected version is still found (as
        # "deleting") and finished by the next collect.
        rows = [
            *reports,
            _step_key(version.generation, version.step),
            f"{CKPT}{version.version:010d}",
        ]
        for row in rows:
            with contextlib.suppress(NotFound):
                self.table.delete(job_id, row)
        return True
