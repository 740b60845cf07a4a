"""Rendezvous generations as plain code over the table port.

One partition per job (the job's id) holds the rows below; a job of more than
:data:`MEMBERS_PER_PARTITION` ``max_nodes`` keeps its ``node:`` and ``beat:`` rows in
partitions of their own (``JOB~m0``, ``JOB~m1``, ... by a hash of the node id), since each
member writes its beat row every second:

- ``job``         the job entity: spec, latest generation, ``open`` or ``sealed``, and the
                  authoritative latest checkpoint. It is the only entity more than one
                  node writes, and only to seal or end a generation or to move the
                  checkpoint pointer, always by ETag compare-and-swap.
- ``node:ID``     one per node: address, the round it registered for, ``waiting``/``left``,
                  its registration and the digest of its credential (see
                  :mod:`._credentials`). Joining writes only this, so a thousand joins
                  do not fight over a row.
- ``beat:ID``     one per node: the coordinator's clock at its last heartbeat.
- ``nodekey``     the job's key node credentials derive from.
- ``gen:NNN``     one per sealed generation: members, ranks and credential digests
                  (immutable), and when and why it ended. Sealing inserts it in one
                  batch with the job's CAS, so a generation is sealed completely or not
                  at all, by exactly one writer.
- ``gen:NNN~SEAL~I`` the members of a generation too large for one entity (thousands of
                  nodes with long names), written before the seal's batch under that
                  seal's own id, which the ``gen:`` row names; a seal that loses its
                  race deletes its own.

Nothing lives only in a coordinator's memory: any replica, or a restarted one, picks up
from storage. What a replica caches (generation members) is immutable; the node rows it
last read or wrote are kept only to condition its next write on them (see
:meth:`Rendezvous.register`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import secrets
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Literal

from pydantic import TypeAdapter

from rallypoint.client.models import (
    STRAGGLER_WINDOW,
    CheckpointPointer,
    GenerationInfo,
    HangReport,
    Health,
    JobSpec,
    JobStatus,
    JobSummary,
    LoadFailure,
    MemberStatus,
    QuarantinedNode,
    RankProgress,
    StacksReport,
    WaitingNode,
    WorldSizeReport,
)

from . import _credentials as credentials
from . import _health as health
from . import _seal as seal
from . import _timeline as timeline
from ._packed import pack_rows, unpack_rows
from ._records import Generation, Job, Member, Node
from ._secrets import JobSecrets
from .errors import (
    AlreadyExists,
    JobConflict,
    Modified,
    NodeQuarantined,
    NotFound,
    StaleGeneration,
    StorageUnavailable,
    UnknownJob,
    UnknownNode,
)
from .storage import BatchOp, Cond, Entity, SharedBatches, Table, Value

log = logging.getLogger("rallypoint.rendezvous")

__all__ = ["Generation", "Job", "Member", "Node", "Rendezvous", "progress_json"]

JOB_ROW = "job"
NODE = "node:"
BEAT = "beat:"
GEN = "gen:"
#: ``hang:GGGGGGGGGG``: the rank a generation ended for, and its stacks once sent.
HANG = "hang:"
#: The job's straggler windows (:class:`._health.Window`), written once a window.
HEALTH_ROW = "health"
#: Hang reports kept per job (the oldest go).
HANGS_KEPT = 20
#: Characters of stacks per table property (Azure's limit is 64 KiB of UTF-16).
_STACK_CHUNK = 16_000
#: A partition listing every job; ``~`` cannot occur in a job id.
INDEX = "~jobs"
#: Members whose rows (registration and heartbeat) share a table partition. Each member
#: writes its heartbeat row once a second, and Azure serves about 2,000 entities a
#: second per partition: a job of more ``max_nodes`` spreads its members' rows over
#: partitions of their own (``JOB~m0``, ``JOB~m1``, ...), by a hash of the node id. Its
#: job, generation and checkpoint rows stay in the job's partition, so a seal and a
#: commit are still one single-partition transaction.
MEMBERS_PER_PARTITION = 1000


def member_partitions(job_id: str, max_nodes: int) -> list[str]:
    """The partitions holding the rows of a job's nodes (its own, up to
    :data:`MEMBERS_PER_PARTITION` ``max_nodes``)."""
    count = -(-max_nodes // MEMBERS_PER_PARTITION)
    return [job_id] if count <= 1 else [f"{job_id}~m{i}" for i in range(count)]


def member_partition(job_id: str, node_id: str, max_nodes: int) -> str:
    """The partition of one node's rows (the same for its registration and heartbeat,
    which a join writes in one transaction)."""
    partitions = member_partitions(job_id, max_nodes)
    return partitions[zlib.crc32(node_id.encode()) % len(partitions)]


def _int(d: Mapping[str, Value | None], key: str) -> int:
    value = d[key]
    if not isinstance(value, int):
        raise TypeError(f"stored {key!r} is {type(value).__name__}, not int")
    return value


def _float(d: Mapping[str, Value | None], key: str) -> float:
    value = d[key]
    if not isinstance(value, (int, float)):
        raise TypeError(f"stored {key!r} is {type(value).__name__}, not a number")
    return float(value)


def _opt_float(d: Mapping[str, Value | None], key: str) -> float | None:
    return None if d.get(key) is None else _float(d, key)


def _seconds(value: timedelta) -> float:
    return value.total_seconds()


def _spec_data(spec: JobSpec) -> dict[str, Value | None]:
    return {
        "min_nodes": spec.min_nodes,
        "max_nodes": spec.max_nodes,
        "last_call": _seconds(spec.last_call),
        "heartbeat_timeout": _seconds(spec.heartbeat_timeout),
        "join_timeout": _seconds(spec.join_timeout),
        "standbys": spec.standbys,
        # None where the spec has the default: rows as before these fields.
        "hang_limit": None if spec.hang_limit is None else _seconds(spec.hang_limit),
        "phase_limit": _seconds(spec.phase_limit) if spec.phase_limit != _PHASE_LIMIT else None,
        "straggler": spec.straggler if spec.straggler != "report" else None,
        "straggler_threshold": spec.straggler_threshold
        if spec.straggler_threshold != _THRESHOLD
        else None,
    }


_PHASE_LIMIT = JobSpec.model_fields["phase_limit"].default
_THRESHOLD = JobSpec.model_fields["straggler_threshold"].default


def _spec(d: Mapping[str, Value | None]) -> JobSpec:
    optional: dict[str, object] = {}
    if d.get("standbys") is not None:  # rows before standbys: 0
        optional["standbys"] = _int(d, "standbys")
    if d.get("hang_limit") is not None:
        optional["hang_limit"] = timedelta(seconds=_float(d, "hang_limit"))
    if d.get("phase_limit") is not None:
        optional["phase_limit"] = timedelta(seconds=_float(d, "phase_limit"))
    if d.get("straggler") is not None:
        optional["straggler"] = str(d["straggler"])
    if d.get("straggler_threshold") is not None:
        optional["straggler_threshold"] = _float(d, "straggler_threshold")
    declared = _sizes(d, "world_sizes")
    if declared is not None:
        optional["world_sizes"] = declared
    return JobSpec(
        min_nodes=_int(d, "min_nodes"),
        max_nodes=_int(d, "max_nodes"),
        last_call=timedelta(seconds=_float(d, "last_call")),
        heartbeat_timeout=timedelta(seconds=_float(d, "heartbeat_timeout")),
        join_timeout=timedelta(seconds=_float(d, "join_timeout")),
        **optional,
    )


def _job(job_id: str, e: Entity) -> Job:
    d = e.data
    hang = json.loads(str(d["last_hang"])) if d.get("last_hang") is not None else None
    stalls = json.loads(str(d["stalls"])) if d.get("stalls") is not None else {}
    return Job(
        job_id=job_id,
        spec=_spec(d),
        generation=_int(d, "generation"),
        status="sealed" if d["status"] == "sealed" else "open",
        world_size=_int(d, "world_size"),
        created_at=_float(d, "created_at"),
        changed_at=_float(d, "changed_at"),
        etag=e.etag or "",
        checkpoint=_pointer(d, "ckpt"),
        durable=_pointer(d, "durable"),
        load_failure=_load_failure(d),
        quarantined=tuple(
            QuarantinedNode.model_validate(q) for q in json.loads(str(d.get("quarantined") or "[]"))
        ),
        losses={n: tuple(t) for n, t in json.loads(str(d.get("node_losses") or "{}")).items()},
        last_end=(_int(d, "end_generation"), str(d["end_reason"]))
        if d.get("end_reason") is not None
        else None,
        last_hang=(int(hang[0]), str(hang[1]), int(hang[2])) if hang else None,
        hangs={n: tuple(t) for n, t in json.loads(str(d.get("node_hangs") or "{}")).items()},
        stalls=int(stalls.get("count", 0)),
        best_step=int(stalls.get("best", -1)),
        stall_reasons=tuple(stalls.get("reasons", ())),
        learned_sizes=_sizes(d, "learned_sizes"),
    )


def _sizes(d: Mapping[str, Value | None], key: str) -> tuple[int, ...] | None:
    """World sizes stored as a JSON list (None in rows from before them, or where none
    were declared or learned)."""
    value = d.get(key)
    return None if value is None else tuple(int(n) for n in json.loads(str(value)))


def _load_failure(d: Mapping[str, Value | None]) -> LoadFailure | None:
    failure = d.get("load_failure")
    return None if failure is None else LoadFailure.model_validate_json(str(failure))


def _pointer(d: Mapping[str, Value | None], prefix: str) -> CheckpointPointer | None:
    if d.get(f"{prefix}_version") is None:
        return None
    durable = d.get(f"{prefix}_durable")
    return CheckpointPointer(
        version=_int(d, f"{prefix}_version"),
        step=_int(d, f"{prefix}_step"),
        generation=_int(d, f"{prefix}_generation"),
        durable=True if durable is None else bool(durable),  # rows from before tiers
    )


def _pointer_data(prefix: str, p: CheckpointPointer | None) -> dict[str, Value | None]:
    return {
        f"{prefix}_version": p.version if p else None,
        f"{prefix}_step": p.step if p else None,
        f"{prefix}_generation": p.generation if p else None,
        f"{prefix}_durable": p.durable if p else None,
    }


def _job_entity(job: Job) -> Entity:
    return Entity(
        job.job_id,
        JOB_ROW,
        {
            **_spec_data(job.spec),
            "generation": job.generation,
            "status": job.status,
            "world_size": job.world_size,
            "created_at": job.created_at,
            "changed_at": job.changed_at,
            **_pointer_data("ckpt", job.checkpoint),
            **_pointer_data("durable", job.durable),
            "load_failure": job.load_failure.model_dump_json() if job.load_failure else None,
            # JSON: small (the nodes an operator or the loss rule keeps out, and the
            # losses within the window); None when empty, as rows from before them.
            "quarantined": (
                json.dumps([q.model_dump() for q in job.quarantined]) if job.quarantined else None
            ),
            "node_losses": json.dumps(dict(job.losses)) if job.losses else None,
            # None in rows from before them, as above.
            "end_generation": job.last_end[0] if job.last_end else None,
            "end_reason": job.last_end[1] if job.last_end else None,
            # JSON, None while there is none, as above.
            "last_hang": json.dumps(list(job.last_hang)) if job.last_hang else None,
            "node_hangs": json.dumps(dict(job.hangs)) if job.hangs else None,
            "stalls": json.dumps(
                {"count": job.stalls, "best": job.best_step, "reasons": list(job.stall_reasons)}
            )
            if job.stalls or job.best_step >= 0
            else None,
            # JSON lists of node counts: the spec's and those its workers reported.
            "world_sizes": _sizes_data(job.spec.world_sizes),
            "learned_sizes": _sizes_data(job.learned_sizes),
        },
    )


def _sizes_data(sizes: tuple[int, ...] | None) -> str | None:
    return None if sizes is None else json.dumps(list(sizes))


def _member_fields(m: Member) -> list[str | int | None]:
    fields: list[str | int | None] = [m.node_id, m.rank, m.addr, m.port, m.peer, m.cred]
    while fields[-1] is None:  # as records from before these fields were written
        fields.pop()
    return fields


def _generation(e: Entity, parts: list[Entity] | None = None) -> Generation:
    """A generation from its row, and its part rows if its members needed some."""
    d = e.data
    stored = (str(d["seal"]), _int(d, "parts")) if d.get("parts") else None
    if stored is not None and parts is None:
        raise ValueError(f"generation row {e.row_key!r} needs its {stored[1]} part rows")
    checkpoint = d.get("checkpoint")
    return Generation(
        generation=_int(d, "generation"),
        members=tuple(
            Member(*fields) for fields in unpack_rows([p.data for p in parts] if parts else [d])
        ),
        sealed_at=_float(d, "sealed_at"),
        ended_at=_opt_float(d, "ended_at"),
        ended_reason=str(d["ended_reason"]) if d.get("ended_reason") is not None else None,
        checkpoint=CheckpointPointer.model_validate_json(str(checkpoint)) if checkpoint else None,
        etag=e.etag or "",
        parts=stored,
        load_failure=_load_failure(d),
    )


def _generation_key(generation: int) -> str:
    return f"{GEN}{generation:010d}"


def _part_key(generation: int, seal_id: str, index: int) -> str:
    return f"{_generation_key(generation)}~{seal_id}~{index}"


def _generation_entity(
    job_id: str, g: Generation, members: dict[str, bytes] | None = None
) -> Entity:
    """A generation's row: what it is and, unless they are in part rows, its members
    (``members``: already packed, else packed here)."""
    data: dict[str, Value | None] = {
        "kind": "gen",
        "generation": g.generation,
        "sealed_at": g.sealed_at,
        "world_size": len(g.members),
        "ended_at": g.ended_at,
        "ended_reason": g.ended_reason,
        "checkpoint": g.checkpoint.model_dump_json() if g.checkpoint else None,
        "load_failure": g.load_failure.model_dump_json() if g.load_failure else None,
    }
    if g.parts is not None:
        data.update(seal=g.parts[0], parts=g.parts[1])
    else:
        if members is None:
            (members,) = pack_rows([_member_fields(m) for m in g.members])
        data.update(members)
    return Entity(job_id, _generation_key(g.generation), data)


def _sealing_rows(job_id: str, g: Generation) -> tuple[Entity, list[Entity]]:
    """A new generation's row and, if its members do not fit one entity (thousands of
    nodes with long names), the part rows that hold them, under a key of this seal's
    own: they are written before the seal's transaction, and a seal that loses its race
    must not have overwritten the winner's."""
    packed = pack_rows([_member_fields(m) for m in g.members])
    if len(packed) == 1:
        return _generation_entity(job_id, g, packed[0]), []
    seal_id = secrets.token_hex(6)
    g = replace(g, parts=(seal_id, len(packed)))
    return _generation_entity(job_id, g), [
        Entity(job_id, _part_key(g.generation, seal_id, i), {"kind": "genpart", **part})
        for i, part in enumerate(packed)
    ]


def _node(e: Entity) -> Node:
    d = e.data
    return Node(
        node_id=str(d["node_id"]),
        addr=str(d["addr"]),
        port=_int(d, "port"),
        round=_int(d, "round"),
        joined_at=_float(d, "joined_at"),
        state="left" if d["state"] == "left" else "waiting",
        join_id=str(d["join_id"]) if d.get("join_id") else None,
        peer=str(d["peer"]) if d.get("peer") else None,
        registration=str(d["reg"]) if d.get("reg") else None,
        cred=str(d["cred"]) if d.get("cred") else None,
        etag=e.etag,
        warm=bool(d.get("warm")),
    )


def _node_entity(partition: str, n: Node) -> Entity:
    return Entity(
        partition,
        NODE + n.node_id,
        {
            "kind": "node",
            "node_id": n.node_id,
            "addr": n.addr,
            "port": n.port,
            "round": n.round,
            "joined_at": n.joined_at,
            "state": n.state,
            "join_id": n.join_id,
            "peer": n.peer,
            "reg": n.registration,
            "cred": n.cred,
            "warm": True if n.warm else None,  # None: rows as before it
        },
    )


def _beat_op(
    partition: str, node_id: str, at: float, generation: int, progress: str | None = None
) -> BatchOp:
    data: dict[str, Value | None] = {"kind": "beat", "at": at, "generation": generation}
    if progress is not None:
        data["progress"] = progress
    return BatchOp("upsert", Entity(partition, BEAT + node_id, data))


_PROGRESS = TypeAdapter(list[RankProgress])


def progress_json(progress: Sequence[RankProgress]) -> str:
    """What a beat row keeps of a heartbeat's progress (compact JSON)."""
    return _PROGRESS.dump_json(list(progress), exclude_none=True).decode()


def _progress(text: Value | None) -> tuple[RankProgress, ...]:
    if not text:
        return ()
    try:
        return tuple(_PROGRESS.validate_json(str(text)))
    except ValueError:  # a row this version cannot read: no progress rather than none
        return ()


#: What ends a generation for a fault (:func:`._health.stalled` counts those that made no
#: progress), by :func:`._timeline.cause`.
_FAULTS = frozenset({"lost", "hung", "rejoined", "load_failed", "unrecoverable"})


def _hang_key(generation: int) -> str:
    return f"{HANG}{generation:010d}"


def _hang_entity(job_id: str, generation: int, hang: health.Hang, at: float) -> Entity:
    return Entity(
        job_id,
        _hang_key(generation),
        {
            "kind": "hang",
            "generation": generation,
            "node_id": hang.node_id,
            "rank": hang.rank,
            "phase": hang.phase,
            "step": hang.step,
            "idle": hang.idle,
            "limit": hang.limit,
            "at": at,
        },
    )


def _hang_report(e: Entity, stacks: bool) -> HangReport:
    d = e.data
    chunks = _int(d, "chunks") if d.get("chunks") is not None else 0
    text = "".join(str(d[f"stacks{i}"]) for i in range(chunks)) if stacks and chunks else None
    return HangReport(
        generation=_int(d, "generation"),
        node_id=str(d["node_id"]),
        rank=_int(d, "rank"),
        phase=str(d["phase"]),
        step=_int(d, "step"),
        idle=_float(d, "idle"),
        limit=_float(d, "limit"),
        at=_float(d, "at"),
        stacks=text,
        stacks_error=None if d.get("stacks_error") is None else str(d["stacks_error"]),
        pid=_int(d, "pid") if d.get("pid") is not None else None,
        taken_by=None if d.get("taken_by") is None else str(d["taken_by"]),
    )


def _window(e: Entity | None) -> health.Window:
    if e is None:
        return health.Window()

    def keyed(name: str) -> dict[tuple[str, int], float]:
        return {(n, int(r)): v for n, r, v in json.loads(str(e.data.get(name) or "[]"))}

    return health.Window(
        index=_int(e.data, "window"),
        generation=_int(e.data, "generation"),
        scores=keyed("scores"),
        streaks={k: int(v) for k, v in keyed("streaks").items()},
        since=keyed("since"),
    )


def _window_entity(job_id: str, w: health.Window) -> Entity:
    def listed(values: Mapping[tuple[str, int], float]) -> str:
        return json.dumps([[n, r, v] for (n, r), v in sorted(values.items())])

    return Entity(
        job_id,
        HEALTH_ROW,
        {
            "kind": "health",
            "window": w.index,
            "generation": w.generation,
            "scores": listed(w.scores),
            "streaks": listed(w.streaks),
            "since": listed(w.since),
        },
    )


class Rendezvous:
    """Jobs, joins, seals, heartbeats and departures, over one table.

    Every method reads what it needs from storage and writes with ETag conditions, so
    any number of instances (threads, processes, coordinator replicas) may share a
    table. Nothing here sleeps: callers decide when to poll (see :meth:`tick`).

    Args:
        table: Where the state lives.
        clock: Seconds since the epoch; injectable so tests control time.
        resume: Names, at a seal, the checkpoint the new members resume from (the
            checkpoints' :meth:`~Checkpoints.resume`); None: the job's pointer as it is.
            It may be set after construction, as the checkpoints need the rendezvous.
        on_miss: Called with the job's id at each read :meth:`catch_up` takes (metrics).
    """

    def __init__(
        self,
        table: Table,
        clock: Callable[[], float] = time.time,
        resume: Callable[[Job, tuple[Member, ...]], CheckpointPointer | None] | None = None,
        on_miss: Callable[[str], None] | None = None,
        node_losses: tuple[int, float] | None = None,
        hang_window: float = 3600.0,
    ) -> None:
        self.table = table
        self.clock = clock
        self.resume = resume
        self.on_miss = on_miss
        #: (how many losses, within how many seconds) quarantine a node; None: never.
        self.node_losses = node_losses
        #: Seconds within which a node that hangs twice is quarantined.
        self.hang_window = hang_window
        # Each job's hang limit as this replica's last tick found it (heartbeat replies
        # carry it), and the last straggler window this replica scored.
        self._limits: dict[str, tuple[float | None, health.LimitSource]] = {}
        self._windows: dict[str, int] = {}
        # When this replica's ticks last read each job's progress, and the jobs whose
        # last read found a rank past its bound (health.reads_progress).
        self._progress_read: dict[str, float] = {}
        self._rechecking: set[str] = set()
        # Each job's members' progress as this replica last read it from their beat rows:
        # (the row's text, its parse), by node. A tick reads every row, and most did not
        # change since the last tick (a node beats once a second, passes tick more often):
        # parsing 1,024 nodes' progress at each tick took 22% of a core at 1 Hz beats.
        self._said: dict[str, dict[str, tuple[str, tuple[RankProgress, ...]]]] = {}
        self.secrets = JobSecrets(table)
        # A coordinator that was down heard no heartbeats: it gives every member a full
        # timeout from its start before declaring one dead (see _check_members).
        self.started_at = clock()
        # Likewise after a storage outage (see storage_lost): beats written through
        # other replicas, or buffered here, could not reach storage while it was down.
        self.resumed_at = self.started_at
        self._lost = False
        self._sealed: OrderedDict[tuple[str, int], Generation] = OrderedDict()
        self._max_nodes: dict[str, int] = {}  # per job; a job's spec never changes
        self._loading: dict[tuple[str, int], threading.Lock] = {}
        self._lock = threading.Lock()
        # Node rows as this process last read or wrote them, with their ETags: a join
        # writes its registration on the condition that the row is still what it was
        # here, so the usual join costs one storage call rather than a read and a write.
        self._rows: OrderedDict[tuple[str, str], Node] = OrderedDict()
        # A thousand nodes joining at once write their registrations in shared
        # transactions of up to 50 joins (each keeps its own all-or-none and conditions).
        self._registrations = SharedBatches(table)

    # --- jobs ---------------------------------------------------------------------------

    def create_job(self, job_id: str, spec: JobSpec) -> tuple[Job, bool]:
        """Creates a job, or finds it if it exists with the same spec.

        Returns:
            The job, and whether this call created it.

        Raises:
            JobConflict: The job exists with another spec.
        """
        now = self.clock()
        job = Job(job_id, spec, 0, "open", 0, now, now, "")
        try:
            # Every joiner passes the spec; reading first spares them a failing insert.
            existing = self.get_job(job_id)
        except UnknownJob:
            try:
                stored = self.table.insert(_job_entity(job))
            except AlreadyExists:
                existing = self.get_job(job_id)
            else:
                self.table.upsert(Entity(INDEX, job_id, {"created_at": now}))
                return replace(job, etag=stored.etag or ""), True
        if existing.spec != spec:
            raise JobConflict(
                f"job {job_id!r} exists with {existing.spec.model_dump(mode='json')}, "
                f"not {spec.model_dump(mode='json')}"
            )
        return existing, False

    def get_job(self, job_id: str) -> Job:
        """Reads a job.

        Raises:
            UnknownJob: No job has this id.
        """
        try:
            job = _job(job_id, self.table.get(job_id, JOB_ROW))
        except NotFound:
            raise UnknownJob(f"no job {job_id!r}") from None
        self._max_nodes[job_id] = job.spec.max_nodes
        return job

    def _spread(self, job_id: str) -> int:
        """The job's ``max_nodes``, which decides where its members' rows live."""
        max_nodes = self._max_nodes.get(job_id)
        return self.get_job(job_id).spec.max_nodes if max_nodes is None else max_nodes

    def _partitions(self, job_id: str) -> list[str]:
        return member_partitions(job_id, self._spread(job_id))

    def _partition(self, job_id: str, node_id: str) -> str:
        return member_partition(job_id, node_id, self._spread(job_id))

    def catch_up(self, job: Job, generation: int) -> Job:
        """``job``, unless a request names a ``generation`` newer than it: then the job
        as storage has it now. A replica's snapshot (see ``_driver.py``) may predate a
        seal that another replica made a few milliseconds ago, and a member of that
        generation must not be refused for it.

        Raises:
            UnknownJob: The job is gone.
        """
        if generation <= job.generation:
            return job
        if self.on_miss is not None:
            self.on_miss(job.job_id)
        return self.get_job(job.job_id)

    def list_jobs(self) -> list[Job]:
        """Every job, in id order."""
        jobs = []
        for row in self.table.query(INDEX):
            try:
                jobs.append(self.get_job(row.row_key))
            except UnknownJob:
                continue  # indexed but its creation did not finish
        return jobs

    # --- generations --------------------------------------------------------------------

    def generation(self, job_id: str, generation: int) -> Generation:
        """Reads one generation's record.

        Raises:
            NotFound: The generation never sealed.
        """
        return self._generation_of(self.table.get(job_id, _generation_key(generation)))

    def _generation_of(self, e: Entity) -> Generation:
        """The generation whose row is ``e``, reading its part rows if it has any."""
        if not e.data.get("parts"):
            return _generation(e)
        seal_id, n = str(e.data["seal"]), _int(e.data, "parts")
        generation = _int(e.data, "generation")
        return _generation(
            e,
            [self.table.get(e.partition_key, _part_key(generation, seal_id, i)) for i in range(n)],
        )

    def history(self, job_id: str, since: int = 1) -> list[GenerationInfo]:
        """The job's generations from ``since`` on, oldest first: one query, and no
        member lists unpacked (a row records its world size), for the timeline. A job
        that does not exist has none.
        """
        where = [Cond("kind", "eq", "gen"), Cond("generation", "ge", since)]
        out = []
        for e in self.table.query(job_id, where):
            d = e.data
            checkpoint = d.get("checkpoint")
            out.append(
                GenerationInfo(
                    generation=_int(d, "generation"),
                    world_size=_int(d, "world_size"),
                    sealed_at=_float(d, "sealed_at"),
                    ended_at=_opt_float(d, "ended_at"),
                    ended_reason=None if d.get("ended_reason") is None else str(d["ended_reason"]),
                    checkpoint=CheckpointPointer.model_validate_json(str(checkpoint))
                    if checkpoint
                    else None,
                    load_failure=_load_failure(d),
                )
            )
        return out

    def sealed(self, job_id: str, generation: int) -> Generation:
        """A sealed generation as it was sealed: members in rank order and checkpoint.

        Cached, because that part never changes (only ``ended_*`` does, which callers of
        this method must not rely on).
        """
        key = (job_id, generation)
        with self._lock:
            if key in self._sealed:
                self._sealed.move_to_end(key)
                return self._sealed[key]
            loading = self._loading.setdefault(key, threading.Lock())
        # Single flight: when a seal wakes a thousand waiters, one of them reads the
        # record and the rest wait for it, instead of a thousand reads and decodes.
        with loading:
            with self._lock:
                if key in self._sealed:
                    return self._sealed[key]
            gen = self.generation(job_id, generation)
            with self._lock:
                self._sealed[key] = gen
                self._loading.pop(key, None)
                while len(self._sealed) > 64:
                    self._sealed.popitem(last=False)
            return gen

    def cached(self, job_id: str, generation: int) -> Generation | None:
        """:meth:`sealed` if it is cached, without touching storage (for async callers)."""
        with self._lock:
            return self._sealed.get((job_id, generation))

    def end_generation(
        self,
        job: Job,
        reason: str,
        load_failure: LoadFailure | None = None,
        lost: str | None = None,
        hang: health.Hang | None = None,
        learned: tuple[int, ...] | None = None,
    ) -> bool:
        """Ends the job's sealed generation, naming ``reason``; False if the job changed
        since ``job`` was read (the caller reads it again and decides again).

        Args:
            load_failure: Set when it ends because a rank could not load its checkpoint:
                recorded on the generation, and counted on the job
                (:func:`._seal.load_streak`).
            lost: The member whose loss ends it: counted on the job, and quarantined in
                the same write if it was lost too often (:attr:`node_losses`).
            hang: The rank whose hang ends it: its report is written in the same batch,
                its node's hang counted, and the node quarantined if it hung too often
                (:func:`._health.hung_too_often`).
            learned: The world sizes a worker reported the job can take, kept on the
                job in the same write (:func:`._seal.learned`).
        """
        now = self.clock()
        try:
            gen = self.generation(job.job_id, job.generation)
            streak = seal.load_streak(job.load_failure, load_failure)
            ended = replace(
                job,
                status="open",
                changed_at=now,
                load_failure=streak,
                last_end=(job.generation, reason),
            )
            if self.node_losses is not None:
                ended = self._count_loss(ended, lost, now)
            if learned is not None:
                ended = replace(ended, learned_sizes=learned)
            ended = self._count_stall(ended, reason)
            if hang is not None:
                ended = self._count_hang(ended, hang, now)
            ops = [
                BatchOp("replace", _job_entity(ended), if_match=job.etag),
                BatchOp(
                    "replace",
                    _generation_entity(
                        job.job_id,
                        replace(gen, ended_at=now, ended_reason=reason, load_failure=load_failure),
                    ),
                    if_match=gen.etag,
                ),
            ]
            if hang is not None:
                ops.append(BatchOp("upsert", _hang_entity(job.job_id, job.generation, hang, now)))
            self.table.batch(ops)
        except (Modified, NotFound):
            return False
        if hang is not None:
            self._trim_hangs(job.job_id)
        return True

    def _count_stall(self, job: Job, reason: str) -> Job:
        """``job`` with the generation that just ended counted for :func:`._health.
        stalled` (the steps its ranks reported, from the beat rows)."""
        heard: dict[str, health.Heard] = {}
        self._beats(job.job_id, heard=heard)
        said = [p for h in heard.values() if h.generation == job.generation for p in h.progress]
        # Only a step trained is progress; ranks that reported but never left start-up
        # made none (-1); ranks that reported nothing tell nothing (None).
        trained = [p.step for p in said if p.phase != "start"]
        ended_step = max(trained) if trained else (-1 if said else None)
        committed = job.checkpoint is not None and job.checkpoint.generation == job.generation
        fault = timeline.cause(reason) in _FAULTS
        stalls, best = health.stalled(job.stalls, job.best_step, ended_step, committed, fault)
        reasons = job.stall_reasons
        if stalls > job.stalls:
            reasons = (*reasons, reason)[-health.STALLS_BEFORE_BLOCK :]
        elif stalls == 0:
            reasons = ()
        return replace(job, stalls=stalls, best_step=best, stall_reasons=reasons)

    def _count_hang(self, job: Job, hang: health.Hang, now: float) -> Job:
        """``job`` with ``hang`` counted, its node quarantined if it hung too often."""
        recent = health.hangs(job.hangs, hang.node_id, now, self.hang_window)
        marked = replace(job, hangs=recent, last_hang=(job.generation, hang.node_id, hang.rank))
        if job.quarantine_of(hang.node_id) is not None or not health.hung_too_often(
            recent[hang.node_id]
        ):
            return marked
        why = f"hung {len(recent[hang.node_id])} times within {self.hang_window:g} s"
        log.warning("job %r: node %s quarantined: %s", job.job_id, hang.node_id, why)
        mark = QuarantinedNode(node_id=hang.node_id, at=now, reason=why, by="hangs")
        recent = {n: t for n, t in recent.items() if n != hang.node_id}
        return replace(marked, hangs=recent, quarantined=(*job.quarantined, mark))

    def _count_loss(self, job: Job, lost: str | None, now: float) -> Job:
        """``job`` with ``lost``'s loss counted, and the node quarantined if the rule
        says (:func:`._seal.lost_too_often`)."""
        assert self.node_losses is not None
        limit, window = self.node_losses
        losses = seal.losses(job.losses, lost, now, window)
        if lost is None or job.quarantine_of(lost) is not None:
            return replace(job, losses=losses)
        if not seal.lost_too_often(losses.get(lost, ()), limit):
            return replace(job, losses=losses)
        why = f"lost {len(losses[lost])} times within {window:g} s"
        log.warning("job %r: node %s quarantined: %s", job.job_id, lost, why)
        mark = QuarantinedNode(node_id=lost, at=now, reason=why, by="losses")
        losses.pop(lost)
        return replace(job, losses=losses, quarantined=(*job.quarantined, mark))

    def pointers(
        self,
        job: Job,
        checkpoint: CheckpointPointer | None,
        durable: CheckpointPointer | None,
    ) -> BatchOp:
        """The one write of the job row that checkpoints make: its latest and newest
        durable pointers, all else as ``job`` was read, conditioned on ``job``'s ETag. A
        batch operation, to go in one transaction with the version rows it is for.

        This module owns the job row; this is the narrow part of it that
        :class:`~._checkpoints.Checkpoints` may change.
        """
        moved = replace(job, checkpoint=checkpoint, durable=durable)
        return BatchOp("replace", _job_entity(moved), if_match=job.etag)

    # --- joining ------------------------------------------------------------------------

    def register(
        self,
        job_id: str,
        node_id: str,
        addr: str,
        port: int,
        spec: JobSpec | None = None,
        join_id: str | None = None,
        peer: str | None = None,
        registration: str | None = None,
        known: Job | None = None,
        warm: bool = False,
    ) -> Node:
        """Registers a node for the job's next generation.

        A node that joins while a generation runs ends it (a newcomer, or a member that
        restarted), so every member is told to restart and the next one includes it;
        unless it parks: as a standby beside a full generation, or by a hot join
        (``warm``) until its workers are ready (:meth:`ready`).

        Args:
            spec: Creates the job if missing; must match the job's if it exists.
            join_id: Repeating a join with the same key (a client retrying after a lost
                reply, or after a coordinator restart) registers nothing new and ends
                nothing: it waits for the round the first request registered for.
            peer: The node's replica server (see :class:`JoinRequest`).
            registration: Keeps this registration (and so the credential its caller
                holds) for a node that missed its round and waits for the next.
            known: A recent snapshot of the job (the driver's), instead of reading it.
                A stale one costs nothing but a wasted round: the node registers for a
                round that sealed without it, and its wait sees it missed that round.
            warm: A hot join (:attr:`JoinRequest.warm`): a newcomer to a generation
                with room parks until its workers are ready rather than end it.

        Returns:
            The node's registration, with its ``credential``; its ``round`` is the
            generation it waits for.

        Raises:
            UnknownJob: No job, and no spec to create it with.
            JobConflict: ``spec`` differs from the job's.
            JobFull: The running generation has ``max_nodes`` members and this is not one.
        """
        if known is not None:
            job = known  # a job's spec never changes, so the snapshot's is the job's
            if spec is not None and job.spec != spec:
                raise JobConflict(
                    f"job {job_id!r} exists with {job.spec.model_dump(mode='json')}, "
                    f"not {spec.model_dump(mode='json')}"
                )
        elif spec is not None:
            job, _ = self.create_job(job_id, spec)
        else:
            job = self.get_job(job_id)
        mark = job.quarantine_of(node_id)
        if mark is not None:
            raise NodeQuarantined(
                f"node {node_id} is quarantined in job {job_id!r} ({mark.by}: "
                f"{mark.reason or 'no reason given'}); an operator clears it with "
                f"`rallypoint nodes unquarantine {job_id} {node_id}`"
            )
        if registration is None:
            # Retries of one join are one registration, so they get the same credential,
            # whichever of them lands its write last.
            registration = (
                f"join-{join_id}" if join_id is not None else credentials.new_registration()
            )
        credential = credentials.derive(
            self.secrets.get(job_id, credentials.NODE_KEY, lambda: secrets.token_bytes(32)),
            job_id,
            node_id,
            registration,
        )
        partition = member_partition(job_id, node_id, job.spec.max_nodes)
        # The row as this process last saw it; the write below is conditioned on it. A
        # join with the same key as the row's may be a retry: that reads the row itself.
        row = self._rows.get((job_id, node_id))
        if join_id is not None and row is not None and row.join_id == join_id:
            row = self._node_row(job_id, node_id)
        while True:
            if (
                row is not None
                and join_id is not None
                and row.join_id == join_id
                and row.state == "waiting"
                and row.registration == registration
                and self._registered(job, row)
            ):
                # a retry of a join that already registered
                parked = job.status == "sealed" and row.round > job.generation
                return replace(row, credential=credential, parked=parked)
            if job.status == "sealed":
                running = self.sealed(job_id, job.generation)
                if not (
                    self._waits_for_size(job, running, node_id)
                    or seal.warms(job, running, node_id, warm)
                    or (
                        job.spec.standbys > 0
                        and seal.parks(job, running, node_id, self._standbys(job, node_id))
                    )
                ):
                    self.end_generation(job, seal.join_ends(job, running, node_id))
                    job = self.get_job(job_id)
                    continue
                # A standby or a hot join warming up: it registers for the next round
                # and ends nothing. (Two standbys that
                # park at once may both count one free place: the one the next seal
                # leaves out joins again and is refused as job_full, as without standbys.)
            now = self.clock()
            node = Node(
                node_id,
                addr,
                port,
                job.round,
                now,
                "waiting",
                join_id,
                peer,
                registration,
                credentials.digest(credential),
                warm=warm,
            )
            if join_id is None:
                write = BatchOp("upsert", _node_entity(partition, node))
            elif row is None:
                write = BatchOp("insert", _node_entity(partition, node))
            else:
                write = BatchOp("replace", _node_entity(partition, node), if_match=row.etag)
            try:
                stored, _ = self._registrations.batch(  # registration and first beat together
                    [write, _beat_op(partition, node_id, now, 0)]
                )
            except (AlreadyExists, Modified, NotFound):
                # Written (or removed) since this process saw it (perhaps by this very join, retried
                # through another replica): decide on the row as it is now.
                row = self._node_row(job_id, node_id)
                continue
            node = replace(node, etag=stored.etag if stored is not None else None)
            self._seen(job_id, node)
            # Registered beside a generation that runs: one it did not end, so it parks.
            return replace(node, credential=credential, parked=job.status == "sealed", beat=True)

    def ready(self, job_id: str, node_id: str, round: int) -> bool:
        """A node parked for ``round`` by a hot join says its workers wait to train:
        ends the running generation for it (:func:`._seal.ready_ends`). True if this
        call ended it; False if there was nothing to end (a standby beside a full
        generation, a round already open or sealed) or another request ended it first.

        Raises:
            UnknownJob, UnknownNode: As named (the node must be registered for ``round``).
        """
        while True:
            job = self.get_job(job_id)
            node = self.node(job_id, node_id)
            if node.round != round or job.status != "sealed":
                return False
            running = self.sealed(job_id, job.generation)
            # A job of some sizes only: the generation ends if those parked make one.
            waiting = len(self.parked_nodes(job)) if seal.sizes(job) is not None else 1
            reason = seal.ready_ends(job, running, node_id, round, max(waiting, 1))
            if reason is None:
                return False
            if self.end_generation(job, reason):
                return True

    def _registered(self, job: Job, node: Node) -> bool:
        """Whether a registration still stands: its round is open, or it parks for the
        next round as a standby, or its round sealed with it."""
        if job.status == "open" or seal.parked(job, node.round):
            return node.round == job.round
        return (
            node.round == job.generation
            and node.node_id in self.sealed(job.job_id, job.generation).ranks
        )

    def _standbys(self, job: Job, but: str) -> int:
        """How many live nodes other than ``but`` park as standbys beside the running
        generation (see :meth:`standbys`)."""
        return sum(1 for n in self.standbys(job) if n.node_id != but)

    def _waits_for_size(self, job: Job, running: Generation, node_id: str) -> bool:
        """:func:`._seal.waits_for_size`, counting the nodes parked beside ``running``
        (a read of the job's node rows and beats, only for a job of some sizes).

        Raises:
            JobFull: No place left for the node to wait in.
        """
        if seal.sizes(job) is None or node_id in running.ranks:
            return False
        waiting = sum(1 for n in self.parked_nodes(job) if n.node_id != node_id)
        return seal.waits_for_size(job, running, node_id, waiting)

    def standbys(self, job: Job) -> list[Node]:
        """The live nodes that park as standbys beside the running generation
        (:meth:`parked_nodes`) of a job with standbys (``spec.standbys``), which hold
        copies of the members' files (:func:`._seal.keeper`)."""
        return self.parked_nodes(job) if job.spec.standbys else []

    def parked_nodes(self, job: Job) -> list[Node]:
        """The live nodes that park beside the running generation (:func:`._seal.
        parked`: standbys, hot joins warming up, nodes waiting for a world size), in the
        order they parked (:func:`._seal.ranked`): one that died while it waited (silent
        past the heartbeat timeout, or its held wait cut) holds no place, or a crashed
        standby would keep its replacement out for as long as the generation runs. None
        while the job runs no generation."""
        if job.status != "sealed":
            return []
        rows = self._nodes(
            job.job_id, (Cond("round", "eq", job.round), Cond("state", "eq", "waiting"))
        )
        if not rows:
            return []
        cut: set[str] = set()
        beats = self._beats(job.job_id, cut)
        timeout = _seconds(job.spec.heartbeat_timeout)
        live = seal.alive(rows, beats, self.clock(), self.resumed_at, timeout)
        return seal.ranked([n for n in live if n.node_id not in cut], {})

    def record_beats(
        self,
        job_id: str,
        node_ids: Iterable[str],
        generation: int = 0,
        *,
        at: Mapping[str, float] | None = None,
        progress: Mapping[str, Sequence[RankProgress]] | None = None,
    ) -> None:
        """Records that nodes are alive (in batches of 100 of one partition).

        Args:
            at: When each node's beat arrived; a node it does not name: now. (A beat is
                written up to a pass after it arrived: stamped with its write, it could
                hide the cut of the held heartbeat it came with, see :meth:`expire`.)
            progress: What each node's beat said of its processes, as its request parsed
                it (written as :func:`progress_json`); a node it does not name reported
                none. This replica's next tick takes the parse as it reads the rows
                back, instead of parsing each again (as much CPU as the request's own).
        """
        now = self.clock()
        by_partition: dict[str, list[BatchOp]] = {}
        known = self._said.setdefault(job_id, {}) if progress else {}
        for n in dict.fromkeys(node_ids):
            partition = self._partition(job_id, n)
            when = now if at is None else at.get(n, now)
            said = None if progress is None else progress.get(n)
            text = None
            if said is not None:
                parsed = tuple(said)
                known[n] = (text := progress_json(parsed), parsed)
            by_partition.setdefault(partition, []).append(
                _beat_op(partition, n, when, generation, text)
            )

        for ops in by_partition.values():
            for start in range(0, len(ops), 100):
                self.table.batch(ops[start : start + 100])

    def expire(self, job_id: str, node_id: str, since: float) -> bool:
        """Marks a node silent, unless a beat of it arrived after ``since`` (through any
        replica). A node marked silent is not sealed into a round (see :meth:`tick`).

        Returns:
            Whether it was marked (by ETag condition: a beat written meanwhile wins).
        """
        partition = self._partition(job_id, node_id)
        try:
            e = self.table.get(partition, BEAT + node_id)
        except NotFound:
            return False
        if _float(e.data, "at") > since:
            return False
        data = {**e.data, "at": 0.0, "dropped": since}
        try:
            self.table.replace(Entity(partition, BEAT + node_id, data), if_match=e.etag or "")
        except Modified:
            return False
        self._name_first_cause(job_id, node_id, _int(e.data, "generation"), since)
        return True

    def _name_first_cause(self, job_id: str, node_id: str, generation: int, since: float) -> None:
        """Makes a generation that ended after a member's heartbeat watch was cut name
        the cut as its cause.

        A killed node's peers fail in their collectives at once, and their agents join
        again: that re-join may end the generation before the cut is judged (a second
        later, see :meth:`Driver.dropped`), and the record would blame a survivor.
        """
        for _ in range(3):  # another replica may be writing the same record
            try:
                gen = self.generation(job_id, generation)
            except NotFound:
                return  # not a member's beat (generation 0), or never sealed
            reason = gen.ended_reason
            if (
                gen.ended_at is None  # still running: the next tick ends it for the cut
                or gen.ended_at < since  # it ended before the cut
                or node_id not in gen.ranks
                or reason is None
                or reason.startswith(f"node {node_id} ")
            ):
                return
            first = f"node {node_id} dropped its heartbeat connection (then: {reason})"
            try:
                self.table.replace(
                    _generation_entity(job_id, replace(gen, ended_reason=first)),
                    if_match=gen.etag,
                )
                return
            except Modified:
                continue

    def _beats(
        self,
        job_id: str,
        dropped: set[str] | None = None,
        heard: dict[str, health.Heard] | None = None,
    ) -> dict[str, float]:
        """Each node's last heartbeat; adds to ``dropped`` the nodes whose heartbeat
        watch was cut since (see :meth:`expire`), and to ``heard`` what each node's
        last beat said of its processes."""
        out: dict[str, float] = {}
        # Without ``heard``, the stamps alone: a row's progress is most of its bytes.
        select = None if heard is not None else ("at", "dropped")
        rows = (
            e
            for partition in self._partitions(job_id)
            for e in self.table.query(partition, [Cond("kind", "eq", "beat")], select=select)
        )
        last = self._said.get(job_id, {})
        parsed: dict[str, tuple[str, tuple[RankProgress, ...]]] = {}
        for e in rows:
            node_id, at = e.row_key[len(BEAT) :], _float(e.data, "at")
            out[node_id] = at
            cut = _opt_float(e.data, "dropped")
            if dropped is not None and cut is not None and cut >= at:
                dropped.add(node_id)
            if heard is not None:
                generation = _int(e.data, "generation") if e.data.get("generation") else 0
                text = str(e.data.get("progress") or "")
                known = last.get(node_id)
                said = known[1] if known is not None and known[0] == text else _progress(text)
                if said:
                    parsed[node_id] = (text, said)
                heard[node_id] = health.Heard(node_id, at, generation, said)
        if heard is not None:
            self._said[job_id] = parsed  # a node gone, or whose row went, is dropped
        return out

    def _count(self, job_id: str, where: tuple[Cond, ...] = ()) -> int:
        """How many node rows match ``where``, read by their keys (a select of none)."""
        where = (Cond("kind", "eq", "node"), *where)
        return sum(
            1
            for partition in self._partitions(job_id)
            for _ in self.table.query(partition, where, select=())
        )

    def _nodes(self, job_id: str, where: tuple[Cond, ...] = ()) -> list[Node]:
        where = (Cond("kind", "eq", "node"), *where)
        nodes = [
            _node(e)
            for partition in self._partitions(job_id)
            for e in self.table.query(partition, where)
        ]
        self._seen(job_id, *nodes)  # ticks read every waiting node: what joins condition on
        return nodes

    def outcome(self, job: Job, node_id: str, round: int) -> Generation | Literal["missed"] | None:
        """A waiting node's outcome for ``round``, given a fresh job snapshot.

        Returns:
            The sealed generation once ``round`` sealed with the node in it; ``"missed"``
            if the round sealed (or passed) without it, so it must join again; None while
            the round is still open.
        """
        if job.generation < round:
            return None
        if job.generation > round or job.status != "sealed":
            return "missed"
        sealed = self.sealed(job.job_id, round)
        return sealed if node_id in sealed.ranks else "missed"

    def member(
        self,
        job: Job,
        node_id: str,
        generation: int,
        credential: str | None,
        *,
        ended: bool = False,
    ) -> tuple[Generation, int]:
        """Fences a request that acts for a node in ``generation``: the generation and the
        node's rank.

        Args:
            job: The job as read from storage, or a replica's snapshot: one older than
                ``generation`` is read again (:meth:`catch_up`) before it refuses.
            ended: Also accept a generation that ended (for reads of what it left).

        Raises:
            StaleGeneration: ``generation`` is not the job's running one (with
                ``ended``: it never sealed).
            UnknownNode: The node is not a member of it.
            InvalidCredential: ``credential`` is not the member's.
        """
        job = self.catch_up(job, generation)
        running = generation == job.generation and job.status == "sealed"
        if not running and not (ended and 1 <= generation <= job.generation):
            raise StaleGeneration(
                f"generation {generation} of job {job.job_id!r} is not running "
                f"(latest is {job.generation}, {job.status})"
            )
        gen = self.sealed(job.job_id, generation)
        gen.check_credential(node_id, credential)
        return gen, gen.ranks[node_id]

    def node(self, job_id: str, node_id: str) -> Node:
        """Reads a node's registration.

        Raises:
            UnknownNode: It never joined.
        """
        node = self._node_row(job_id, node_id)
        if node is None:
            raise UnknownNode(f"node {node_id!r} never joined job {job_id!r}")
        return node

    def _node_row(self, job_id: str, node_id: str) -> Node | None:
        """Reads a node's row (None if it has none), and keeps it as last seen here."""
        try:
            node = _node(self.table.get(self._partition(job_id, node_id), NODE + node_id))
        except NotFound:
            with self._lock:
                self._rows.pop((job_id, node_id), None)
            return None
        self._seen(job_id, node)
        return node

    def _seen(self, job_id: str, *nodes: Node) -> None:
        """Keeps the nodes' rows as last seen here, for the most recent 100,000 nodes (a
        node not kept costs its next join a read, nothing else)."""
        with self._lock:
            for node in nodes:
                self._rows[(job_id, node.node_id)] = node
                self._rows.move_to_end((job_id, node.node_id))
            while len(self._rows) > 100_000:
                self._rows.popitem(last=False)

    # --- driving ------------------------------------------------------------------------

    def tick(self, job_id: str, urgent: bool = True) -> tuple[Job, float]:
        """Does what time demands: seals an open round that may seal, ends a generation
        with a silent member or a hung rank.

        Args:
            urgent: Whether something asked for this tick (a beat past a bound): it
                reads the members' progress. A driver's timed tick passes False, and
                reads it as :func:`._health.reads_progress` says.

        Returns:
            The job afterwards, and how many seconds until the next tick can change
            anything (``math.inf`` if only a join can).
        """
        job = self.get_job(job_id)
        if self._lost:  # storage answered that read: the outage is over
            self._lost = False
            self.resumed_at = self.clock()
        if job.status == "open":
            sealed, wait = self._try_seal(job)
        else:
            sealed, wait = self._check_members(job, urgent)
        return (self.get_job(job_id) if sealed else job), wait

    def _try_seal(self, job: Job) -> tuple[bool, float]:
        """Seals the job's open round if the rules of :mod:`._seal` say it may."""
        spec = job.spec
        now = self.clock()
        waiting_now = (Cond("round", "eq", job.round), Cond("state", "eq", "waiting"))
        if self._count(job.job_id, waiting_now) < spec.min_nodes:
            # Too few even before the rules below drop any: counted by their keys alone.
            # While 10,000 nodes join, a tick at every pass read every row joined so far,
            # a third of a round's CPU on local storage.
            return False, math.inf
        registered = self._nodes(job.job_id, waiting_now)
        registered = seal.admitted(registered, job.quarantined)
        # Standbys of a generation that finished training go home (their waits say so).
        registered = [n for n in registered if not seal.released(job, n.round, n.joined_at)]
        if len(registered) < spec.min_nodes:
            # Too few even if all are alive: spares reading every beat at each tick while
            # thousands of nodes register.
            return False, math.inf
        if health.stall_blocked(job.stalls, job.stall_reasons) is not None:
            # The job made no progress in generation after generation: it stops
            # restarting (its joins time out with the reason) until an operator unblocks.
            return False, math.inf
        cut: set[str] = set()
        beats = self._beats(job.job_id, cut)
        timeout = _seconds(spec.heartbeat_timeout)
        # A node whose held join was cut and that did not beat since is gone: its
        # seal would only end the generation at once (a watch is held from the join).
        waiting = [
            n
            for n in seal.alive(registered, beats, now, self.resumed_at, timeout)
            if n.node_id not in cut
        ]
        if len(waiting) < spec.min_nodes:
            return False, math.inf
        out = health.sits_out(
            job.last_hang, job.generation, [n.node_id for n in waiting], spec.min_nodes
        )
        waiting = [n for n in waiting if n.node_id != out]
        previous: dict[str, int] = {}
        if job.generation:
            previous = self.sealed(job.job_id, job.generation).ranks
        ordered = seal.ranked(waiting, previous)
        # The largest world the job takes that these nodes make: the rest wait beside it.
        size = seal.world_for(job, len(ordered))
        if size is None:
            return False, math.inf  # no size the job takes (status says): only a join helps
        if len(ordered) < spec.max_nodes:
            missing = previous.keys() - {n.node_id for n in waiting}
            gone = (
                {n.node_id for n in self._nodes(job.job_id, (Cond("state", "eq", "left"),))}
                if missing
                else set()
            )
            if job.last_hang is not None and job.last_hang[0] == job.generation:
                # A node whose rank hung is not waited for (see _health.sits_out).
                gone.add(job.last_hang[1])
            waits = seal.seal_waits(job, waiting, previous, beats, gone, now)
            if waits:
                return False, min(waits) - now
        # A lost member's slot goes to the standby holding copies of its files.
        parked = seal.standing_by(ordered, previous, job.changed_at) if spec.standbys else []
        chosen = seal.slotted(ordered, previous, size, parked)
        members = tuple(
            Member(n.node_id, i, n.addr, n.port, n.peer, n.cred) for i, n in enumerate(chosen)
        )
        # The checkpoint is named with the seal, in the same CAS, so every member of the
        # generation resumes from the same version: the newest that the new members'
        # memory or blob storage can still give back (nothing commits while the round
        # is open). It becomes the pointer: the versions after it are lost for good.
        resume = job.checkpoint if self.resume is None else self.resume(job, members)
        if seal.load_blocked(job.load_failure, len(members), resume) is not None:
            # Only a join (a round of another size) can change this: no timed tick.
            return False, math.inf
        gen = Generation(job.round, members, now, None, None, resume, "")
        sealed = replace(
            job,
            generation=job.round,
            status="sealed",
            world_size=len(members),
            changed_at=now,
            checkpoint=resume,
        )
        row, parts = _sealing_rows(job.job_id, gen)
        for part in parts:  # one each: a batch carries 4 MiB at most
            self.table.insert(part)
        try:
            self.table.batch(
                [
                    BatchOp("replace", _job_entity(sealed), if_match=job.etag),
                    BatchOp("insert", row),
                ]
            )
        except (Modified, AlreadyExists):
            for part in parts:  # nothing names them: this seal lost its race
                with contextlib.suppress(NotFound):
                    self.table.delete(part.partition_key, part.row_key)
            return False, 0.0  # another coordinator sealed or changed it first
        return True, 0.0

    def storage_lost(self) -> None:
        """Tells that a storage call failed: heartbeats may have been lost, so the next
        :meth:`tick` that reads storage again restarts every member's clock (a storage
        outage must not declare members dead, or waiting nodes gone, for a silence it
        caused)."""
        self._lost = True

    def _check_members(self, job: Job, urgent: bool = True) -> tuple[bool, float]:
        """Ends the job's running generation if :func:`._seal.silent` says it ends, or
        :func:`._health.hung` finds a rank hung; scores the stragglers once a window
        (:meth:`_straggle`). The last two only at ticks that read the members'
        progress (:func:`._health.reads_progress`)."""
        running = self.sealed(job.job_id, job.generation)
        cut: set[str] = set()
        now = self.clock()
        source = self._limits.get(job.job_id, (None, "warming"))[1]
        last = self._progress_read.get(job.job_id)
        rechecking = job.job_id in self._rechecking
        read = health.reads_progress(urgent, last, now, source, rechecking)
        heard: dict[str, health.Heard] | None = {} if read else None
        beats = self._beats(job.job_id, cut, heard)
        since = max(job.changed_at, self.started_at, self.resumed_at)
        reason, wait, lost = seal.silent(job, running, beats, cut, since, self.clock())
        if reason is not None:
            return self.end_generation(job, reason, lost=lost), 0.0
        if heard is None:
            return False, wait
        self._progress_read[job.job_id] = now
        current = [h for n, h in heard.items() if h.generation == job.generation]
        limit, source = health.hang_limit(job.spec, current, self.hang_limit(job.job_id))
        self._limits[job.job_id] = (limit, source)
        trained = job.best_step >= 0
        found, recheck = health.hung(job.spec, job.generation, running.ranks, heard, limit, trained)
        if math.isfinite(recheck) and found is None:
            self._rechecking.add(job.job_id)
        else:
            self._rechecking.discard(job.job_id)
        if found is not None:
            log.warning("job %r: %s", job.job_id, found.reason)
            return self.end_generation(job, found.reason, hang=found), 0.0
        return self._straggle(job, running, heard), min(wait, recheck)

    def hang_limit(self, job_id: str) -> float | None:
        """The job's hang limit for training steps as this replica's last tick found it
        (None: not known here yet, or not judged)."""
        return self._limits.get(job_id, (None, "warming"))[0]

    def _straggle(self, job: Job, running: Generation, heard: Mapping[str, health.Heard]) -> bool:
        """Scores the running generation's ranks once a straggler window (the first
        replica to tick in a window writes the job's ``health`` row; the others find it
        written), names a rank that became a straggler in one log line, and acts on the
        job's ``straggler`` policy (:func:`._health.straggler_action`).

        Returns:
            Whether the generation ended (a straggler replaced or dropped).
        """
        now = self.clock()
        index = health.window_of(now)
        if self._windows.get(job.job_id, -1) >= index:
            return False
        self._windows[job.job_id] = index
        try:
            row: Entity | None = self.table.get(job.job_id, HEALTH_ROW)
        except NotFound:
            row = None
        last = _window(row)
        if last.index >= index:
            return False  # another replica scored this window
        rated = health.scores(job.generation, running.ranks, heard)
        window = health.next_window(
            last, index, job.generation, rated, job.spec.straggler_threshold, now
        )
        try:
            if row is None:
                self.table.insert(_window_entity(job.job_id, window))
            else:
                self.table.replace(_window_entity(job.job_id, window), if_match=row.etag or "")
        except (Modified, AlreadyExists):
            return False
        named = health.stragglers(window)
        for s in named:
            if window.since.get((s.node_id, s.rank)) == now:
                log.warning(
                    "job %r: rank %d on node %s is a straggler: score %.2f (its own step "
                    "time against the fastest rank's) under %.2f for %d windows of %g s",
                    job.job_id,
                    s.rank,
                    s.node_id,
                    s.score,
                    job.spec.straggler_threshold,
                    s.windows,
                    STRAGGLER_WINDOW,
                )
        if not named or job.spec.straggler == "report":
            return False
        owns: dict[str, float] = {}
        for node_id in running.ranks:
            beat = heard.get(node_id)
            if beat is not None and beat.generation == job.generation:
                mine = [p.own for p in beat.progress if p.own is not None]
                if mine:
                    owns[node_id] = max(mine)
        worst = named[0]
        standbys = len(self.standbys(job)) if job.spec.straggler == "replace" else 0
        action = health.straggler_action(job.spec, worst, len(running.members), standbys, owns)
        if action is None:
            return False
        why = (
            f"straggler: rank {worst.rank}'s score {worst.score:.2f} stayed under "
            f"{job.spec.straggler_threshold:.2f} for {worst.windows} windows ({action})"
        )
        log.warning("job %r: node %s %s", job.job_id, worst.node_id, why)
        self.quarantine_node(job.job_id, worst.node_id, why, by="straggler")
        return True

    # --- members ------------------------------------------------------------------------

    def judge_beat(
        self, job: Job, node_id: str, generation: int | None
    ) -> Literal["continue", "restart"]:
        """:func:`._seal.verdict`: what a heartbeat is told, from a recent job snapshot;
        records nothing.

        Raises:
            StaleGeneration: The generation is newer than any the job sealed.
        """
        return seal.verdict(job, node_id, generation)

    def end_reason(self, job: Job, generation: int | None) -> str | None:
        """:func:`._seal.end_reason`: why a member's generation ended, for the heartbeat
        that tells it to restart (None: not known from ``job``)."""
        return seal.end_reason(job, generation)

    def leave(
        self,
        job_id: str,
        node_id: str,
        generation: int | None,
        reason: str,
        credential: str | None,
    ) -> None:
        """Takes a node out of the job, at its own request; ends its generation if it
        was a member.

        Raises:
            InvalidCredential: ``credential`` is not that of the node's registration.
            StaleGeneration: ``generation`` ended already (a zombie is fenced out).
            UnknownNode: The node never joined.
        """
        job = self.get_job(job_id)
        node = self.node(job_id, node_id)
        credentials.check(node.cred, credential, node_id)
        if generation is not None and (generation != job.generation or job.status != "sealed"):
            raise StaleGeneration(
                f"generation {generation} of job {job_id!r} is over "
                f"(latest is {job.generation}, {job.status})"
            )
        self._depart(job, node, f"node {node_id} left: {reason}")

    def learn_world_sizes(
        self, job_id: str, node_id: str, report: WorldSizeReport, credential: str | None
    ) -> Job:
        """A member's worker found that its generation's world cannot train the job (a
        ``WorldSizeError``) and names the sizes, in nodes, that can: the job keeps them
        (:func:`._seal.learned`) and the generation ends, in one write, naming the rank
        and its error. From then on a round seals only a size the job takes, and nodes
        beyond it wait (:func:`._seal.world_for`, :func:`._seal.waits_for_size`). Of the
        ranks that report, the first is kept; the others find the generation over.

        Returns:
            The job afterwards.

        Raises:
            StaleGeneration: The generation is not the job's running one (another rank
                reported first, or a member died).
            UnknownNode: The node is not a member of it.
            InvalidCredential: Not the node's credential.
        """
        line = report.reason.strip().splitlines()[0] if report.reason.strip() else ""
        for _ in range(100):
            job = self.get_job(job_id)
            running, _ = self.member(job, node_id, report.generation, credential)
            world = len(running.members)
            kept = seal.learned(job, report.world_sizes, world)
            why = seal.size_refused(replace(job, learned_sizes=kept), world, report.rank, line)
            if self.end_generation(job, why, learned=kept):
                log.warning("job %r: generation %d ended: %s", job_id, report.generation, why)
                return self.get_job(job_id)
        raise StorageUnavailable(f"could not end generation {report.generation} of {job_id!r}")

    def remove(self, job_id: str, node_id: str, reason: str) -> None:
        """Takes a node out of the job for the operator (no credential): as if it had
        left; its generation ends if it was a member.

        Raises:
            UnknownJob, UnknownNode: As named.
        """
        self._depart(self.get_job(job_id), self.node(job_id, node_id), reason)

    def quarantine_node(
        self,
        job_id: str,
        node_id: str,
        reason: str,
        by: Literal["operator", "straggler"] = "operator",
    ) -> Job:
        """Keeps a node out of the job (the operator's): its joins are refused, no round
        seals it, and if it is a member its generation ends, as if it had been removed.
        The node need not have joined (a machine known to be bad). Quarantining a
        quarantined node keeps the first mark.

        Raises:
            UnknownJob: No such job.
        """
        for _ in range(100):
            job = self.get_job(job_id)
            if job.quarantine_of(node_id) is not None:
                break
            mark = QuarantinedNode(node_id=node_id, at=self.clock(), reason=reason, by=by)
            marked = replace(job, quarantined=(*job.quarantined, mark))
            try:
                stored = self.table.batch(
                    [BatchOp("replace", _job_entity(marked), if_match=job.etag)]
                )[0]
            except (Modified, NotFound):
                continue
            job = replace(marked, etag=stored.etag if stored is not None and stored.etag else "")
            break
        else:
            raise StorageUnavailable(f"could not quarantine {node_id} in {job_id!r}")
        with contextlib.suppress(UnknownNode):  # one that never joined has no row
            why = f"node {node_id} quarantined" + (f": {reason}" if reason else "")
            self._depart(job, self.node(job_id, node_id), why)
        return self.get_job(job_id)

    def unquarantine_node(self, job_id: str, node_id: str) -> Job:
        """Admits a quarantined node again, its losses forgotten. Idempotent.

        Raises:
            UnknownJob: No such job.
        """
        for _ in range(100):
            job = self.get_job(job_id)
            if job.quarantine_of(node_id) is None and node_id not in job.losses:
                return job
            cleared = replace(
                job,
                quarantined=tuple(q for q in job.quarantined if q.node_id != node_id),
                losses={n: t for n, t in job.losses.items() if n != node_id},
            )
            try:
                self.table.batch([BatchOp("replace", _job_entity(cleared), if_match=job.etag)])
            except (Modified, NotFound):
                continue
            return self.get_job(job_id)
        raise StorageUnavailable(f"could not unquarantine {node_id} in {job_id!r}")

    def _depart(self, job: Job, node: Node, reason: str) -> None:
        job_id, node_id = job.job_id, node.node_id
        partition = member_partition(job_id, node_id, job.spec.max_nodes)
        self.table.upsert(_node_entity(partition, replace(node, state="left")))
        while job.status == "sealed" and node_id in self.sealed(job_id, job.generation).ranks:
            if self.end_generation(job, reason):
                return
            job = self.get_job(job_id)

    # --- inspection ---------------------------------------------------------------------

    def summary(self, job: Job) -> JobSummary:
        return JobSummary(
            job_id=job.job_id,
            spec=job.spec,
            generation=job.generation,
            status=job.status,
            world_size=job.world_size if job.status == "sealed" else 0,
            created_at=job.created_at,
            checkpoint=job.checkpoint,
            durable=job.durable,
            load_failure=job.load_failure,
            quarantined_nodes=list(job.quarantined),
            blocked=self.blocked(job),
            world_sizes=None if (sizes := seal.sizes(job)) is None else list(sizes),
        )

    @staticmethod
    def blocked(job: Job, available: int | None = None) -> str | None:
        """Why the job's open round holds back from sealing: generations in a row made
        no progress (:func:`._health.stall_blocked`), a size keeps failing to load its
        checkpoint (:func:`._seal.load_blocked`), or it wants a world size the job takes
        (:func:`._seal.size_blocked`; ``available``: the live nodes of the round, if
        counted); None when it does not."""
        if job.status != "open":
            return None
        return (
            health.stall_blocked(job.stalls, job.stall_reasons)
            or seal.held_back(job.load_failure)
            or seal.size_blocked(job, available)
        )

    def unblock(self, job_id: str) -> Job:
        """Lets a job that stopped restarting restart again (the operator's): its count
        of generations without progress and its run of load failures are forgotten.
        Idempotent.

        Raises:
            UnknownJob: No such job.
        """
        for _ in range(100):
            job = self.get_job(job_id)
            if not job.stalls and not job.stall_reasons and job.load_failure is None:
                return job
            cleared = replace(job, stalls=0, stall_reasons=(), load_failure=None)
            try:
                self.table.batch([BatchOp("replace", _job_entity(cleared), if_match=job.etag)])
            except (Modified, NotFound):
                continue
            return self.get_job(job_id)
        raise StorageUnavailable(f"could not unblock {job_id!r}")

    # --- hangs --------------------------------------------------------------------------

    def hang_reports(self, job_id: str) -> list[HangReport]:
        """The job's hang reports, oldest first, without their stacks.

        Raises:
            UnknownJob: No such job.
        """
        self.get_job(job_id)
        rows = self.table.query(job_id, [Cond("kind", "eq", "hang")])
        return [_hang_report(e, stacks=False) for e in rows]

    def hang_report(self, job_id: str, generation: int) -> HangReport:
        """The report of the rank ``generation`` ended for, with its stacks.

        Raises:
            UnknownJob, UnknownNode: No such job; no hang ended that generation.
        """
        self.get_job(job_id)
        try:
            return _hang_report(self.table.get(job_id, _hang_key(generation)), stacks=True)
        except NotFound:
            raise UnknownNode(f"no hang ended generation {generation} of job {job_id!r}") from None

    def record_stacks(
        self, job_id: str, generation: int, node_id: str, report: StacksReport
    ) -> HangReport:
        """Keeps a hung rank's stacks (or why there are none) with its hang's report.

        Raises:
            UnknownNode: No hang of ``node_id``'s ``report.rank`` ended ``generation``.
        """
        for _ in range(10):
            try:
                e = self.table.get(job_id, _hang_key(generation))
            except NotFound:
                raise UnknownNode(
                    f"no hang of node {node_id!r} ended generation {generation} of {job_id!r}"
                ) from None
            if e.data.get("node_id") != node_id or _int(e.data, "rank") != report.rank:
                raise UnknownNode(
                    f"generation {generation} of {job_id!r} ended for rank "
                    f"{_int(e.data, 'rank')} on node {e.data.get('node_id')!s}, not rank "
                    f"{report.rank} on {node_id}"
                )
            data = {k: v for k, v in e.data.items() if not str(k).startswith("stacks")}
            text = report.stacks or ""
            chunks = [text[i : i + _STACK_CHUNK] for i in range(0, len(text), _STACK_CHUNK)]
            data.update({f"stacks{i}": chunk for i, chunk in enumerate(chunks)})
            data.update(
                chunks=len(chunks),
                stacks_error=report.error,
                pid=report.pid,
                taken_by=report.taken_by,
            )
            try:
                self.table.replace(Entity(job_id, e.row_key, data), if_match=e.etag or "")
            except Modified:
                continue
            return self.hang_report(job_id, generation)
        raise StorageUnavailable(f"could not keep the stacks of generation {generation}")

    def _trim_hangs(self, job_id: str) -> None:
        """Keeps the newest :data:`HANGS_KEPT` hang reports."""
        keys = [e.row_key for e in self.table.query(job_id, [Cond("kind", "eq", "hang")])]
        for key in sorted(keys)[:-HANGS_KEPT]:
            with contextlib.suppress(NotFound):
                self.table.delete(job_id, key)

    def status(self, job_id: str) -> JobStatus:
        """Everything a person wants to see about a job, as storage has it now
        (``as_of``: the clock its ages count to). Each call reads the job's rows:
        requests answer from :class:`._views.Views`, which calls it about once a second
        for all of them."""
        job = self.get_job(job_id)
        now = self.clock()
        timeout = _seconds(job.spec.heartbeat_timeout)
        heard: dict[str, health.Heard] = {}
        beats = self._beats(job_id, heard=heard)
        nodes = {n.node_id: n for n in self._nodes(job_id)}
        try:
            window = _window(self.table.get(job_id, HEALTH_ROW))
        except NotFound:
            window = health.Window()
        if window.generation != job.generation or job.status != "sealed":
            window = health.Window()
        named = health.stragglers(window)
        slow = {s.node_id for s in named}
        history = [
            self._generation_of(e) for e in self.table.query(job_id, [Cond("kind", "eq", "gen")])
        ]
        members: list[MemberStatus] = []
        current: set[str] = set()
        if job.status == "sealed" and history:
            # Each member's score as its beats show it now (the record keeps only the
            # ranks it watches): a node's lowest rank's. Where no rank is rated now (a
            # save), the watched ranks' last scores.
            ids = [m.node_id for m in history[-1].members]
            lowest: dict[str, float] = {}
            for (node_id, _), score in (
                health.scores(job.generation, ids, heard) or window.scores
            ).items():
                lowest[node_id] = min(score, lowest.get(node_id, score))
            for m in history[-1].members:
                current.add(m.node_id)
                age = now - beats[m.node_id] if m.node_id in beats else None
                node = nodes.get(m.node_id)
                state: Literal["alive", "late", "dead", "left"]
                if node is not None and node.state == "left":
                    state = "left"
                elif age is None or age >= timeout:
                    state = "dead"
                elif age >= timeout / 2:
                    state = "late"
                else:
                    state = "alive"
                said = heard.get(m.node_id)
                members.append(
                    MemberStatus(
                        node_id=m.node_id,
                        rank=m.rank,
                        addr=m.addr,
                        heartbeat_age=age,
                        state=state,
                        progress=list(said.progress)
                        if said is not None and said.generation == job.generation
                        else [],
                        score=lowest.get(m.node_id),
                        straggler=m.node_id in slow,
                    )
                )
        waits = [
            n
            for n in nodes.values()
            if n.state == "waiting" and n.round >= job.round and n.node_id not in current
        ]
        live = [n for n in waits if n.node_id in beats and now - beats[n.node_id] < timeout]
        summary = self.summary(job)
        blocked = summary.blocked or self.blocked(job, len(live))
        waiting = [
            WaitingNode(
                node_id=n.node_id,
                addr=n.addr,
                round=n.round,
                waiting_for=now - n.joined_at,
                heartbeat_age=now - beats[n.node_id] if n.node_id in beats else None,
                standby=seal.parked(job, n.round),
                reason=seal.parked_reason(job, len(current), len(live))
                if seal.parked(job, n.round)
                else blocked
                or f"round {n.round} is open: it seals once min_nodes wait "
                "and last_call has passed",
            )
            for n in waits
        ]
        running = [h for h in heard.values() if h.generation == job.generation]
        learned = self.hang_limit(job_id)
        limit, source = health.hang_limit(
            job.spec, running if job.status == "sealed" else (), learned
        )
        return JobStatus(
            **summary.model_copy(update={"blocked": blocked}).model_dump(),
            members=members,
            waiting=waiting,
            as_of=now,
            health=Health(
                hang_limit=limit,
                hang_limit_source=source,
                phase_limit=_seconds(job.spec.phase_limit),
                stragglers=named,
                # Every generation's row is kept for the job's life, and a hang always
                # ends one: a count that only grows (the reports keep the last 20).
                hangs=sum(timeline.cause(g.ended_reason) == "hung" for g in history),
                stalled=job.stalls,
            ),
            history=[
                GenerationInfo(
                    generation=g.generation,
                    world_size=len(g.members),
                    sealed_at=g.sealed_at,
                    ended_at=g.ended_at,
                    ended_reason=g.ended_reason,
                    checkpoint=g.checkpoint,
                    load_failure=g.load_failure,
                )
                for g in history
            ],
        )
