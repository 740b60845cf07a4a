"""Errors raised by the Rallypoint client.

Hierarchy::

    RallypointError
    ├── TransportError        the coordinator could not be reached, even after retries
    ├── ServerError           the coordinator answered with an error (``code``, ``status``)
    │   ├── Unauthorized      401: no or a wrong token
    │   ├── InvalidRequest    400/413/422: the request was malformed or out of range
    │   ├── UnknownJob        404: no such job
    │   ├── UnknownNode       404: the node is not part of the job (or generation)
    │   ├── JobConflict       409: the job exists with other parameters
    │   ├── JobFull           409: the job runs with max_nodes members already
    │   ├── StaleGeneration   409: this node's generation is over (it was fenced out)
    │   ├── JoinTimeout       408: no generation sealed in time
    │   ├── UnknownCheckpoint 404: no such checkpoint version (or none committed yet)
    │   ├── CheckpointConflict 409: the version is no longer open (expired, collected)
    │   └── IncompleteUpload  409: a reported file is not in storage as reported
    └── SignedUrlError        a signed URL that is malformed, expired, tampered or
                              used for an access it does not grant
"""

from __future__ import annotations

__all__ = [
    "CheckpointConflict",
    "IncompleteUpload",
    "InvalidRequest",
    "JobConflict",
    "JobFull",
    "JoinTimeout",
    "RallypointError",
    "ServerError",
    "SignedUrlError",
    "StaleGeneration",
    "TransportError",
    "Unauthorized",
    "UnknownCheckpoint",
    "UnknownJob",
    "UnknownNode",
    "error_for",
]


class RallypointError(Exception):
    """Base of every error the client raises; ``code`` is machine-readable."""

    code: str = "error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class TransportError(RallypointError):
    code = "unreachable"


class ServerError(RallypointError):
    """The coordinator refused a request; ``code`` is the one it sent."""

    code = "server_error"

    def __init__(self, message: str, *, code: str | None = None, status: int = 500) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.status = status


class Unauthorized(ServerError):
    code = "unauthorized"


class InvalidRequest(ServerError):
    code = "invalid_request"


class UnknownJob(ServerError):
    code = "unknown_job"


class UnknownNode(ServerError):
    code = "unknown_node"


class JobConflict(ServerError):
    code = "job_conflict"


class JobFull(ServerError):
    code = "job_full"


class StaleGeneration(ServerError):
    code = "stale_generation"


class JoinTimeout(ServerError):
    code = "join_timeout"


class UnknownCheckpoint(ServerError):
    code = "unknown_checkpoint"


class CheckpointConflict(ServerError):
    code = "checkpoint_conflict"


class IncompleteUpload(ServerError):
    code = "incomplete_upload"


class SignedUrlError(RallypointError):
    code = "access_denied"


_BY_CODE: dict[str, type[ServerError]] = {
    cls.code: cls
    for cls in (
        Unauthorized,
        UnknownJob,
        UnknownNode,
        JobConflict,
        JobFull,
        StaleGeneration,
        JoinTimeout,
        UnknownCheckpoint,
        CheckpointConflict,
        IncompleteUpload,
    )
}
_INVALID = {"invalid_request", "invalid_id", "malformed_json", "body_too_large", "bad_request"}


def error_for(status: int, code: str, message: str) -> ServerError:
    """The exception for an error reply."""
    cls = _BY_CODE.get(code) or (InvalidRequest if code in _INVALID else ServerError)
    return cls(message, code=code, status=status)
