"""The Rallypoint client: what a trainer links against (httpx and pydantic, never torch).

Example::

    from rallypoint.client import ElasticClient

    client = ElasticClient.from_env()          # RALLYPOINT_URL, RALLYPOINT_JOB, ...
    assignment = client.join()                 # blocks until the generation seals
    with client.heartbeats() as beats:
        train(assignment.rank, assignment.world_size, assignment.checkpoint)
"""

from ._client import (
    JOB_ENV,
    NODE_ENV,
    TOKEN_ENV,
    URL_ENV,
    ElasticClient,
    Heartbeats,
    RetryPolicy,
)
from ._models import (
    Assignment,
    CheckpointPointer,
    GenerationInfo,
    HeartbeatReply,
    JobSpec,
    JobStatus,
    JobSummary,
    MemberInfo,
    MemberStatus,
    WaitingNode,
)
from .errors import (
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
    UnknownJob,
    UnknownNode,
)

__all__ = [
    "JOB_ENV",
    "NODE_ENV",
    "TOKEN_ENV",
    "URL_ENV",
    "Assignment",
    "CheckpointPointer",
    "ElasticClient",
    "GenerationInfo",
    "HeartbeatReply",
    "Heartbeats",
    "InvalidRequest",
    "JobConflict",
    "JobFull",
    "JobSpec",
    "JobStatus",
    "JobSummary",
    "JoinTimeout",
    "MemberInfo",
    "MemberStatus",
    "RallypointError",
    "RetryPolicy",
    "ServerError",
    "SignedUrlError",
    "StaleGeneration",
    "TransportError",
    "Unauthorized",
    "UnknownJob",
    "UnknownNode",
    "WaitingNode",
]
