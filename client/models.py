"""Wire models: the JSON the coordinator and its clients exchange.

Public, as the one definition both sides share: the coordinator (``rallypoint.service``)
validates requests and builds replies with these classes, the client sends and parses
them. Durations travel as seconds (floats) and are :class:`~datetime.timedelta` in Python.
"""

from __future__ import annotations

import itertools
import numbers
import re
import types
from datetime import timedelta
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import unquote

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    model_validator,
)

from rallypoint.times import utc

__all__ = [
    "CREDENTIAL_HEADER",
    "ENVELOPE_PATH",
    "FINISHED",
    "HANG_FACTOR",
    "HANG_FLOOR",
    "ID_JSON_SCHEMA",
    "ID_PATTERN",
    "ID_SCHEMA_PATTERN",
    "MAX_METADATA_BYTES",
    "MAX_METRICS",
    "MAX_NODES_LIMIT",
    "MAX_RANKS",
    "MAX_RANKS_PER_NODE",
    "MAX_SHARD_FILES",
    "MAX_STACKS_BYTES",
    "MAX_STORE_KEYS",
    "MAX_STORE_VALUE_BYTES",
    "MAX_WORLD_SIZES",
    "STALE_STATUS",
    "STRAGGLER_WINDOW",
    "STRAGGLER_WINDOWS",
    "TIMELINE_GENERATIONS",
    "Assignment",
    "BeginCheckpoint",
    "CheckpointBegun",
    "CheckpointInfo",
    "CheckpointPointer",
    "Envelope",
    "ErrorBody",
    "FaultReport",
    "GenerationInfo",
    "HangReport",
    "Health",
    "HeartbeatReply",
    "HeartbeatRequest",
    "Id",
    "JobSpec",
    "JobStatus",
    "JobSummary",
    "JoinReply",
    "JoinRequest",
    "KeepBest",
    "LeaveRequest",
    "LoadFailure",
    "Manifest",
    "ManifestFile",
    "ManifestShard",
    "MemberInfo",
    "MemberStatus",
    "NodeInfo",
    "NodeQuarantineRequest",
    "PeerGrant",
    "PeerKey",
    "Phase",
    "ProcessState",
    "QuarantineRequest",
    "QuarantinedNode",
    "RankProgress",
    "ReportShard",
    "RestoreFailure",
    "RestoreReport",
    "RestoreSource",
    "ShardFile",
    "StacksReport",
    "StoreReply",
    "StoreRequest",
    "Straggler",
    "Timeline",
    "TimelineCause",
    "TimelineGeneration",
    "TimelineVersion",
    "TokenCreated",
    "TokenInfo",
    "TokenRequest",
    "WaitRequest",
    "WaitingNode",
    "WorldSizeReport",
    "check_id",
    "hang_reason",
    "rank_folder",
]

#: Carries a node's credential (from its join) on every request that acts for the node.
CREDENTIAL_HEADER = "X-Rallypoint-Credential"
#: Job and node ids: what is safe in a URL path, a table key and a blob name.
ID_PATTERN = r"[A-Za-z0-9._-]{1,64}"
#: :data:`ID_PATTERN` less "." and "..", anchored and without look-around, as JSON
#: Schema validators and generators (ECMA 262 and Rust regexes) read it; ``check_id``
#: uses it too, so what the OpenAPI document promises is what the check accepts.
ID_SCHEMA_PATTERN = (
    r"^(?:[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}"
    r"|\.[A-Za-z0-9_-][A-Za-z0-9._-]{0,62}"
    r"|\.\.[A-Za-z0-9._-]{1,62})$"
)
#: The JSON Schema of an id (a path parameter's or a field's).
ID_JSON_SCHEMA: dict[str, Any] = {"pattern": ID_SCHEMA_PATTERN, "minLength": 1, "maxLength": 64}
_ID = re.compile(ID_SCHEMA_PATTERN)
#: The largest rendezvous: what the coordinator is measured at (bench/rendezvous.py). A
#: generation whose members outgrow one 1 MiB table entity keeps them in part rows.
MAX_NODES_LIMIT = 10_000
#: A learned hang limit is this many times the slowest rank's 95th percentile step
#: interval (NVRx takes 5 times the largest interval seen; a percentile ignores the
#: odd long step, the factor gives room for the next).
HANG_FACTOR = 10.0
#: ... and at least this many seconds: a job of 0.1 s steps is found hung 3 s after
#: its last one, and no pause a loaded machine makes in a step comes near it.
HANG_FLOOR = 3.0
#: Stragglers are scored over windows of this many seconds ...
STRAGGLER_WINDOW = 5.0
#: ... and a rank under the threshold in this many windows in a row is a straggler.
STRAGGLER_WINDOWS = 3
#: Processes (ranks) one node's heartbeat may carry the progress of.
MAX_RANKS_PER_NODE = 256
#: The most world sizes a job declares or a report names (``JobSpec.world_sizes``).
MAX_WORLD_SIZES = 1024
#: Seconds after which a job's status is an old view: the coordinator answers from a
#: read of storage at most about a second old (``JobStatus.age``) while storage answers.
STALE_STATUS = 5.0


def _json_integer(value: Any) -> Any:
    # JSON Schema's "integer" is any number with no fraction, 4.0 too (a JSON writer
    # may send one so); strict validation then still refuses what the schema refuses
    # (true, "4", 4.5), where lax validation would take true and "4".
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: A world size in nodes.
WorldSize = Annotated[
    # The validator after the bounds: before them, pydantic writes them as "ge" and "le",
    # which JSON Schema does not know.
    int, Field(ge=1, le=MAX_NODES_LIMIT, strict=True), BeforeValidator(_json_integer)
]


def check_id(value: str) -> str:
    """Returns ``value`` if it is a valid job or node id; raises ValueError otherwise."""
    if not _ID.fullmatch(value):
        raise ValueError(f"{value!r} is not an id of 1-64 letters, digits, '.', '_' or '-'")
    return value


Id = Annotated[str, AfterValidator(check_id), WithJsonSchema({"type": "string", **ID_JSON_SCHEMA})]


# The JSON kinds a scalar field takes. Pydantic's lax mode would also take true for 1,
# "3" for 3 and 1 for true, which the OpenAPI document calls invalid (and a client that
# sends them has a bug worth hearing about).
_KINDS: dict[type, str] = {int: "number", float: "number", timedelta: "number", bool: "boolean"}
_FIELD_KINDS: dict[type[BaseModel], dict[str, str]] = {}


def _kind(annotation: Any) -> str | None:
    if get_origin(annotation) is Annotated:  # a member of a union keeps its own schema
        return _kind(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        kinds = {_kind(a) for a in get_args(annotation) if a is not type(None)}
        return kinds.pop() if len(kinds) == 1 else None
    return _KINDS.get(annotation)


def _field_kinds(model: type[BaseModel]) -> dict[str, str]:
    found = _FIELD_KINDS.get(model)
    if found is None:
        found = {
            name: kind for name, f in model.model_fields.items() if (kind := _kind(f.annotation))
        }
        _FIELD_KINDS[model] = found
    return found


def _is_kind(value: Any, kind: str) -> bool:
    if kind == "boolean":
        return isinstance(value, bool)
    if type(value) in (int, float, timedelta):  # what JSON gives: no ABC's isinstance
        return True  # (a bool's type is bool, not int)
    return isinstance(value, (numbers.Real, timedelta)) and not isinstance(value, bool)


def _defaults_in_seconds(schema: dict[str, Any], model: type[BaseModel]) -> None:
    # Pydantic writes a timedelta default in ISO 8601 ("PT10S"), not as it serializes it.
    for name, field in model.model_fields.items():
        if isinstance(field.default, timedelta) and name in schema.get("properties", {}):
            schema["properties"][name]["default"] = field.default.total_seconds()


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        ser_json_timedelta="float",
        frozen=True,
        json_schema_extra=_defaults_in_seconds,
    )

    @model_validator(mode="before")
    @classmethod
    def _json_kinds(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, kind in _field_kinds(cls).items():
                value = data.get(name)
                if value is not None and not _is_kind(value, kind):
                    raise ValueError(f"{name} must be a {kind}, not {type(value).__name__}")
        return data


def _seconds(minimum: float, maximum: float = 86400) -> WithJsonSchema:
    """A duration's schema: seconds on the wire (a timedelta in Python)."""
    schema = {"type": "number", "minimum": minimum, "maximum": maximum, "description": "seconds"}
    return WithJsonSchema(schema)


class JobSpec(_Model):
    """How a job's rendezvous behaves (torchrun's ``--nnodes MIN:MAX`` and timeouts)."""

    min_nodes: int = Field(1, ge=1, le=MAX_NODES_LIMIT)
    max_nodes: int = Field(1, ge=1, le=MAX_NODES_LIMIT)
    #: After ``min_nodes`` joined, how long to wait for more before sealing.
    last_call: Annotated[timedelta, _seconds(0)] = timedelta(seconds=5)
    #: A member silent this long is declared dead and its generation ends.
    heartbeat_timeout: Annotated[timedelta, _seconds(1)] = timedelta(seconds=10)
    #: How long a joiner waits for its generation to seal before giving up.
    join_timeout: Annotated[timedelta, _seconds(0)] = timedelta(seconds=600)
    #: Nodes that park beyond a full generation (``max_nodes`` members): their agents
    #: run, their workers do not start, and none ends the running generation. When a
    #: member is lost, a standby takes its rank in the next generation, so the world
    #: keeps its size and every other member its rank (ZeRO, tensor and pipeline
    #: layouts load without resharding). 0: a node beyond a full generation is refused
    #: with ``job_full`` and retries, as before.
    standbys: int = Field(0, ge=0, le=MAX_NODES_LIMIT)
    #: A rank that makes no progress this long while it trains is hung: its generation
    #: ends and its worker is stopped (its stacks kept first). None (the default): learned
    #: from the job's own steps, :data:`HANG_FACTOR` times the slowest rank's 95th
    #: percentile step interval, at least :data:`HANG_FLOOR`; 0: hangs are not judged.
    hang_limit: Annotated[timedelta, _seconds(0)] | None = None
    #: The bound of the phases that may legitimately go long without a step, each
    #: counted from its start: start-up and the first step (compile), a save or a load
    #: in flight, an evaluation.
    phase_limit: Annotated[timedelta, _seconds(1)] = timedelta(seconds=600)
    #: What happens to a straggler (a rank whose relative score stays under
    #: ``straggler_threshold``): ``report`` names it (status, page, metrics, log);
    #: ``replace`` swaps its node for a standby and quarantines it; ``drop`` leaves its
    #: node out where the job may run without it and is predicted to be faster so.
    straggler: Literal["report", "replace", "drop"] = "report"
    #: The relative score (the fastest rank's own step time over this rank's) under
    #: which a rank counts towards being a straggler.
    straggler_threshold: float = Field(0.75, gt=0, lt=1)
    #: The world sizes, in nodes, the job can take (a global batch that only some worlds
    #: split, a layout of fixed degree), ascending, each from ``min_nodes`` to
    #: ``max_nodes``: a round seals the largest of them its nodes make, and the nodes
    #: beyond it wait as standbys. None: any size from ``min_nodes`` to ``max_nodes``. A
    #: job also learns them from its workers (``report_world_sizes``).
    world_sizes: tuple[WorldSize, ...] | None = Field(
        None, min_length=1, max_length=MAX_WORLD_SIZES
    )

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if self.max_nodes < self.min_nodes:
            raise ValueError(f"max_nodes {self.max_nodes} < min_nodes {self.min_nodes}")
        sizes = self.world_sizes
        if sizes is not None:
            if any(a >= b for a, b in itertools.pairwise(sizes)):
                raise ValueError(f"world_sizes must be ascending, each once: {list(sizes)}")
            if sizes[0] < self.min_nodes or sizes[-1] > self.max_nodes:
                raise ValueError(
                    f"world_sizes must lie from min_nodes {self.min_nodes} to max_nodes "
                    f"{self.max_nodes}: {list(sizes)}"
                )
        for name in ("last_call", "heartbeat_timeout", "join_timeout"):
            value: timedelta = getattr(self, name)
            if not timedelta(0) <= value <= timedelta(days=1):
                raise ValueError(f"{name} must be between 0 s and 1 day")
        if self.heartbeat_timeout < timedelta(seconds=1):
            raise ValueError("heartbeat_timeout must be at least 1 s")
        if self.hang_limit is not None and not timedelta(0) <= self.hang_limit <= timedelta(days=1):
            raise ValueError("hang_limit must be between 0 s and 1 day")
        if not timedelta(seconds=1) <= self.phase_limit <= timedelta(days=1):
            raise ValueError("phase_limit must be between 1 s and 1 day")
        return self


class JoinRequest(_Model):
    node_id: Id
    #: Where other nodes reach this one (host name or IP).
    addr: str = Field(min_length=1, max_length=255)
    #: A free port on ``addr``; rank 0's becomes the master port.
    port: int = Field(29500, ge=1, le=65535)
    #: Creates the job with this spec if it does not exist; must match if it does.
    spec: JobSpec | None = None
    #: Seconds to hold the request open waiting for the seal (long-poll).
    wait: float = Field(30.0, ge=0, le=60)
    #: Makes retries of one join idempotent: a repeated request with the same key is
    #: the same join, where a new key from a running member starts a new generation.
    join_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    #: The base URL of this node's replica server (its agent's memory tier), which
    #: other nodes' ranks copy their checkpoint files to. A new URL per agent start:
    #: the coordinator counts copies only on the agent that received them.
    peer: str | None = Field(None, max_length=512, pattern=r"^https?://[^\s?#]+$")
    #: A hot join: a newcomer to a running generation that has room parks (status
    #: ``standby``) instead of ending it, starts its workers, and ends it only once they
    #: wait to train (a wait with ``ready``), so the members never wait for its process
    #: start. A node that sends it must send ``ready`` (torchrun's ``hot_join=1``).
    warm: bool = False


class WaitRequest(_Model):
    #: The round the node registered for (from the join's reply).
    round: int = Field(ge=1)
    wait: float = Field(30.0, ge=0, le=60)
    #: The node parked for ``round`` by a hot join (``JoinRequest.warm``), and its
    #: workers now wait to train: the running generation ends for it. Changes nothing
    #: for a standby beside a full generation, nor for a node whose round is open.
    ready: bool = False


class CheckpointPointer(_Model):
    """The authoritative latest checkpoint a generation resumes from."""

    version: int
    step: int
    #: The generation that saved it.
    generation: int
    #: Whether every rank's files are in blob storage; else some are only in the
    #: memory of live nodes.
    durable: bool = True


#: Files a rank may write per checkpoint version.
MAX_SHARD_FILES = 64
#: Processes (global ranks) a checkpoint version may have: 16,384 GPUs at 8 per node
#: and room beyond; rank folders are named with 5 digits.
MAX_RANKS = 99_999


def rank_folder(rank: int) -> str:
    """The folder of a version that holds ``rank``'s files, in blob storage and in a
    node's memory tier alike: ``rank-00007``."""
    return f"rank-{rank:05d}"


#: Serialised size of a report's metadata (its non-tensor state), in bytes.
MAX_METADATA_BYTES = 512 * 1024


class BeginCheckpoint(_Model):
    """A rank asks for the version of ``step`` in its generation, and upload URLs."""

    node_id: Id
    generation: int = Field(ge=1)
    step: int = Field(ge=0)
    #: The files this rank will write, relative to its folder in the version.
    files: list[Id] = Field(default=["shard.safetensors"], min_length=1, max_length=MAX_SHARD_FILES)
    #: The caller's global rank (torchrun's ``RANK``): the version's files and reports
    #: are keyed by it. None: the node's rank, for one process per node.
    rank: int | None = Field(None, ge=0, lt=MAX_RANKS)
    #: Processes in the job (torchrun's ``WORLD_SIZE``), the same for every rank of the
    #: version. None: the generation's number of nodes.
    world_size: int | None = Field(None, ge=1, le=MAX_RANKS)
    #: The persistence policy, read when the version is created (by the first rank to
    #: begin it): it is written to blob storage if this is set, or if ``persist_every``
    #: versions passed since the last one that was, or ``persist_after`` seconds.
    persist: bool = False
    persist_every: int = Field(1, ge=1, le=1_000_000)
    persist_after: float | None = Field(None, gt=0, le=7 * 86400)
    #: Whether this rank keeps its files in its node's memory tier and wants a peer
    #: replica: then ``CheckpointBegun.replica`` names the node to copy them to.
    memory: bool = False

    @model_validator(mode="after")
    def _unique(self) -> BeginCheckpoint:
        if len(set(self.files)) != len(self.files):
            raise ValueError("file names must be unique")
        if (self.rank is None) != (self.world_size is None):
            raise ValueError("rank and world_size go together")
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        return self


class PeerGrant(_Model):
    """A coordinator-signed permission to write or read one version's files on one
    node's replica server: ``{url}/v/{version}/{path}?token={token}``."""

    node_id: str
    url: str
    token: str
    expires_at: float


class PeerKey(_Model):
    """The key replica servers check the coordinator's grants with (Ed25519, raw,
    base64url)."""

    public_key: str


class CheckpointBegun(_Model):
    """Where a rank writes its shard of a version (every rank of a generation asking
    for the same step gets the same version)."""

    version: int
    step: int
    generation: int
    rank: int
    world_size: int
    state: Literal["pending", "committed"]
    #: File name to a write URL that reaches only that object (empty unless pending).
    upload_urls: dict[str, str]
    #: When an unfinished version is collected (epoch seconds).
    expires_at: float
    #: Seconds the upload URLs are valid from this reply (minutes; never past
    #: ``expires_at``): beginning the same step again renews them. They stop working
    #: once the version commits or is collected. None without URLs.
    upload_ttl: float | None = Field(None, gt=0)
    #: Whether the version goes to blob storage; else its files stay in memory on two
    #: nodes (the writer's and its peer's) unless a copy to the peer fails.
    persist: bool = True
    #: The node this rank copies its files to (the next member of the generation), if
    #: it asked for one and the generation has another node with a replica server.
    replica: PeerGrant | None = None
    #: The standby this rank also copies its files to (``JobSpec.standbys``): the one
    #: that would take its node's slot, so the node that replaces this one restores
    #: from its own memory.
    standby: PeerGrant | None = None


class ShardFile(_Model):
    name: Id
    size: int = Field(ge=0)
    #: ``xxh3-128:<hex>`` of the object's bytes, checked when it is loaded.
    checksum: str = Field(min_length=1, max_length=160)


#: Metrics one version may carry.
MAX_METRICS = 32
#: A metric's name: what the frameworks log (``eval_loss``, ``val/acc``, ``epoch``).
MetricName = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_./:@-]+$")]
#: A metric's value: finite (a NaN loss makes a version no candidate for best; the
#: trainer leaves it out).
MetricValue = Annotated[float, Field(allow_inf_nan=False)]
_METRIC_PATTERN = r"^[A-Za-z0-9_./:@-]+$"
#: The JSON schema says what the validator does: pydantic's own would put the name
#: pattern in ``patternProperties``, which lets any other name through with any value.
Metrics = Annotated[
    dict[MetricName, MetricValue],
    Field(max_length=MAX_METRICS),
    WithJsonSchema(
        {
            "type": "object",
            "maxProperties": MAX_METRICS,
            "propertyNames": {"pattern": _METRIC_PATTERN, "minLength": 1, "maxLength": 100},
            "additionalProperties": {"type": "number"},
        }
    ),
]


class KeepBest(_Model):
    """Which versions a job keeps for a metric, whatever the retention of the newest:
    the ``count`` best good versions by ``metric``; the first of them is the job's
    ``best`` (ties go to the older version: the first to reach the value)."""

    metric: MetricName
    #: ``min`` (a loss) or ``max`` (an accuracy).
    mode: Literal["min", "max"] = "min"
    #: How many of the best to keep (Lightning's ``save_top_k``).
    count: int = Field(1, ge=1, le=100)


class ReportShard(_Model):
    """A rank's files of a version, reported after they were uploaded."""

    node_id: Id
    generation: int = Field(ge=1)
    files: list[ShardFile] = Field(min_length=1, max_length=MAX_SHARD_FILES)
    #: The global rank the files belong to, as given to ``begin``; None: the node's rank.
    rank: int | None = Field(None, ge=0, lt=MAX_RANKS)
    #: Rank 0's becomes the version's metadata (state replicated on every rank).
    metadata: dict[str, Any] | None = None
    #: This rank's own metadata (its rank-specific state).
    rank_metadata: dict[str, Any] | None = None
    #: Rank 0's become the version's metrics (an evaluation's ``eval_loss``).
    metrics: Metrics | None = None
    #: Rank 0's: the rule the job keeps its best versions by, from this version on.
    keep_best: KeepBest | None = None
    #: Rank 0's: how many of its newest good versions the job keeps from this version
    #: on (an HF Trainer's ``save_total_limit``); None: the coordinator's setting.
    keep_last: int | None = Field(None, ge=1, le=1000)
    #: Whether the files were uploaded to blob storage.
    storage: bool = True
    #: The nodes whose memory tier holds the files: the reporter's own and its
    #: replica's. A version commits once every rank's files are in storage or on two
    #: nodes (on one, in a one-node job).
    memory: list[Id] = Field(default_factory=list, max_length=8)

    @model_validator(mode="after")
    def _unique(self) -> ReportShard:
        if len({f.name for f in self.files}) != len(self.files):
            raise ValueError("file names must be unique")
        if len(set(self.memory)) != len(self.memory):
            raise ValueError("memory must name each node once")
        if not self.storage and not self.memory:
            raise ValueError("files must be in storage or in some node's memory")
        return self


class CheckpointInfo(_Model):
    """One version; ``urls`` (read URLs by name relative to the version's folder,
    ``manifest.json`` among them) only where asked for and committed."""

    version: int
    step: int
    generation: int
    world_size: int
    state: Literal["pending", "committed"]
    created_at: float
    committed_at: float | None = None
    #: Ranks that reported their files so far.
    reported: int = 0
    #: Whether this is the job's authoritative latest.
    latest: bool = False
    #: Whether this is the job's newest durable version: what it falls back to when the
    #: memory copies of newer ones are lost.
    latest_durable: bool = False
    #: Whether every rank's files are in blob storage (``"durable"``), else
    #: ``"memory"``: some ranks' files are only in nodes' memory tiers.
    durability: Literal["pending", "memory", "durable"] = "durable"
    #: Whether an operator quarantined it: no generation resumes from it and it is
    #: never the latest until unquarantined; when, and why.
    quarantined: bool = False
    quarantined_at: float | None = None
    quarantine_reason: str | None = None
    #: Whether a rank could not load it when it was named (a holder gone, a file
    #: missing or failing its checksum): no generation resumes from it again; when, and
    #: which rank said why.
    unrecoverable: bool = False
    unrecoverable_at: float | None = None
    unrecoverable_reason: str | None = None
    #: What the version's rank 0 reported with it (an evaluation's ``eval_loss``).
    metrics: dict[str, float] = Field(default_factory=dict)
    #: Its place among the job's best versions by the job's ``keep_best`` rule (1: the
    #: job's ``best``), if it is one of the ``count`` kept; None otherwise. Set in the
    #: list of versions and in ``…/best``; not in ``…/latest`` or ``…/{v}`` (every rank
    #: reads its version there at a restore).
    best_place: int | None = None
    urls: dict[str, str] = Field(default_factory=dict)
    #: Global rank (as a string) to the live nodes whose memory holds its files; with
    #: ``urls``, for a committed version.
    holders: dict[str, list[str]] = Field(default_factory=dict)
    #: Read grants on those nodes' replica servers, by node id.
    peers: dict[str, PeerGrant] = Field(default_factory=dict)
    #: The global ranks whose files are in blob storage; with ``urls``.
    in_storage: list[int] = Field(default_factory=list)

    def marks(self) -> list[str]:
        """Why no generation resumes from it, as people read it: an operator's
        quarantine and a rank's finding that it cannot be loaded, each with when (UTC)
        and why; empty if neither. The CLI's ``versions`` and the status page show them.
        """
        marks = []
        if self.quarantined:
            why = f": {self.quarantine_reason}" if self.quarantine_reason else ""
            marks.append(f"quarantined {utc(self.quarantined_at)}{why}")
        if self.unrecoverable:
            since = utc(self.unrecoverable_at)
            marks.append(f"unrecoverable since {since}: {self.unrecoverable_reason}")
        return marks


class QuarantineRequest(_Model):
    """``PUT …/checkpoints/{v}/quarantine``: mark a committed version bad."""

    #: Why, shown beside the version.
    reason: str = Field("", max_length=500)
    #: End the running generation now, so every member regroups and loads the version
    #: the pointer moved back to (else the next generation does).
    restart: bool = False


#: Where a restore read bytes from: this node's memory tier, another node's (a peer
#: replica), or blob storage.
RestoreSource = Literal["memory", "peer", "storage"]


class RestoreReport(_Model):
    """What one rank's restore of a version read, by source (for the metrics)."""

    node_id: Id
    #: The generation the rank restores in (fenced: it must be running).
    generation: int = Field(ge=1)
    #: The restoring process's global rank (in today's world, which may differ from
    #: the version's).
    rank: int = Field(ge=0, lt=MAX_RANKS)
    bytes_from: dict[RestoreSource, Annotated[int, Field(ge=0, le=2**63 - 1)]]


#: The longest reason a rank gives for a version it could not load (more is cut).
MAX_FAILURE_REASON = 1000


class RestoreFailure(_Model):
    """A rank of the running generation could not load a version: the coordinator marks
    it unrecoverable and ends the generation."""

    node_id: Id
    #: The generation the rank restores in (fenced: it must be running).
    generation: int = Field(ge=1)
    #: The restoring process's global rank.
    rank: int = Field(ge=0, lt=MAX_RANKS)
    #: What failed (the error's message).
    reason: str = Field(min_length=1, max_length=MAX_FAILURE_REASON)


class ManifestFile(_Model):
    name: str
    size: int
    checksum: str


class ManifestShard(_Model):
    rank: int
    node_id: str
    files: list[ManifestFile]
    metadata: dict[str, Any] | None = None


class Manifest(_Model):
    """``manifest.json`` of a committed version, written before the pointer moves."""

    #: ``/2``: the files of ``torch.distributed.checkpoint``, its metadata in rank 0's
    #: ``dcp.metadata``; ``/1`` (releases before 0.2): one safetensors shard per node.
    format: Literal["rallypoint.checkpoint/1", "rallypoint.checkpoint/2"] = (
        "rallypoint.checkpoint/2"
    )
    job_id: str
    version: int
    step: int
    generation: int
    world_size: int
    created_at: float
    metadata: dict[str, Any] | None = None
    #: What rank 0 reported with the version (see :attr:`ReportShard.metrics`).
    metrics: dict[str, float] | None = None
    shards: list[ManifestShard]


class MemberInfo(_Model):
    node_id: str
    rank: int
    addr: str
    port: int
    #: The node's replica server, if its agent runs one.
    peer: str | None = None


class Assignment(_Model):
    """What a node needs to start training in a sealed generation: the same few hundred
    bytes whatever the number of members (the member list is a route of its own, for
    whoever wants it: ``ElasticClient.members()``)."""

    job_id: str
    node_id: str
    generation: int
    rank: int
    #: The generation's number of nodes.
    world_size: int
    master_addr: str
    master_port: int
    checkpoint: CheckpointPointer | None = None
    #: ``sha256:<hex>`` of the generation's member list as
    #: ``GET /v1/jobs/{job}/generations/{g}/members`` serves it (also its ETag).
    members_digest: str = ""


class JoinReply(_Model):
    """``sealed`` carries the assignment; ``waiting`` means poll again for ``round``;
    ``standby``: the node is parked beyond a full generation (``JobSpec.standbys``) and
    polls again, with no join timeout, until a member is lost and it takes its rank."""

    status: Literal["sealed", "waiting", "standby"]
    round: int
    assignment: Assignment | None = None
    #: The credential of this registration of the node (in the reply to ``join``):
    #: every request that acts for the node sends it in ``X-Rallypoint-Credential``.
    credential: str | None = None


#: What a process does, for the hang rule: ``train`` is bounded by the job's hang limit;
#: ``start`` (start-up until its first step of the generation, the first step's compile
#: included), ``save``, ``load`` and ``eval`` by its ``phase_limit``.
Phase = Literal["start", "train", "save", "load", "eval"]
#: A process's state as its node's kernel says (``/proc``), for the hang rule.
ProcessState = Literal["running", "sleeping", "blocked", "stopped"]


class _StrictModel(BaseModel):
    """A model whose JSON kinds pydantic's core checks (strict mode), where :class:`_Model`
    checks them in Python: what one refuses the other does (true for 1, "3" for 3, 1 for
    true), and an integer field takes 4.0 as 4 (:func:`_json_integer`). For the models
    that every heartbeat carries by the hundred: a beat of 8 ranks' progress took 42 us
    to read with the Python check (which builds each object's dict first) and 15 us
    without it, more than the rest of the beat's handling."""

    model_config = ConfigDict(extra="forbid", ser_json_timedelta="float", frozen=True, strict=True)


class RankProgress(_StrictModel):
    """One process's progress, as its node's heartbeat carries it: O(1) bytes."""

    #: Its global rank.
    rank: Annotated[int, Field(ge=0, le=MAX_RANKS), BeforeValidator(_json_integer)]
    #: The training step it reached (the optimizer's steps).
    step: Annotated[int, Field(ge=0, le=2**53), BeforeValidator(_json_integer)]
    phase: Phase = "train"
    #: Seconds since it last showed progress when the beat left: its last step, or its
    #: entry into ``phase``, whichever came later (measured on its node).
    idle: float = Field(ge=0, le=1e9)
    #: The 95th percentile of the seconds between its recent steps (None: too few yet).
    interval: float | None = Field(None, ge=0, le=1e9)
    #: The mean of its steps' own time over the last straggler window: each step less
    #: the time it waited for its peers (their gradients, the trainer's own collectives;
    #: None where that cannot be told apart). A throttled rank's mean grows with the
    #: steps its pauses fall in, where a median could miss them.
    own: float | None = Field(None, ge=0, le=1e9)
    #: Whether it waits for its peers: its gradients are ready for their all-reduce, or
    #: it is in one of the trainer's own collectives. A hang's peers wait; it does not.
    waiting: bool = False
    #: Its process's state as its node's kernel says (``/proc``): ``stopped`` (by a
    #: signal or a tracer), ``blocked`` (in an uninterruptible kernel call: a driver, a
    #: disk), ``running`` or ``sleeping``; None where unknown.
    process: ProcessState | None = None
    #: Of ``idle``, the seconds its process was ready to run but waited for a CPU, as its
    #: node's kernel counts them (a machine whose CPUs other work keeps busy): slow, not
    #: stuck. The hang rule does not count them. None where unknown.
    starved: float | None = Field(None, ge=0, le=1e9)


class HeartbeatRequest(_Model):
    #: The generation the node runs in (None while it waits to join).
    generation: int | None = Field(None, ge=1)
    #: Seconds the coordinator may hold the reply while the generation runs, answering
    #: ``restart`` the moment it ends (a watch); 0 answers at once.
    wait: float = Field(0.0, ge=0, le=30)
    #: The progress of the node's processes (None: it reports none).
    progress: list[RankProgress] | None = Field(None, max_length=MAX_RANKS_PER_NODE)


class HeartbeatReply(_Model):
    """A heartbeat's answer. Unlike the other models it ignores fields it does not know:
    every member reads one every second, and an agent older than its coordinator must
    not lose its job's heartbeats to a field added since (the coordinator leaves out
    ``reason`` where it has none, so such an agent reads the same bytes as before)."""

    model_config = ConfigDict({**_Model.model_config, "extra": "ignore"})

    #: ``restart``: the generation ended (a member died or left, or a node wants in);
    #: stop, re-join and resume from the checkpoint.
    action: Literal["continue", "restart"]
    #: The job's latest generation.
    generation: int
    #: Why the node's generation ended, on a ``restart`` when the coordinator knows
    #: (``node n2 lost``, ``node n4 joined``): what the agent's one line says.
    reason: str | None = None
    #: The job's hang limit for training steps now (seconds; absent while it is not
    #: known): a node whose process passes it beats at once rather than at its interval.
    hang_limit: float | None = None
    #: On a ``restart`` for a hang of this node: the hung processes' ranks, whose stacks
    #: its agent takes before it stops them.
    hung: tuple[int, ...] | None = None


class FaultReport(_Model):
    """A member's worker saw a collective with its peers fail while ``generation`` ran,
    before the generation was known to have ended (a peer's process gone, or a bug)."""

    generation: int = Field(ge=1)
    #: What failed: the error's first line (the coordinator logs it).
    detail: str = Field("", max_length=500)


class WorldSizeReport(_Model):
    """A member's worker found that its generation's world cannot train the job (its
    global batch does not split: ``WorldSizeError``), and names the world sizes, in
    nodes, that can. The coordinator keeps them as the sizes the job takes and ends the
    generation."""

    generation: int = Field(ge=1)
    #: The node counts that can (the valid rank counts over the processes per node),
    #: ascending; the coordinator keeps those from ``min_nodes`` to ``max_nodes``.
    world_sizes: list[WorldSize] = Field(max_length=MAX_WORLD_SIZES)
    #: The reporting process's global rank.
    rank: int = Field(0, ge=0, lt=MAX_RANKS)
    #: What failed: the error's first line is kept, for the generation's end reason.
    reason: str = Field("", max_length=MAX_FAILURE_REASON)

    @model_validator(mode="after")
    def _ascending(self) -> WorldSizeReport:
        sizes = self.world_sizes
        if any(a >= b for a, b in itertools.pairwise(sizes)):
            raise ValueError(f"world_sizes must be ascending, each once: {sizes}")
        return self


class LeaveRequest(_Model):
    generation: int | None = Field(None, ge=1)
    #: Why: free text, but :data:`FINISHED` says the node's workers finished training
    #: (the job's standbys are released), and ``preempted ...`` a preemption.
    reason: str = Field("left", max_length=200)


#: The leave reason of a node whose workers finished training: the generation it ends
#: releases the standbys parked beside it (``standby_released``) rather than sealing
#: them into a run of their own.
FINISHED = "finished"


#: The one route that carries every other ``/v1`` operation (see :class:`Envelope`).
ENVELOPE_PATH = "/v1/envelope"
# Printable ASCII without spaces or fragments; what a route makes of it is the route's.
_ENVELOPED = re.compile(r"/v1/[!-~]+")


def _check_enveloped(path: str) -> str:
    route = unquote(path.partition("?")[0])
    if not _ENVELOPED.fullmatch(path) or "#" in path or route.rstrip("/") == ENVELOPE_PATH:
        raise ValueError(f"{path!r} is not a /v1 operation's path")
    if any(part in (".", "..") for part in route.split("/")):
        raise ValueError(f"{path!r} has a '.' or '..' segment")
    return path


class Envelope(_Model):
    """One ``/v1`` operation, posted to :data:`ENVELOPE_PATH`.

    For gateways that route a single path to the coordinator (an AzureML managed online
    endpoint routes only its scoring path): the coordinator runs the named operation as
    if it had been called directly (same auth, limits and answers) and returns its reply,
    status code included.
    """

    method: Literal["GET", "PUT", "POST", "DELETE"]
    path: Annotated[str, AfterValidator(_check_enveloped)] = Field(
        max_length=1024, json_schema_extra={"pattern": f"^{_ENVELOPED.pattern}$"}
    )
    body: Any = None


class ErrorBody(_Model):
    code: str
    message: str
    detail: Any = None


class WaitingNode(_Model):
    node_id: str
    addr: str
    round: int
    waiting_for: float
    heartbeat_age: float | None
    #: Parked beyond the running generation, ready to take a lost member's rank
    #: (``JobSpec.standbys``), or waiting for a world size the job takes; False for a
    #: node that waits for an open round.
    standby: bool = False
    #: Why it waits, in words (e.g. ``standby: 2 members and 1 waiting make no world
    #: size the job takes (2, 4)``).
    reason: str | None = None


class LoadFailure(_Model):
    """A generation that ended because a rank could not load the version it was named
    (a ZeRO partition count that does not match, a model that does not fit, an error in
    the user's load code), or, on a job, the latest run of such generations."""

    #: The version that failed to load.
    version: int
    #: The world size (nodes) it failed at.
    world_size: int
    #: The first reporting rank, and its error's first line.
    rank: int
    reason: str
    #: On a job: how many generations in a row failed to load this version at this size.
    count: int = 1


class _Generation(_Model):
    """What a job's status and its timeline both tell of a generation: its size, when it
    was sealed, and when and why it ended (None while it runs)."""

    generation: int
    world_size: int
    sealed_at: float
    ended_at: float | None = None
    ended_reason: str | None = None


class GenerationInfo(_Generation):
    checkpoint: CheckpointPointer | None = None
    #: Set when the generation ended because a rank could not load its checkpoint.
    load_failure: LoadFailure | None = None


class MemberStatus(_Model):
    node_id: str
    rank: int
    addr: str
    heartbeat_age: float | None
    state: Literal["alive", "late", "dead", "left"]
    #: Its processes' progress, as its last heartbeat carried it (empty: none reported).
    progress: list[RankProgress] = Field(default_factory=list)
    #: The lowest relative score of its processes in the last straggler window (the
    #: fastest rank's own step time over its own; None: not scored).
    score: float | None = None
    #: Whether one of its processes is a straggler now.
    straggler: bool = False

    def shown(self) -> tuple[str, str, str]:
        """Its processes' progress as people read it: the step (``120``, or ``118-120``
        where they differ), what they do (``train``, or ``save/train``), and the longest
        time one of them showed no progress (``0.4s``); ``-`` for each while it reports
        none. The CLI's status and the status page show them."""
        if not self.progress:
            return "-", "-", "-"
        steps = sorted({p.step for p in self.progress})
        step = str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
        phases = "/".join(sorted({p.phase for p in self.progress}))
        return step, phases, f"{max(p.idle for p in self.progress):.1f}s"


class Straggler(_Model):
    """A rank whose relative score stayed under the job's threshold."""

    node_id: str
    rank: int
    #: Its score in the last window, and the windows in a row it was under.
    score: float
    windows: int
    #: When it was first named (epoch seconds).
    since: float


class Health(_Model):
    """What the coordinator judges of a running generation beyond liveness."""

    #: The hang limit for training steps now (seconds), and where it came from:
    #: ``set`` (``JobSpec.hang_limit``), ``learned`` (the job's step times), ``floor``
    #: (learned, under :data:`HANG_FLOOR`), ``off``, or ``warming`` (no rank has steps
    #: enough yet: only ``phase_limit`` applies).
    hang_limit: float | None = None
    hang_limit_source: Literal["set", "learned", "floor", "off", "warming"] = "warming"
    phase_limit: float
    #: The current stragglers.
    stragglers: list[Straggler] = Field(default_factory=list)
    #: The hangs found in the job so far: the generations a hang ended (its reports,
    #: ``GET /v1/jobs/{job}/hangs``, keep the last 20).
    hangs: int = 0
    #: Generations in a row that ended without progress (no new version, no step past
    #: the best before), and their reasons.
    stalled: int = 0

    def limit(self) -> str:
        """The hang limit as people read it: ``3.0s (floor)``, ``12.5s (learned)``,
        ``5.0s (set)``, ``off``, or ``not yet (warming)`` while no rank has steps enough
        for one. The CLI's status and the status page show it."""
        if self.hang_limit_source == "off":
            return "off"
        if self.hang_limit is None:
            return "not yet (warming)"
        return f"{self.hang_limit:.1f}s ({self.hang_limit_source})"


class QuarantinedNode(_Model):
    """A node the job never admits again until an operator clears it."""

    node_id: str
    #: When (epoch seconds), and why.
    at: float
    reason: str
    #: ``operator`` (``PUT …/nodes/{node}/quarantine``); ``losses``: the node was lost
    #: the coordinator's ``node_losses`` times within its window; ``hangs``: it hung
    #: twice within the coordinator's ``hang_window``; ``straggler``: the job's
    #: ``straggler`` policy replaced or dropped it.
    by: Literal["operator", "losses", "hangs", "straggler"]


class NodeQuarantineRequest(_Model):
    """``PUT /v1/jobs/{job}/nodes/{node}/quarantine``: keep a node out of the job."""

    #: Why, shown beside the node.
    reason: str = Field("", max_length=500)


class JobSummary(_Model):
    job_id: str
    spec: JobSpec
    generation: int
    status: Literal["open", "sealed"]
    world_size: int
    created_at: float
    #: The authoritative latest checkpoint.
    checkpoint: CheckpointPointer | None = None
    #: The newest checkpoint whose every file is in blob storage (the latest, if it is).
    durable: CheckpointPointer | None = None
    #: The generations just before now that failed to load their checkpoint, in a row.
    load_failure: LoadFailure | None = None
    #: Why the open round does not seal with the nodes it has (None: nothing holds it
    #: but the rules of ``min_nodes`` and ``last_call``), e.g. ``waiting: v2 failed to
    #: load twice at world 2 ...``.
    blocked: str | None = None
    #: The world sizes, in nodes, the job takes now: those its spec declares and its
    #: workers reported (``WorldSizeReport``), from ``min_nodes`` to ``max_nodes``. None:
    #: any.
    world_sizes: list[int] | None = None
    #: Nodes the job does not admit (their joins are refused with ``node_quarantined``).
    quarantined_nodes: list[QuarantinedNode] = Field(default_factory=list)


class JobStatus(JobSummary):
    members: list[MemberStatus]
    waiting: list[WaitingNode]
    history: list[GenerationInfo]
    #: Progress, hangs and stragglers (None from coordinators before it).
    health: Health | None = None
    #: The coordinator's clock (epoch seconds) when this view of the job was read from
    #: storage. A coordinator reads a viewed job's status about once a second, whatever
    #: the number of viewers, and answers from that read; ``heartbeat_age`` and
    #: ``waiting_for`` count to the answer, ``state`` is as judged at ``as_of``. None from
    #: coordinators before it.
    as_of: float | None = None
    #: Seconds between ``as_of`` and the answer: about a second at most while the
    #: coordinator reads storage, more while storage does not answer it (it then answers
    #: with the last view it read; see :data:`STALE_STATUS`). None from coordinators
    #: before it.
    age: float | None = None

    def stale(self) -> bool:
        """Whether this view is older than :data:`STALE_STATUS`: the coordinator could
        not read storage since (the CLI and the status page say so)."""
        return self.age is not None and self.age >= STALE_STATUS


def hang_reason(rank: int, node_id: str, phase: str, step: int, idle: float, limit: float) -> str:
    """How a generation that a hung rank ended reads (``rank 1 on node b hung: no
    progress for 3.1 s in train at step 62 (limit 3.0 s)``): the coordinator records it,
    and a :class:`HangReport` says it again."""
    return (
        f"rank {rank} on node {node_id} hung: no progress for "
        f"{idle:.1f} s in {phase} at step {step} (limit {limit:.1f} s)"
    )


class HangReport(_Model):
    """A rank found hung: its generation ended for it. ``stacks`` are its process's
    threads' stacks as its agent took them before stopping it (None until it sent
    them, or if it could not: ``stacks_error`` says why)."""

    generation: int
    node_id: str
    rank: int
    #: What the rank did (its phase), its step, how long it showed no progress, the
    #: limit it passed, and when it was found (epoch seconds).
    phase: Phase
    step: int
    idle: float
    limit: float
    at: float
    stacks: str | None = None
    stacks_error: str | None = None
    #: The process the stacks are of, and the tool that took them.
    pid: int | None = None
    taken_by: str | None = None

    @property
    def reason(self) -> str:
        """Why its generation ended, as the coordinator recorded it (``rank 1 on node b
        hung: no progress for 3.1 s in train at step 62 (limit 3.0 s)``)."""
        return hang_reason(self.rank, self.node_id, self.phase, self.step, self.idle, self.limit)

    def stacks_state(self) -> str:
        """What became of its stacks, in words: ``py-spy 0.4.1`` (the tool that took
        them; ``(not suspended)`` if read while the process ran on), ``none: why`` where
        the process could not give them, ``not sent yet`` before its node's agent sent
        them (it does once it stopped the process; a node that went down with it never
        does). The list of a job's hangs carries no stacks, but says this."""
        if self.taken_by is not None:
            return self.taken_by
        if self.stacks_error is not None:
            return f"none: {self.stacks_error}"
        return "not sent yet"


#: The most characters of stacks a hang report keeps (a few dozen threads' worth of
#: py-spy's lines; an agent sends the first this many and logs them all). Even at 12
#: bytes a character (JSON's escapes of one outside the BMP, as Python's ``json`` and the
#: Azure SDK write it), a report of them fits its route's 1 MiB body limit, and the
#: hang's table row Azure's (and Azurite's) 1 MiB entity, with the rest of the report.
MAX_STACKS_BYTES = 80 * 1024


class StacksReport(_Model):
    """A hung rank's stacks, sent by its node's agent (with the node's credential)."""

    rank: int = Field(ge=0, le=MAX_RANKS)
    pid: int | None = Field(None, ge=1)
    stacks: str | None = Field(None, max_length=MAX_STACKS_BYTES)
    #: Why there are none (the process could not give them).
    error: str | None = Field(None, max_length=1000)
    #: The tool that took them (``py-spy 0.4.1``, ``faulthandler``).
    taken_by: str | None = Field(None, max_length=100)


#: What ended a generation, in one word, read from its ``ended_reason``: a member
#: ``lost`` (its heartbeat connection dropped, or it missed heartbeats), ``preempted``
#: (it left on a preemption notice), ``left`` (any other departure), ``removed`` (by
#: the operator), a node ``joined`` (the job grows), a member ``rejoined`` (its process
#: restarted: a worker failure), a checkpoint ``quarantined`` (with ``restart``) or
#: found ``unrecoverable``, a rank that read its checkpoint but ``load_failed``, a
#: world the job cannot take (``world_size``: its global batch does not split);
#: ``other`` for a reason none of these describes.
TimelineCause = Literal[
    "lost",
    "hung",
    "straggler",
    "preempted",
    "left",
    "removed",
    "joined",
    "rejoined",
    "quarantined",
    "unrecoverable",
    "load_failed",
    "world_size",
    "other",
]


#: The generations a timeline holds at most: the job's latest ones.
TIMELINE_GENERATIONS = 200


class TimelineGeneration(_Generation):
    """One generation on a job's timeline."""

    #: ``ended_reason`` in one word (None while it runs).
    cause: TimelineCause | None = None
    #: The version it resumed from (None: from scratch).
    checkpoint: CheckpointPointer | None = None


class TimelineVersion(_Model):
    """One checkpoint version on a job's timeline: a kept one, or one already collected
    (its files deleted; the coordinator remembers the last few hundred)."""

    version: int
    step: int
    generation: int
    created_at: float
    committed_at: float | None = None
    #: ``durable``: every rank's files in blob storage; ``memory``: some only in nodes'
    #: memory tiers; ``pending``: not committed (yet).
    durability: Literal["pending", "memory", "durable"]
    quarantined: bool = False
    quarantined_at: float | None = None
    unrecoverable: bool = False
    unrecoverable_at: float | None = None
    #: The job's authoritative latest, and its newest durable version.
    latest: bool = False
    latest_durable: bool = False
    #: Whether its files were deleted (it fell out of the versions kept); when.
    collected: bool = False
    collected_at: float | None = None


class Timeline(_Model):
    """A job's history for a timeline: its generations and checkpoint versions, oldest
    first, and the coordinator's clock when it was read.

    Bounded: the last :data:`TIMELINE_GENERATIONS` generations, the versions kept and
    the last few hundred collected ones.
    """

    job_id: str
    spec: JobSpec
    created_at: float
    #: The coordinator's clock when it was read (the timeline's right edge).
    now: float
    generation: int
    status: Literal["open", "sealed"]
    world_size: int
    #: The authoritative latest checkpoint, and the newest durable one.
    checkpoint: CheckpointPointer | None = None
    durable: CheckpointPointer | None = None
    generations: list[TimelineGeneration]
    versions: list[TimelineVersion]


class NodeInfo(_Model):
    """A node's registration: ``left`` once it left the job (it is not to re-join)."""

    node_id: str
    addr: str
    round: int
    state: Literal["waiting", "left"]


#: Keys per store request, and the size of one value (a table property holds 64 KiB).
MAX_STORE_KEYS = 256
MAX_STORE_VALUE_BYTES = 48 * 1024
_StoreKey = Annotated[str, Field(min_length=1, max_length=512)]
#: Base64 of a value of at most MAX_STORE_VALUE_BYTES bytes. The pattern is the
#: schema's; the store route checks it (400 ``invalid_request``, "must be base64").
_StoreValue = Annotated[
    str,
    Field(
        max_length=-(-MAX_STORE_VALUE_BYTES // 3) * 4,
        json_schema_extra={
            "pattern": r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
        },
    ),
]


class StoreRequest(_Model):
    """One operation on a generation's key-value store (torch's ``Store`` methods).

    Values travel base64-encoded. ``get`` and ``wait`` hold the request open for up to
    ``wait`` seconds until every key exists.
    """

    op: Literal["set", "get", "add", "compare_set", "check", "delete", "num_keys"]
    keys: list[_StoreKey] = Field(default_factory=list, max_length=MAX_STORE_KEYS)
    #: ``set``: one per key.
    values: list[_StoreValue] | None = Field(None, max_length=MAX_STORE_KEYS)
    #: ``add``: the increment (torch's stores count in 64 bits, and so does this one).
    amount: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    #: ``compare_set``: the value expected now ("" for "absent") and the one to set.
    expected: _StoreValue | None = None
    desired: _StoreValue | None = None
    wait: float = Field(0.0, ge=0, le=30)
    #: The node the request acts for (with its credential): a member of the generation.
    node_id: Id | None = None

    @model_validator(mode="after")
    def _consistent(self) -> StoreRequest:
        single = self.op in ("add", "compare_set", "delete")
        if single and len(self.keys) != 1:
            raise ValueError(f"{self.op} takes exactly one key")
        if self.op not in ("num_keys",) and not self.keys:
            raise ValueError(f"{self.op} needs keys")
        if self.op == "set" and (self.values is None or len(self.values) != len(self.keys)):
            raise ValueError("set needs one value per key")
        if self.op == "add" and self.amount is None:
            raise ValueError("add needs an amount")
        if self.op == "compare_set" and (self.expected is None or self.desired is None):
            raise ValueError("compare_set needs expected and desired")
        return self


class StoreReply(_Model):
    #: ``get``: one per key, None for a key still missing when the wait ended.
    values: list[str | None] | None = None
    #: ``add``: the new count; ``num_keys``: the number of keys.
    count: int | None = None
    #: ``compare_set``: the value now stored.
    value: str | None = None
    #: ``check``: whether every key exists; ``delete``: whether the key existed.
    found: bool | None = None


#: What a job-scoped token lets its holder do: ``trainer`` joins the job and acts for
#: its nodes (and reads it); ``reader`` reads it (GET routes, status page, CLI views).
TokenRole = Literal["trainer", "reader"]


class TokenRequest(_Model):
    """Asks the coordinator (with its admin token) for a job-scoped token."""

    job_id: Id
    role: TokenRole
    #: Seconds until it expires; None: until revoked.
    expires_in: float | None = Field(None, gt=0, le=366 * 86400)
    #: A label for people (who or what it is for).
    name: str | None = Field(None, max_length=100)


class TokenInfo(_Model):
    """A scoped token's record (never the token itself)."""

    token_id: str
    job_id: str
    role: TokenRole
    name: str | None = None
    created_at: float
    expires_at: float | None = None
    revoked_at: float | None = None


class TokenCreated(TokenInfo):
    """A new token: ``token`` is shown this once (the coordinator keeps its hash)."""

    token: str
