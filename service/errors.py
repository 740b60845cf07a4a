"""Errors raised by the coordinator and its storage layer.

Every error carries a machine-readable ``code`` that the HTTP layer puts in its
``{"code": ..., "message": ...}`` bodies. Foreign exceptions (Azure SDK, sqlite3,
OSError) are translated inside the storage adapters, always ``raise ... from exc``.

Hierarchy::

    RallypointServiceError
    └── StorageError
        ├── NotFound            the entity or blob does not exist
        ├── AlreadyExists       insert-if-absent / create-if-absent found one
        ├── Modified            an ETag condition failed (someone else wrote first)
        ├── InvalidName         a key or blob name is empty, too long or a path trick
        ├── LimitExceeded       an entity, property or batch over Azure's limits
        ├── BadRequest          any other request the store cannot take
        ├── AccessDenied        a signed URL that is expired, tampered or out of scope
        └── StorageUnavailable  the store cannot be reached (after the SDK's retries)
"""

from __future__ import annotations

__all__ = [
    "AccessDenied",
    "AlreadyExists",
    "BadRequest",
    "InvalidName",
    "LimitExceeded",
    "Modified",
    "NotFound",
    "RallypointServiceError",
    "StorageError",
    "StorageUnavailable",
]


class RallypointServiceError(Exception):
    """Base of every error the coordinator raises on purpose."""

    code = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class StorageError(RallypointServiceError):
    """A storage operation failed; the subclass says why.

    Attributes:
        op_index: For a failed batch, the position of the operation that failed.
    """

    code = "storage_error"

    def __init__(self, message: str, *, op_index: int | None = None) -> None:
        super().__init__(message)
        self.op_index = op_index


class NotFound(StorageError):
    code = "not_found"


class AlreadyExists(StorageError):
    code = "already_exists"


class Modified(StorageError):
    """An ETag condition failed: the object changed since it was read."""

    code = "modified"


class InvalidName(StorageError):
    code = "invalid_name"


class LimitExceeded(StorageError):
    code = "limit_exceeded"


class BadRequest(StorageError):
    code = "bad_request"


class AccessDenied(StorageError):
    code = "access_denied"


class StorageUnavailable(StorageError):
    code = "storage_unavailable"
