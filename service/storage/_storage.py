"""Opening a backend: ``local:PATH`` (SQLite + a directory) or ``azure`` (Table + Blob)."""

from __future__ import annotations

import abc
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ..errors import BadRequest
from ._blob import BlobStore
from ._budget import Health
from ._port import Port
from ._table import Table

__all__ = [
    "ACCOUNT_ENV",
    "BLOB_ENDPOINT_ENV",
    "CONNECTION_STRING_ENV",
    "DEFAULT_STORAGE",
    "ENDPOINT_SUFFIX_ENV",
    "TABLE_ENDPOINT_ENV",
    "AzureStorage",
    "LocalStorage",
    "Storage",
    "open_storage",
]

DEFAULT_STORAGE = "local:.rallypoint"

# The variables open_storage reads for ``azure``; an argument wins over its variable.
#: An account connection string (``AccountKey=``); it names its own endpoints.
CONNECTION_STRING_ENV = "AZURE_STORAGE_CONNECTION_STRING"
#: Without a connection string: the account, with DefaultAzureCredential.
ACCOUNT_ENV = "AZURE_STORAGE_ACCOUNT"
#: With the account: the table and blob services' URLs (private endpoints, custom
#: domains), and the suffix of the default ones (sovereign clouds).
TABLE_ENDPOINT_ENV = "AZURE_STORAGE_TABLE_ENDPOINT"
BLOB_ENDPOINT_ENV = "AZURE_STORAGE_BLOB_ENDPOINT"
ENDPOINT_SUFFIX_ENV = "AZURE_STORAGE_ENDPOINT_SUFFIX"
_Part = TypeVar("_Part", Table, BlobStore)
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


def _endpoint(setting: str, url: str | None) -> str | None:
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
        raise BadRequest(
            f"{setting} {url!r} must be a service URL such as "
            "https://ACCOUNT.blob.core.windows.net (http only for an emulator; no query: "
            "a SAS in it would not be used)"
        )
    return url.rstrip("/")


def _what_signs(connection_string: str | None, credential: Any) -> str:
    """What credentials are there that sign nothing, for the error that refuses them."""
    if connection_string:
        keys = {part.split("=", 1)[0].strip().lower() for part in connection_string.split(";")}
        if "sharedaccesssignature" in keys:
            return "a shared access signature (SharedAccessSignature=) and no AccountKey"
        return "no AccountKey"
    return f"a {type(credential).__name__}, neither a key nor a token credential"


def _suffix(suffix: str) -> str:
    suffix = suffix.strip(".")
    if not re.fullmatch(r"[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+", suffix):
        raise BadRequest(
            f"{ENDPOINT_SUFFIX_ENV} {suffix!r} must be a DNS suffix such as core.windows.net"
        )
    return suffix


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
        #: What this process last heard from the backend (readiness, the breaker).
        self.health = Health()

    def table(self, name: str) -> Table:
        """The table ``name``, created on first use."""
        return self._once(self._tables, name, lambda: self._open_table(f"{self.prefix}{name}"))

    def blobs(self, name: str) -> BlobStore:
        """The blob container ``name``, created on first use."""
        return self._once(self._blobs, name, lambda: self._open_blobs(f"{self.prefix}-{name}"))

    def _once(self, opened: dict[str, _Part], name: str, open_: Callable[[], _Part]) -> _Part:
        # Under the lock: two threads asking for a new name at once open it once.
        _check_names(self.prefix, name)
        with self._lock:
            if name not in opened:
                opened[name] = open_()
            return opened[name]

    def ping(self) -> None:
        """Checks that every opened table and container answers.

        Raises:
            StorageUnavailable: One does not.
        """
        for opened in self._opened():
            opened.ping()

    def close(self) -> None:
        """Closes every table and container opened."""
        for opened in self._opened():
            opened.close()
        self._tables.clear()
        self._blobs.clear()

    def _opened(self) -> list[Port]:
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
    """Azure Table + Blob storage, by connection string or by account and credential.

    The coordinator signs a SAS for each checkpoint object it hands out, so it needs an
    account key (in the connection string, or an ``AzureNamedKeyCredential``) or a token
    credential (managed identity: user delegation SAS). An account SAS cannot sign one
    and is refused: handing it out would grant the whole account.

    Args:
        prefix: The deployment prefix of table and container names.
        connection_string: An account connection string (Azurite's too); it names its
            own endpoints (``TableEndpoint=``, ``BlobEndpoint=``, ``EndpointSuffix=``).
        account: The account name, for DefaultAzureCredential (managed identity,
            workload identity, ``az login``) when there is no connection string.
        credential: Another credential to use with ``account``: an azure-identity one,
            or an ``AzureNamedKeyCredential`` of the account's name and key.
        table_endpoint: With ``account``: the table service's URL, for private
            endpoints and custom domains.
        blob_endpoint: With ``account``: the blob service's URL.
        endpoint_suffix: With ``account``: the DNS suffix of the default endpoints
            (``core.windows.net``; ``core.chinacloudapi.cn``, ``core.usgovcloudapi.net``
            in sovereign clouds).

    Raises:
        BadRequest: No credentials, endpoints without an account, a malformed endpoint
            or connection string, or credentials that cannot sign per-object URLs.
    """

    backend = "azure"

    def __init__(
        self,
        prefix: str = "rp",
        *,
        connection_string: str | None = None,
        account: str | None = None,
        credential: Any = None,
        table_endpoint: str | None = None,
        blob_endpoint: str | None = None,
        endpoint_suffix: str | None = None,
    ) -> None:
        super().__init__(prefix)
        from azure.data.tables import TableServiceClient
        from azure.storage.blob import BlobServiceClient

        from ._azure_transport import blob_options as budgeted_blobs
        from ._azure_transport import table_options

        overrides = {
            TABLE_ENDPOINT_ENV: table_endpoint,
            BLOB_ENDPOINT_ENV: blob_endpoint,
            ENDPOINT_SUFFIX_ENV: endpoint_suffix,
        }
        given = ", ".join(name for name, value in overrides.items() if value)

        # 8 MiB blocks: Azure's throughput per request levels off around there.
        blob_options: dict[str, Any] = {
            "max_block_size": 8 << 20,
            "max_single_put_size": 8 << 20,
            **budgeted_blobs(self.health),
        }
        tables = table_options(self.health)
        try:
            if connection_string:
                if given:
                    raise BadRequest(
                        f"{given} apply with {ACCOUNT_ENV}; with {CONNECTION_STRING_ENV} put "
                        "TableEndpoint=, BlobEndpoint= or EndpointSuffix= in the connection string"
                    )
                setting = CONNECTION_STRING_ENV
                self._tables_client = TableServiceClient.from_connection_string(
                    connection_string, **tables
                )
                self._blob_client = BlobServiceClient.from_connection_string(
                    connection_string, **blob_options
                )
                fields = dict(
                    part.split("=", 1) for part in connection_string.split(";") if "=" in part
                )
                self._where = fields.get("AccountName", "connection string")
            elif account:
                setting = ACCOUNT_ENV
                suffix = _suffix(endpoint_suffix or "core.windows.net")
                if credential is None:
                    from azure.identity import DefaultAzureCredential

                    credential = DefaultAzureCredential()
                self._tables_client = TableServiceClient(
                    _endpoint(TABLE_ENDPOINT_ENV, table_endpoint)
                    or f"https://{account}.table.{suffix}",
                    credential=credential,
                    **tables,
                )
                self._blob_client = BlobServiceClient(
                    _endpoint(BLOB_ENDPOINT_ENV, blob_endpoint)
                    or f"https://{account}.blob.{suffix}",
                    credential=credential,
                    **blob_options,
                )
                self._where = account
            elif given:
                raise BadRequest(f"{given} need {ACCOUNT_ENV}, the account's name")
            else:
                raise BadRequest(
                    f"azure storage needs {CONNECTION_STRING_ENV}, or {ACCOUNT_ENV} "
                    "for a managed identity"
                )
        except ValueError as exc:  # the SDKs' word for a malformed setting
            raise BadRequest(f"azure storage: {exc}") from exc
        signer = self._blob_client.credential
        # A shared key (from AccountKey=, or an AzureNamedKeyCredential) signs service
        # SAS; a token credential gets user delegation keys to sign them.
        self._account_key: str | None = getattr(signer, "account_key", None)
        self._account_name = str(getattr(signer, "account_name", None) or account or "")
        if not self._account_key and not hasattr(signer, "get_token"):
            self.close()
            raise BadRequest(
                f"{setting} gives {_what_signs(connection_string, credential)}: the "
                "coordinator signs a SAS for each checkpoint object it hands out, which these "
                "credentials cannot (and handing them out would grant all they grant). Use an "
                f"account key connection string (AccountKey=), or {ACCOUNT_ENV} with a managed "
                "identity, which signs with user delegation keys (roles: deploy/README.md)"
            )

    def describe(self) -> str:
        return f"azure:{self._where}"

    def _open_table(self, name: str) -> Table:
        from ._azure_errors import storage_errors
        from ._azure_table import AzureTable

        with storage_errors(f"table {name}"):
            return AzureTable(self._tables_client.create_table_if_not_exists(name))

    def _open_blobs(self, name: str) -> BlobStore:
        from ._azure_blob import AzureBlobStore

        return AzureBlobStore(
            self._blob_client, name, self._account_key, account_name=self._account_name or None
        )

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
        account: For ``azure`` with a managed identity; defaults to ``AZURE_STORAGE_ACCOUNT``,
            and its endpoints to ``AZURE_STORAGE_TABLE_ENDPOINT``,
            ``AZURE_STORAGE_BLOB_ENDPOINT`` and ``AZURE_STORAGE_ENDPOINT_SUFFIX``.

    Raises:
        BadRequest: The spec names no known backend, or azure lacks usable credentials
            (see :class:`AzureStorage`).
    """
    kind, _, rest = spec.partition(":")
    if kind == "local":
        return LocalStorage(rest or ".rallypoint", prefix)
    if kind == "azure" and not rest:
        return AzureStorage(
            prefix,
            connection_string=connection_string or os.environ.get(CONNECTION_STRING_ENV),
            account=account or os.environ.get(ACCOUNT_ENV),
            table_endpoint=os.environ.get(TABLE_ENDPOINT_ENV),
            blob_endpoint=os.environ.get(BLOB_ENDPOINT_ENV),
            endpoint_suffix=os.environ.get(ENDPOINT_SUFFIX_ENV),
        )
    raise BadRequest(f"storage {spec!r} is neither 'local:PATH' nor 'azure'")
