"""Errors raised by the coordinator and its storage layer.

Every error carries a machine-readable ``code`` that the HTTP layer puts in its
``{"code": ..., "message": ...}`` bodies. Foreign exceptions (Azure SDK, sqlite3,
OSError) are translated inside the storage adapters, always ``raise ... from exc``.

Hierarchy::

    RallypointServiceError
    ├── RequestError            the caller asked for something it may not have
    │   ├── InvalidRequest      400: well-formed JSON that makes no sense
    │   │   └── InvalidId       400: a job or node id outside [A-Za-z0-9._-]{1,64}
    │   ├── Unauthorized        401: no or a wrong bearer token
    │   ├── Forbidden           403: the token's job or role does not cover the request
    │   ├── InvalidCredential   403: a request acting for a node lacks its credential
    │   ├── UnknownJob          404: no job has this id
    │   ├── UnknownNode         404: the node never joined this job
    │   ├── UnknownToken        404: no scoped token has this id
    │   ├── JobConflict         409: the job exists with other parameters
    │   ├── JobFull             409: max_nodes are members already
    │   ├── StandbyReleased     410: the generation a standby parked beside finished
    │   ├── NodeQuarantined     403: the job does not admit the node (quarantined)
    │   ├── StaleGeneration     409: the request acts for a generation that ended (fencing)
    │   ├── JoinTimeout         408: no generation sealed within join_timeout
    │   ├── UnknownCheckpoint   404: no such checkpoint version (or none committed yet)
    │   ├── CheckpointConflict  409: the version is not open for this (expired, other step)
    │   └── IncompleteUpload    409: a reported file is missing or not its reported size
    └── StorageError
        ├── NotFound            the entity or blob does not exist
        ├── AlreadyExists       insert-if-absent / create-if-absent found one
        ├── Modified            an ETag condition failed (someone else wrote first)
        ├── InvalidName         a key or blob name is empty, too long or a path trick
        ├── LimitExceeded       an entity, property or batch over Azure's limits
        ├── BadRequest          any other request storage cannot take
        ├── AccessDenied        a signed URL that is expired, tampered or out of scope
        └── StorageUnavailable  storage cannot be reached (after the SDK's retries)
"""

from __future__ import annotations

from typing import Any, ClassVar

from rallypoint.client import codes
from rallypoint.coded import CodedError

__all__ = [
    "AccessDenied",
    "AlreadyExists",
    "BadRequest",
    "BeatRefused",
    "CheckpointConflict",
    "Forbidden",
    "IncompleteUpload",
    "InvalidCredential",
    "InvalidId",
    "InvalidName",
    "InvalidRequest",
    "JobConflict",
    "JobFull",
    "JoinTimeout",
    "LimitExceeded",
    "Modified",
    "NodeQuarantined",
    "NotFound",
    "RallypointServiceError",
    "RequestError",
    "StaleGeneration",
    "StandbyReleased",
    "StorageError",
    "StorageUnavailable",
    "Unauthorized",
    "UnknownCheckpoint",
    "UnknownJob",
    "UnknownNode",
    "UnknownToken",
]


class RallypointServiceError(CodedError):
    """Base of every error the coordinator raises on purpose; ``status`` is its HTTP one.

    ``code`` must be one of :data:`rallypoint.client.codes.CODES`, the list the client
    maps to its exceptions: a subclass with another code fails at import.
    """

    code = codes.INTERNAL_ERROR
    status = 500
    #: Whether each reply of this error (a 5xx) is logged: not where something else
    #: logs its cause once (a storage outage's refused heartbeats).
    logged = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.code not in codes.CODES:
            raise TypeError(f"{cls.__name__}.code {cls.code!r} is not in rallypoint.client.codes")


class RequestError(RallypointServiceError):
    code = "bad_request"
    status = 400


class InvalidRequest(RequestError):
    code = "invalid_request"
    status = 400


class InvalidId(InvalidRequest):
    code = "invalid_id"


class Unauthorized(RequestError):
    code = "unauthorized"
    status = 401


class Forbidden(RequestError):
    """A valid token whose job or role does not cover the request."""

    code = "forbidden"
    status = 403


class InvalidCredential(RequestError):
    """A request that acts for a node without that node's credential (from its join)."""

    code = "invalid_credential"
    status = 403


class UnknownJob(RequestError):
    code = "unknown_job"
    status = 404


class UnknownNode(RequestError):
    code = "unknown_node"
    status = 404


class UnknownToken(RequestError):
    code = "unknown_token"
    status = 404


class JobConflict(RequestError):
    code = "job_conflict"
    status = 409


class JobFull(RequestError):
    code = "job_full"
    status = 409


class StandbyReleased(RequestError):
    """The generation the node parked beside as a standby ended because its training
    finished: the standby goes home (its agent exits 0) instead of starting a run of
    its own."""

    code = "standby_released"
    status = 410


class NodeQuarantined(RequestError):
    """The node is quarantined in the job: it is not admitted until an operator clears
    it (``DELETE …/nodes/{node}/quarantine``)."""

    code = "node_quarantined"
    status = 403


class StaleGeneration(RequestError):
    """The request names a generation that is no longer the job's: a zombie is fenced."""

    code = "stale_generation"
    status = 409


class JoinTimeout(RequestError):
    code = "join_timeout"
    status = 408


class UnknownCheckpoint(RequestError):
    code = "unknown_checkpoint"
    status = 404


class CheckpointConflict(RequestError):
    code = "checkpoint_conflict"
    status = 409


class IncompleteUpload(RequestError):
    """A rank reported a file that storage does not hold as reported: never commit it."""

    code = "incomplete_upload"
    status = 409


class StorageError(RallypointServiceError):
    """A storage operation failed; the subclass says why.

    Attributes:
        op_index: For a failed batch, the position of the operation that failed.
    """

    code = "storage_error"
    status = 503

    #: Each storage error below by its code, filled as each is defined: what an adapter
    #: raises for the code a failure was read as (``storage/_azure_errors.py``), with no
    #: list of them to keep beside the classes.
    by_code: ClassVar[dict[str, type[StorageError]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        StorageError.by_code.setdefault(cls.code, cls)

    def __init__(self, message: str, *, op_index: int | None = None) -> None:
        super().__init__(message)
        self.op_index = op_index


class NotFound(StorageError):
    code = "not_found"
    status = 404


class AlreadyExists(StorageError):
    code = "already_exists"
    status = 409


class Modified(StorageError):
    """An ETag condition failed: the object changed since it was read."""

    code = "modified"
    status = 412


class InvalidName(StorageError):
    code = "invalid_name"
    status = 400


class LimitExceeded(StorageError):
    code = "limit_exceeded"
    status = 413


class BadRequest(StorageError):
    code = "bad_request"
    status = 400


class AccessDenied(StorageError):
    code = "access_denied"
    status = 403


class StorageUnavailable(StorageError):
    code = "storage_unavailable"
    status = 503


class BeatRefused(StorageUnavailable):
    """A heartbeat a replica does not take while its storage passes fail: the member
    retries, through the balancer, on a replica that can write it. The driver logs
    the outage and its end once; a beat a second per member is not logged."""

    logged = False
