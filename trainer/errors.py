"""Errors raised by the trainer-side helpers.

Hierarchy::

    RallypointTrainerError
    └── TransferError          moving bytes to or from storage failed
        ├── TransferDenied     the signed URL is expired, tampered or out of scope
        └── TransferNotFound   the object a read URL names does not exist
"""

from __future__ import annotations

__all__ = ["RallypointTrainerError", "TransferDenied", "TransferError", "TransferNotFound"]


class RallypointTrainerError(Exception):
    """Base of every error the trainer helpers raise; ``code`` is machine-readable."""

    code = "trainer_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class TransferError(RallypointTrainerError):
    code = "transfer_failed"


class TransferDenied(TransferError):
    code = "access_denied"


class TransferNotFound(TransferError):
    code = "not_found"
