"""The storage error each of Azure's failures becomes in the coordinator.

What an Azure SDK exception means is read in :mod:`rallypoint.azure_errors`, the table
trainers use too; this module states only the coordinator's side of it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from azure.data.tables import TableTransactionError

from rallypoint.azure_errors import Failure, translated

from ..errors import StorageError

__all__ = ["storage_errors"]


def _storage_error(what: str, failure: Failure) -> StorageError:
    # Each code of rallypoint.azure_errors.CODES is one of StorageError.by_code.
    return StorageError.by_code[failure.code](f"{what}: {failure.detail}")


def _batch_error(what: str, failure: Failure) -> StorageError:
    failed = failure.error
    index = failed.index if isinstance(failed, TableTransactionError) else None
    return StorageError.by_code[failure.code](f"{what}: {failure.detail}", op_index=index)


def storage_errors(what: str, *, batch: bool = False) -> AbstractContextManager[None]:
    """Raises the storage error for an Azure SDK exception raised inside, ``from`` it.

    Args:
        what: The object or operation concerned, for the message.
        batch: Inside is a table transaction of several operations: the error of a failed
            one names it (``op_index``).
    """
    return translated(what, _batch_error if batch else _storage_error)
