"""The one place where Azure SDK exceptions become the domain's storage errors."""

from __future__ import annotations

from typing import Literal

from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceModifiedError,
    ResourceNotFoundError,
)

from ..errors import (
    AccessDenied,
    AlreadyExists,
    BadRequest,
    LimitExceeded,
    Modified,
    NotFound,
    StorageError,
    StorageUnavailable,
)

__all__ = ["lease_failure", "translate"]

# Azure error codes, per https://learn.microsoft.com/rest/api/storageservices/
_BY_CODE: dict[str, type[StorageError]] = {
    "EntityAlreadyExists": AlreadyExists,
    "BlobAlreadyExists": AlreadyExists,
    "ResourceNotFound": NotFound,
    "BlobNotFound": NotFound,
    "ContainerNotFound": NotFound,
    "TableNotFound": NotFound,
    "UpdateConditionNotSatisfied": Modified,
    "ConditionNotMet": Modified,
    "EntityTooLarge": LimitExceeded,
    "PropertyValueTooLarge": LimitExceeded,
    "RequestBodyTooLarge": LimitExceeded,
    "AuthorizationFailure": AccessDenied,
    "AuthenticationFailed": AccessDenied,
    "AuthorizationPermissionMismatch": AccessDenied,
}


def _code(exc: AzureError) -> str | None:
    code = getattr(exc, "error_code", None)
    code = getattr(code, "value", code)
    return None if code is None else str(code)


def lease_failure(exc: AzureError) -> Literal["held", "absent"] | None:
    """How a request failed on a blob's lease (:meth:`BlobStore.revoke` leases a scope's
    objects): ``held``, the blob has a lease the request did not name; ``absent``, the
    request named a lease the blob does not have; None, it did not fail on a lease."""
    code = _code(exc)
    if code in ("LeaseIdMissing", "LeaseIdMismatchWithBlobOperation", "LeaseAlreadyPresent"):
        return "held"
    if code == "LeaseNotPresentWithBlobOperation":
        return "absent"
    return None


def translate(exc: AzureError, what: str, *, op_index: int | None = None) -> StorageError:
    """Maps an Azure SDK exception to a storage error; the caller raises it ``from exc``.

    Args:
        exc: What the SDK raised.
        what: The object concerned, for the message.
        op_index: For a failed transaction, the operation that failed.
    """
    code = _code(exc)
    kind: type[StorageError] | None = _BY_CODE.get(code) if code else None
    if kind is None:
        if isinstance(exc, ResourceModifiedError):
            kind = Modified
        elif isinstance(exc, ResourceNotFoundError):
            kind = NotFound
        elif isinstance(exc, ResourceExistsError):
            kind = AlreadyExists
        elif isinstance(exc, ClientAuthenticationError):
            kind = AccessDenied
        elif isinstance(exc, HttpResponseError) and exc.status_code is not None:
            status = exc.status_code
            kind = {
                403: AccessDenied,
                404: NotFound,
                409: AlreadyExists,
                412: Modified,
                413: LimitExceeded,
            }.get(status, StorageUnavailable if status >= 500 or status == 429 else BadRequest)
        else:
            kind = StorageUnavailable  # no answer: connection refused, timeout, DNS
    detail = str(getattr(exc, "message", None) or exc).splitlines()[0]
    return kind(f"{what}: {detail}", op_index=op_index)
