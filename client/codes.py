"""Every error code the coordinator puts in its ``{"code", "message"}`` error bodies.

One list for both sides: the service refuses to define an error whose code is not here
(``rallypoint.service.errors``), its OpenAPI document names these codes under each
status, and the client maps each of them to an exception class
(:func:`rallypoint.client.errors.error_for`). A test holds the three together.

A code names what went wrong, not the HTTP status: ``invalid_request`` is 400 for
well-formed JSON the coordinator cannot act on and 422 for a body or parameter outside
the schema (with ``detail``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

__all__ = [
    "ACCESS_DENIED",
    "ALREADY_EXISTS",
    "BAD_REQUEST",
    "BODY_TOO_LARGE",
    "CHECKPOINT_CONFLICT",
    "CODES",
    "FORBIDDEN",
    "INCOMPLETE_UPLOAD",
    "INTERNAL_ERROR",
    "INVALID_CREDENTIAL",
    "INVALID_ID",
    "INVALID_NAME",
    "INVALID_REQUEST",
    "JOB_CONFLICT",
    "JOB_FULL",
    "JOIN_TIMEOUT",
    "LIMIT_EXCEEDED",
    "MALFORMED_JSON",
    "METHOD_NOT_ALLOWED",
    "MODIFIED",
    "NODE_QUARANTINED",
    "NOT_FOUND",
    "NOT_READY",
    "STALE_GENERATION",
    "STANDBY_RELEASED",
    "STORAGE_ERROR",
    "STORAGE_UNAVAILABLE",
    "UNAUTHORIZED",
    "UNKNOWN_CHECKPOINT",
    "UNKNOWN_JOB",
    "UNKNOWN_NODE",
    "UNKNOWN_TOKEN",
]

# The request: its form.
BAD_REQUEST: Final = "bad_request"
INVALID_REQUEST: Final = "invalid_request"
INVALID_ID: Final = "invalid_id"
MALFORMED_JSON: Final = "malformed_json"
BODY_TOO_LARGE: Final = "body_too_large"
NOT_FOUND: Final = "not_found"
METHOD_NOT_ALLOWED: Final = "method_not_allowed"
# The caller: who it is.
UNAUTHORIZED: Final = "unauthorized"
FORBIDDEN: Final = "forbidden"
INVALID_CREDENTIAL: Final = "invalid_credential"
# What the request names, and the state it finds.
UNKNOWN_JOB: Final = "unknown_job"
UNKNOWN_NODE: Final = "unknown_node"
UNKNOWN_TOKEN: Final = "unknown_token"
UNKNOWN_CHECKPOINT: Final = "unknown_checkpoint"
JOB_CONFLICT: Final = "job_conflict"
JOB_FULL: Final = "job_full"
STANDBY_RELEASED: Final = "standby_released"
NODE_QUARANTINED: Final = "node_quarantined"
STALE_GENERATION: Final = "stale_generation"
JOIN_TIMEOUT: Final = "join_timeout"
CHECKPOINT_CONFLICT: Final = "checkpoint_conflict"
INCOMPLETE_UPLOAD: Final = "incomplete_upload"
# The coordinator and its storage.
INTERNAL_ERROR: Final = "internal_error"
STORAGE_ERROR: Final = "storage_error"
STORAGE_UNAVAILABLE: Final = "storage_unavailable"
NOT_READY: Final = "not_ready"
ALREADY_EXISTS: Final = "already_exists"
MODIFIED: Final = "modified"
INVALID_NAME: Final = "invalid_name"
LIMIT_EXCEEDED: Final = "limit_exceeded"
ACCESS_DENIED: Final = "access_denied"

#: Every code, with the status it travels with and what it means.
CODES: Final[Mapping[str, str]] = MappingProxyType(
    {
        BAD_REQUEST: "400: a request the coordinator cannot take",
        INVALID_REQUEST: "400: well-formed but not actionable; 422: outside the schema",
        INVALID_ID: "400: a job or node id outside [A-Za-z0-9._-]{1,64}, or '.' or '..'",
        MALFORMED_JSON: "400: the body is not JSON",
        BODY_TOO_LARGE: "413: the body is over the route's limit",
        NOT_FOUND: "404: no such route",
        METHOD_NOT_ALLOWED: "405: the route does not take this method (see Allow)",
        UNAUTHORIZED: "401: no token, or not a valid one",
        FORBIDDEN: "403: the token's job or role does not cover the request",
        INVALID_CREDENTIAL: "403: acting for a node without its credential",
        UNKNOWN_JOB: "404: no job has this id",
        UNKNOWN_NODE: "404: the node is not part of the job (or generation)",
        UNKNOWN_TOKEN: "404: no scoped token has this id",
        UNKNOWN_CHECKPOINT: "404: no such checkpoint version (or none committed yet)",
        JOB_CONFLICT: "409: the job exists with other parameters",
        JOB_FULL: "409: max_nodes are members already",
        STANDBY_RELEASED: "410: the generation a standby parked beside finished training",
        NODE_QUARANTINED: "403: the job does not admit the node until an operator clears it",
        STALE_GENERATION: "409: the request acts for a generation that is not running",
        JOIN_TIMEOUT: "408: no generation sealed within the job's join timeout",
        CHECKPOINT_CONFLICT: "409: the version is not open for this",
        INCOMPLETE_UPLOAD: "409: a reported file is not in storage as reported",
        INTERNAL_ERROR: "500: the coordinator failed (see its log)",
        STORAGE_ERROR: "503: storage failed",
        STORAGE_UNAVAILABLE: "503: storage cannot be reached; retry",
        NOT_READY: "503: the replica is starting or shutting down; another one answers",
        ALREADY_EXISTS: "409: storage already holds the object",
        MODIFIED: "412: storage changed under the request",
        INVALID_NAME: "400: storage cannot take the name",
        LIMIT_EXCEEDED: "413: over a storage limit",
        ACCESS_DENIED: "403: storage refused the access",
    }
)
