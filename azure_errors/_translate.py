"""The one table from Azure SDK exceptions to Rallypoint's error codes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rallypoint.client import codes

if TYPE_CHECKING:
    from azure.core.exceptions import AzureError

__all__ = ["CODES", "Failure", "azure_code", "classify", "lease_failure", "translated"]

# Azure's error codes, per https://learn.microsoft.com/rest/api/storageservices/
_BY_CODE: dict[str, str] = {
    "EntityAlreadyExists": codes.ALREADY_EXISTS,
    "BlobAlreadyExists": codes.ALREADY_EXISTS,
    "ResourceNotFound": codes.NOT_FOUND,
    "BlobNotFound": codes.NOT_FOUND,
    "ContainerNotFound": codes.NOT_FOUND,
    "TableNotFound": codes.NOT_FOUND,
    "UpdateConditionNotSatisfied": codes.MODIFIED,
    "ConditionNotMet": codes.MODIFIED,
    "EntityTooLarge": codes.LIMIT_EXCEEDED,
    "PropertyValueTooLarge": codes.LIMIT_EXCEEDED,
    "RequestBodyTooLarge": codes.LIMIT_EXCEEDED,
    "AuthorizationFailure": codes.ACCESS_DENIED,
    "AuthenticationFailed": codes.ACCESS_DENIED,
    "AuthorizationPermissionMismatch": codes.ACCESS_DENIED,
}
# An answer with no code above and of no telling exception class; any other status under
# 500 but 429 is a request storage cannot take.
_BY_STATUS: dict[int, str] = {
    403: codes.ACCESS_DENIED,
    404: codes.NOT_FOUND,
    409: codes.ALREADY_EXISTS,
    412: codes.MODIFIED,
    413: codes.LIMIT_EXCEEDED,
}
# A lease the request did not name: the blob's (a write, a delete), or present already.
_LEASE_HELD = {"LeaseIdMissing", "LeaseIdMismatchWithBlobOperation", "LeaseAlreadyPresent"}

#: Every code :func:`classify` gives: a side's mapping covers these.
CODES: frozenset[str] = frozenset(
    {*_BY_CODE.values(), *_BY_STATUS.values(), codes.BAD_REQUEST, codes.STORAGE_UNAVAILABLE}
)


@dataclass(frozen=True)
class Failure:
    """What an Azure SDK exception says went wrong.

    Attributes:
        code: One of :data:`CODES`.
        detail: The first line of Azure's message.
        lease: See :func:`lease_failure`.
        error: The SDK's exception.
    """

    code: str
    detail: str
    lease: Literal["held", "absent"] | None
    error: AzureError


def azure_code(exc: AzureError) -> str | None:
    """Azure's error code (``x-ms-error-code``), where the exception carries one."""
    code = getattr(exc, "error_code", None)
    code = getattr(code, "value", code)
    return None if code is None else str(code)


def lease_failure(exc: AzureError) -> Literal["held", "absent"] | None:
    """How a request failed on a blob's lease (the coordinator leases a version's objects
    to close them to writes): ``held``, the blob has a lease the request did not name;
    ``absent``, the request named a lease the blob does not have; None, it did not fail
    on a lease."""
    code = azure_code(exc)
    if code in _LEASE_HELD:
        return "held"
    if code == "LeaseNotPresentWithBlobOperation":
        return "absent"
    return None


def classify(exc: AzureError) -> Failure:
    """The table: what ``exc`` means, in Rallypoint's codes."""
    lines = str(getattr(exc, "message", None) or exc).splitlines()
    detail = lines[0] if lines else type(exc).__name__
    return Failure(_code(exc), detail, lease_failure(exc), exc)


def _code(exc: AzureError) -> str:
    from azure.core.exceptions import (
        ClientAuthenticationError,
        HttpResponseError,
        ResourceExistsError,
        ResourceModifiedError,
        ResourceNotFoundError,
    )

    code = _BY_CODE.get(azure_code(exc) or "")
    if code is not None:
        return code
    if isinstance(exc, ResourceModifiedError):
        return codes.MODIFIED
    if isinstance(exc, ResourceNotFoundError):
        return codes.NOT_FOUND
    if isinstance(exc, ResourceExistsError):
        return codes.ALREADY_EXISTS
    if isinstance(exc, ClientAuthenticationError):
        return codes.ACCESS_DENIED
    if isinstance(exc, HttpResponseError) and exc.status_code is not None:
        status: int = exc.status_code
        unavailable = status >= 500 or status == 429
        return _BY_STATUS.get(
            status, codes.STORAGE_UNAVAILABLE if unavailable else codes.BAD_REQUEST
        )
    return codes.STORAGE_UNAVAILABLE  # no answer: connection refused, timeout, DNS


@contextlib.contextmanager
def translated(what: str, error: Callable[[str, Failure], Exception]) -> Iterator[None]:
    """Raises ``error(what, classify(exc)) from exc`` for an Azure SDK exception ``exc``
    raised inside; anything else passes unchanged.

    Args:
        what: The object or operation concerned, to begin the message with.
        error: The caller's side's exception for a failure.
    """
    from azure.core.exceptions import AzureError

    try:
        yield
    except AzureError as exc:
        raise error(what, classify(exc)) from exc
