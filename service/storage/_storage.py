"""Opening a backend: ``local:PATH`` (SQLite + a directory) or ``azure`` (Table + Blob)."""

from __future__ import annotations

import abc
import os
import re
import threading
from pathlib import Path
from typing import Any

from ..errors import BadRequest
from ._blob import BlobStore
from ._table import Table

__all__ = ["DEFAULT_STORAGE", "AzureStorage", "LocalStorage", "Storage", "open_storage"]

DEFAULT_STORAGE = "local:.rallypoint"
_PREFIX = re.compile(r"[a-z][a-z0-9]{0,23}")
_LOGICAL = re.compile(r"[a-z][a-z0-9]{2,30}")


def _check_names(prefix: str, name: str | None = None) -> None:
    if not _PREFIX.fullmatch(prefix):
        raise BadRequest(
            f"storage prefix {prefix!r} must be 1-24 lowercase letters and digits, starting "
            "with a letter (it begins Azure table and container names)"
        )
    if name is not None and not _LOGICAL.fullmatch(name):
        raise BadRequest(f"table or container name {name!r} must be 3-31 lowercase letters/digits")


class Storage(abc.ABC):
    """One backend's tables and blob containers, named under a deployment prefix.

    Several deployments can share one account: table ``NAME`` is stored as
    ``PREFIXNAME`` and container ``NAME`` as ``PREFIX-NAME``.
    """

    backend: str

    def __init__(self, prefix: str) -> None:
        _check_names(prefix)
        self.prefix = prefix
        self._tables: dict[str, Table] = {}
        self._blobs: dict[str, BlobStore] = {}
        self._lock = threading.Lock()

    def table(self, name: str) -> Table:
        """The table ``name``, created on first use."""
        _check_names(self.prefix, name)
        with self._lock:
            if name not in self._tables:
                self._tables[name] = self._open_table(f"{self.prefix}{name}")
            return self._tables[name]

    def blobs(self, name: str) -> BlobStore:
        """The blob container ``name``, created on first use."""
        _check_names(self.prefix, name)
        with self._lock:
            if name not in self._blobs:
                self._blobs[name] = self._open_blobs(f"{self.prefix}-{name}")
            return self._blobs[name]

    def ping(self) -> None:
        """Checks that every opened table and container answers.

        Raises:
            StorageUnavailable: One does not.
        """
        for store in self._stores():
            store.ping()

    def close(self) -> None:
        """Closes every table and container opened."""
        for store in self._stores():
            store.close()
        self._tables.clear()
        self._blobs.clear()

    def _stores(self) -> list[Table | BlobStore]:
        return [*self._tables.values(), *self._blobs.values()]

    def describe(self) -> str:
        """Where the data lives, for logs and health pages (no secrets)."""
        return self.backend

    @abc.abstractmethod
    def _open_table(self, name: str) -> Table: ...

    @abc.abstractmethod
    def _open_blobs(self, name: str) -> BlobStore: ...


class LocalStorage(Storage):
    """The embedded backend: ``PATH/tables.sqlite3`` and ``PATH/blobs/CONTAINER/``."""

    backend = "local"

    def __init__(self, path: str | os.PathLike[str], prefix: str = "rp") -> None:
        super().__init__(prefix)
        self.path = Path(path).absolute()
        self.path.mkdir(parents=True, exist_ok=True)

    def describe(self) -> str:
        return f"local:{self.path}"

    def _open_table(self, name: str) -> Table:
        from ._local_table import LocalTable

        return LocalTable(self.path / "tables.sqlite3", name)

    def _open_blobs(self, name: str) -> BlobStore:
        from ._local_blob import LocalBlobStore

        return LocalBlobStore(self.path, name)


class AzureStorage(Storage):
    """Azure Table + Blob storage, by connection string or by managed identity.

    Args:
        prefix: The deployment prefix of table and container names.
        connection_string: An account connection string (Azurite's too).
        account: The account name, for DefaultAzureCredential (managed identity,
            workload identity, ``az login``) when there is no connection string.
        credential: Another azure-identity credential to use with ``account``.
    """

    backend = "azure"

    def __init__(
        self,
        prefix: str = "rp",
        *,
        connection_string: str | None = None,
        account: str | None = None,
        credential: Any = None,
    ) -> None:
        super().__init__(prefix)
        from azure.data.tables import TableServiceClient
        from azure.storage.blob import BlobServiceClient

        # 8 MiB blocks: Azure's throughput per request levels off around there.
        blob_options: dict[str, Any] = {"max_block_size": 8 << 20, "max_single_put_size": 8 << 20}
        if connection_string:
            self._tables_client = TableServiceClient.from_connection_string(connection_string)
            self._blob_client = BlobServiceClient.from_connection_string(
                connection_string, **blob_options
            )
            fields = dict(
                part.split("=", 1) for part in connection_string.split(";") if "=" in part
            )
            self._account_key: str | None = fields.get("AccountKey")
            self._where = fields.get("AccountName", "connection string")
        elif account:
            if credential is None:
                from azure.identity import DefaultAzureCredential

                credential = DefaultAzureCredential()
            self._tables_client = TableServiceClient(
                f"https://{account}.table.core.windows.net", credential=credential
            )
            self._blob_client = BlobServiceClient(
                f"https://{account}.blob.core.windows.net", credential=credential, **blob_options
            )
            self._account_key = None
            self._where = account
        else:
            raise BadRequest(
                "azure storage needs AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT "
                "for a managed identity"
            )

    def describe(self) -> str:
        return f"azure:{self._where}"

    def _open_table(self, name: str) -> Table:
        from azure.core.exceptions import AzureError

        from ._azure_errors import translate
        from ._azure_table import AzureTable

        try:
            return AzureTable(self._tables_client.create_table_if_not_exists(name))
        except AzureError as exc:
            raise translate(exc, f"table {name}") from exc

    def _open_blobs(self, name: str) -> BlobStore:
        from ._azure_blob import AzureBlobStore

        return AzureBlobStore(self._blob_client, name, self._account_key)

    def close(self) -> None:
        super().close()
        self._tables_client.close()
        self._blob_client.close()


def open_storage(
    spec: str = DEFAULT_STORAGE,
    *,
    prefix: str = "rp",
    connection_string: str | None = None,
    account: str | None = None,
) -> Storage:
    """Opens the backend a ``--storage`` setting names.

    Args:
        spec: ``local:PATH`` (``local`` alone means ``./.rallypoint``) or ``azure``.
        prefix: The deployment prefix of table and container names.
        connection_string: For ``azure``; defaults to ``AZURE_STORAGE_CONNECTION_STRING``.
        account: For ``azure`` with a managed identity; defaults to ``AZURE_STORAGE_ACCOUNT``.

    Raises:
        BadRequest: The spec names no known backend, or azure lacks credentials.
    """
    kind, _, rest = spec.partition(":")
    if kind == "local":
        return LocalStorage(rest or ".rallypoint", prefix)
    if kind == "azure" and not rest:
        connection_string = connection_string or os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
        account = account or os.environ.get("AZURE_STORAGE_ACCOUNT")
        return AzureStorage(prefix, connection_string=connection_string, account=account)
    raise BadRequest(f"storage {spec!r} is neither 'local:PATH' nor 'azure'")
