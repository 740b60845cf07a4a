"""The Rallypoint client: what a trainer links against (httpx and pydantic, never torch).

Example::

    from rallypoint.client import ElasticClient

    client = ElasticClient.from_env()          # RALLYPOINT_URL, RALLYPOINT_JOB, ...
    assignment = client.join()                 # blocks until the generation seals
    with client.heartbeats() as beats:
        train(assignment.rank, assignment.world_size, assignment.checkpoint)
"""

from ._client import (
    ENDPOINT_KEY_ENV,
    GENERATION_ENV,
    JOB_ENV,
    NODE_ENV,
    TOKEN_ENV,
    TRANSPORT_ENV,
    URL_ENV,
    ElasticClient,
    Heartbeats,
    RetryPolicy,
)
from ._models import (
    Assignment,
    CheckpointBegun,
    CheckpointInfo,
    CheckpointPointer,
    GenerationInfo,
    HeartbeatReply,
    JobSpec,
    JobStatus,
    JobSummary,
    Manifest,
    ManifestFile,
    ManifestShard,
    MemberInfo,
    MemberStatus,
    NodeInfo,
    ShardFile,
    StoreReply,
    StoreRequest,
    WaitingNode,
)
from .errors import (
    CheckpointConflict,
    IncompleteUpload,
    InvalidRequest,
    JobConflict,
    JobFull,
    JoinTimeout,
    RallypointError,
    ServerError,
    SignedUrlError,
    StaleGeneration,
    TransportError,
    Unauthorized,
    UnknownCheckpoint,
    UnknownJob,
    UnknownNode,
)

__all__ = [
    "ENDPOINT_KEY_ENV",
    "GENERATION_ENV",
    "JOB_ENV",
    "NODE_ENV",
    "TOKEN_ENV",
    "TRANSPORT_ENV",
    "URL_ENV",
    "Assignment",
    "CheckpointBegun",
    "CheckpointConflict",
    "CheckpointInfo",
    "CheckpointPointer",
    "ElasticClient",
    "GenerationInfo",
    "HeartbeatReply",
    "Heartbeats",
    "IncompleteUpload",
    "InvalidRequest",
    "JobConflict",
    "JobFull",
    "JobSpec",
    "JobStatus",
    "JobSummary",
    "JoinTimeout",
    "Manifest",
    "ManifestFile",
    "ManifestShard",
    "MemberInfo",
    "MemberStatus",
    "NodeInfo",
    "RallypointError",
    "RetryPolicy",
    "ServerError",
    "ShardFile",
    "SignedUrlError",
    "StaleGeneration",
    "StoreReply",
    "StoreRequest",
    "TransportError",
    "Unauthorized",
    "UnknownCheckpoint",
    "UnknownJob",
    "UnknownNode",
    "WaitingNode",
]
