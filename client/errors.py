"""Errors raised by the Rallypoint client.

Hierarchy::

    RallypointError
    └── SignedUrlError    a signed URL that is malformed, expired, tampered or
                          used for an access it does not grant
"""

from __future__ import annotations

__all__ = ["RallypointError", "SignedUrlError"]


class RallypointError(Exception):
    """Base of every error the client raises; ``code`` is machine-readable."""

    code: str = "error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SignedUrlError(RallypointError):
    code = "access_denied"
