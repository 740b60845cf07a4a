"""Errors raised by the Rallypoint client.

Hierarchy::

    RallypointError
    ├── TransportError        the coordinator could not be reached, even after retries
    ├── ServerError           the coordinator answered with an error (``code``, ``status``)
    │   ├── Unauthorized      401: no or a wrong token
    │   ├── Forbidden         403: the token's job or role does not cover the request
    │   ├── InvalidCredential 403: not this node's credential (re-join for a new one)
    │   ├── InvalidRequest    400/404/405/413/422: malformed, out of range, no such route
    │   ├── UnknownJob        404: no such job
    │   ├── UnknownNode       404: the node is not part of the job (or generation)
    │   ├── UnknownToken      404: no scoped token has this id
    │   ├── JobConflict       409: the job exists with other parameters
    │   ├── JobFull           409: the job runs with max_nodes members already
    │   ├── StandbyReleased   410: the generation this standby parked beside finished
    │   ├── NodeQuarantined   403: the job does not admit this node (an operator's mark)
    │   ├── StaleGeneration   409: this node's generation is over (it was fenced out)
    │   ├── JoinTimeout       408: no generation sealed in time
    │   ├── UnknownCheckpoint 404: no such checkpoint version (or none committed yet)
    │   ├── CheckpointConflict 409: the version is no longer open (expired, collected)
    │   ├── IncompleteUpload  409: a reported file is not in storage as reported
    │   └── CoordinatorError  500/503: the coordinator or its storage failed
    └── SignedUrlError        a signed URL that is malformed, expired, tampered or
                              used for an access it does not grant
"""

from __future__ import annotations

from rallypoint.coded import CodedError

from . import codes

__all__ = [
    "CheckpointConflict",
    "CoordinatorError",
    "Forbidden",
    "IncompleteUpload",
    "InvalidCredential",
    "InvalidRequest",
    "JobConflict",
    "JobFull",
    "JoinTimeout",
    "NodeQuarantined",
    "RallypointError",
    "ServerError",
    "SignedUrlError",
    "StaleGeneration",
    "StandbyReleased",
    "TransportError",
    "Unauthorized",
    "UnknownCheckpoint",
    "UnknownJob",
    "UnknownNode",
    "UnknownToken",
    "error_for",
]


class RallypointError(CodedError):
    """Base of every error the client raises; ``code`` is machine-readable."""

    code: str = "error"


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


class Forbidden(ServerError):
    code = "forbidden"


class InvalidCredential(ServerError):
    code = "invalid_credential"


class InvalidRequest(ServerError):
    code = "invalid_request"


class UnknownJob(ServerError):
    code = "unknown_job"


class UnknownNode(ServerError):
    code = "unknown_node"


class UnknownToken(ServerError):
    code = "unknown_token"


class JobConflict(ServerError):
    code = "job_conflict"


class JobFull(ServerError):
    code = "job_full"


class StandbyReleased(ServerError):
    """The generation this node parked beside as a standby ended because its training
    finished (a member's workers exited 0): there is nothing left to stand by for."""

    code = "standby_released"


class NodeQuarantined(ServerError):
    code = "node_quarantined"


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


class CoordinatorError(ServerError):
    """The coordinator or its storage failed, not the request (the client retries 503s
    before it gives up with :class:`TransportError`)."""

    code = codes.INTERNAL_ERROR


class SignedUrlError(RallypointError):
    code = "access_denied"


_BY_CODE: dict[str, type[ServerError]] = {
    cls.code: cls
    for cls in (
        Unauthorized,
        Forbidden,
        InvalidCredential,
        UnknownJob,
        UnknownNode,
        UnknownToken,
        JobConflict,
        JobFull,
        StandbyReleased,
        NodeQuarantined,
        StaleGeneration,
        JoinTimeout,
        UnknownCheckpoint,
        CheckpointConflict,
        IncompleteUpload,
    )
}
# Codes that share a class: the request's form, a refused access to storage, and
# failures on the coordinator's side (storage errors it did not expect).
_BY_CODE.update(
    dict.fromkeys(
        (
            codes.INVALID_REQUEST,
            codes.INVALID_ID,
            codes.MALFORMED_JSON,
            codes.BODY_TOO_LARGE,
            codes.BAD_REQUEST,
            codes.NOT_FOUND,
            codes.METHOD_NOT_ALLOWED,
            codes.INVALID_NAME,
            codes.LIMIT_EXCEEDED,
        ),
        InvalidRequest,
    )
)
_BY_CODE[codes.ACCESS_DENIED] = Forbidden
_BY_CODE.update(
    dict.fromkeys(
        (
            codes.INTERNAL_ERROR,
            codes.STORAGE_ERROR,
            codes.STORAGE_UNAVAILABLE,
            codes.NOT_READY,
            codes.ALREADY_EXISTS,
            codes.MODIFIED,
        ),
        CoordinatorError,
    )
)


def error_for(status: int, code: str, message: str) -> ServerError:
    """The exception for an error reply: the class of its code (every code in
    :data:`~rallypoint.client.codes.CODES` has one), else :class:`ServerError`."""
    return _BY_CODE.get(code, ServerError)(message, code=code, status=status)
