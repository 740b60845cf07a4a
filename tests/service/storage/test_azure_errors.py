"""The one table from Azure SDK exceptions to error codes, and each side's reading of it.

The adapters' contract tests meet these failures against Azurite; these rows are the ones
Azurite cannot be made to answer (a 5xx, no answer at all, a failed transaction's index)
or that both sides must read alike.
"""

from __future__ import annotations

import pytest
from azure.core.exceptions import (
    AzureError,
    HttpResponseError,
    ResourceExistsError,
    ResourceNotFoundError,
    ServiceRequestError,
)
from azure.data.tables import TableTransactionError

from rallypoint.azure_errors import CODES, translated
from rallypoint.service.errors import (
    AccessDenied,
    AlreadyExists,
    BadRequest,
    Modified,
    NotFound,
    StorageError,
    StorageUnavailable,
)
from rallypoint.service.storage._azure_errors import storage_errors
from rallypoint.trainer.checkpoint._transfer import _azure
from rallypoint.trainer.errors import TransferDenied, TransferError, TransferNotFound


def _answer(
    kind: type[HttpResponseError], status: int | None, code: str | None, message: str
) -> HttpResponseError:
    exc = kind(message=message)
    exc.status_code = status
    exc.error_code = code
    return exc


ROWS: list[tuple[AzureError, type[StorageError], type[TransferError]]] = [
    (_answer(ResourceNotFoundError, 404, "BlobNotFound", "gone"), NotFound, TransferNotFound),
    (_answer(HttpResponseError, 403, "AuthenticationFailed", "sig"), AccessDenied, TransferDenied),
    (_answer(HttpResponseError, 403, None, "no"), AccessDenied, TransferDenied),
    (_answer(HttpResponseError, 412, "ConditionNotMet", "etag"), Modified, TransferError),
    (_answer(ResourceExistsError, 409, "BlobAlreadyExists", "there"), AlreadyExists, TransferError),
    (_answer(HttpResponseError, 400, "InvalidBlockList", "bad"), BadRequest, TransferError),
    (_answer(HttpResponseError, 503, "ServerBusy", "busy"), StorageUnavailable, TransferError),
    (_answer(HttpResponseError, 429, None, "slow down"), StorageUnavailable, TransferError),
    (ServiceRequestError("connection refused"), StorageUnavailable, TransferError),
]


@pytest.mark.parametrize(("exc", "storage", "transfer"), ROWS)
def test_both_sides_read_a_failure_alike(
    exc: AzureError, storage: type[StorageError], transfer: type[TransferError]
) -> None:
    with pytest.raises(StorageError) as caught, storage_errors("blob 'a'"):
        raise exc
    assert type(caught.value) is storage
    assert caught.value.__cause__ is exc and caught.value.op_index is None
    with pytest.raises(TransferError) as moved, _azure("https://acct/c/a?sig=secret"):
        raise exc
    assert type(moved.value) is transfer
    assert moved.value.message.startswith("https://acct/c/a: ")  # never the SAS
    assert caught.value.message.split(": ", 1)[1] == moved.value.message.split(": ", 1)[1]


def test_a_closed_version_refuses_a_trainer_and_is_modified_for_the_store() -> None:
    exc = _answer(HttpResponseError, 412, "LeaseIdMissing", "There is a lease.\nMore")
    with (
        pytest.raises(Modified, match=r"^put blob 'a': There is a lease\.$"),
        storage_errors("put blob 'a'"),
    ):
        raise exc
    with pytest.raises(TransferDenied, match="closed to writes"), _azure("https://acct/c/a"):
        raise exc


def test_a_failed_transaction_names_its_operation_in_a_batch_only() -> None:
    exc = TableTransactionError(message="2:The specified entity already exists.")
    exc.status_code, exc.error_code = 409, "EntityAlreadyExists"
    with pytest.raises(AlreadyExists) as caught, storage_errors("batch on t", batch=True):
        raise exc
    assert caught.value.op_index == 2
    with pytest.raises(AlreadyExists) as single, storage_errors("delete t/p/r"):
        raise exc
    assert single.value.op_index is None


def test_every_code_has_an_error_on_the_service_side() -> None:
    assert set(StorageError.by_code) >= CODES


def test_other_exceptions_pass_unchanged() -> None:
    with pytest.raises(KeyError), translated("x", lambda what, failure: RuntimeError(what)):
        raise KeyError("k")
