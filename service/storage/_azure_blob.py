"""The Azure Blob storage adapter (azure-storage-blob); also runs against Azurite."""

from __future__ import annotations

import contextlib
import io
import os
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any, cast

from azure.core.exceptions import AzureError, HttpResponseError, ResourceExistsError
from azure.storage.blob import (
    BlobLeaseClient,
    BlobProperties,
    BlobSasPermissions,
    BlobServiceClient,
    UserDelegationKey,
    generate_blob_sas,
)

from rallypoint.azure_errors import azure_code, lease_failure

from ..errors import NotFound
from ._azure_errors import storage_errors
from ._blob import Access, BlobInfo, BlobStore, Data

__all__ = ["PARALLEL_TRANSFERS", "AzureBlobStore"]

#: Concurrent block uploads and range downloads per object.
PARALLEL_TRANSFERS = 8
# SAS start times lie a little in the past: the trainer's clock may be behind storage's.
_CLOCK_SKEW = timedelta(minutes=5)
# Names the leases _revoke takes (uuid5 of the container and blob names).
_LEASES = uuid.UUID("5f0a7c52-8a52-4b8e-9a43-3c6f1e0d2b71")


def _info(props: BlobProperties) -> BlobInfo:
    return BlobInfo(props.name, props.size, props.etag, props.last_modified.timestamp())


def _length_of(data: Data, length: int | None) -> int | None:
    """The byte count the SDK needs to upload a file object in parallel blocks."""
    if length is not None or isinstance(data, (bytes, bytearray, memoryview)):
        return len(data) if length is None else length  # type: ignore[arg-type]
    try:
        return os.fstat(data.fileno()).st_size - data.tell()
    except (AttributeError, OSError, io.UnsupportedOperation):
        pass
    try:
        if data.seekable():
            here = data.tell()
            end = data.seek(0, io.SEEK_END)
            data.seek(here)
            return end - here
    except (AttributeError, OSError):
        pass
    return None


def _in_memory(data: Data) -> bool:
    return isinstance(data, (bytes, bytearray, memoryview))


def _position(data: Data) -> int | None:
    """Where a seekable file object stands, to send it again; None otherwise."""
    if _in_memory(data):
        return None
    with contextlib.suppress(AttributeError, OSError, io.UnsupportedOperation):
        if data.seekable():  # type: ignore[union-attr]
            return int(data.tell())  # type: ignore[union-attr]
    return None


class AzureBlobStore(BlobStore):
    """See base class.

    Args:
        service: The account's client.
        container: The container's name; it is created if missing.
        account_key: The account key, to sign SAS URLs; without it, URLs carry a user
            delegation SAS, which needs the identity to hold "Storage Blob Delegator".
        account_name: The account SAS URLs are signed for; by default the one the SDK
            reads from the endpoint, which a custom domain does not name.
    """

    def __init__(
        self,
        service: BlobServiceClient,
        container: str,
        account_key: str | None,
        *,
        account_name: str | None = None,
    ) -> None:
        self.name = container
        self._service = service
        self._container = service.get_container_client(container)
        with storage_errors(f"container {container}"):
            try:
                if not self._container.exists():
                    self._container.create_container()
            except ResourceExistsError as exc:
                # Created since by another replica: fine; being deleted: not.
                if azure_code(exc) != "ContainerAlreadyExists":
                    raise
        self._account_key = account_key
        self._account_name = account_name or self._container.account_name
        self._delegation: UserDelegationKey | None = None
        self._delegation_expiry = datetime.min.replace(tzinfo=timezone.utc)
        self._lock = threading.Lock()

    def _put(self, name: str, data: Data, if_absent: bool, length: int | None) -> BlobInfo:
        at = _position(data)
        length = _length_of(data, length)
        with storage_errors(f"put blob {name!r}"):
            try:
                return self._upload(name, data, if_absent, length)
            except AzureError as exc:
                # A revoked scope's object (see _revoke): the coordinator itself may still
                # write it, if the data can be sent again.
                if lease_failure(exc) != "held" or (at is None and not _in_memory(data)):
                    raise
            self._break_lease(name)
            if at is not None:
                data.seek(at)  # type: ignore[union-attr]
            return self._upload(name, data, if_absent, length)

    def _upload(self, name: str, data: Data, if_absent: bool, length: int | None) -> BlobInfo:
        meta = self._container.get_blob_client(name).upload_blob(
            cast(Any, data),
            length=length,
            overwrite=not if_absent,
            max_concurrency=PARALLEL_TRANSFERS,
        )
        if length is None:
            return self._info(name)
        return BlobInfo(name, length, meta["etag"], meta["last_modified"].timestamp())

    def _get(self, name: str, offset: int, length: int | None) -> bytes:
        if length == 0:
            return b""
        with storage_errors(f"get blob {name!r}"):
            try:
                downloader = self._container.download_blob(
                    name, offset=offset, length=length, max_concurrency=PARALLEL_TRANSFERS
                )
                return downloader.readall()
            except HttpResponseError as exc:
                if exc.status_code != 416:
                    raise
        self.info(name)  # a range past the end of an object reads as empty, as locally
        return b""

    def _stream(self, name: str, chunk_size: int) -> Iterator[bytes]:
        what = f"get blob {name!r}"
        with storage_errors(what):
            # The first request goes out here, so NotFound comes before the first chunk.
            downloader = self._container.download_blob(name, max_concurrency=PARALLEL_TRANSFERS)

        def chunks() -> Iterator[bytes]:
            with storage_errors(what):
                for piece in downloader.chunks():
                    if len(piece) <= chunk_size:
                        yield piece
                        continue
                    view = memoryview(piece)  # only the first piece can be larger
                    for start in range(0, len(view), chunk_size):
                        yield bytes(view[start : start + chunk_size])

        return chunks()

    def _info(self, name: str) -> BlobInfo:
        with storage_errors(f"blob {name!r}"):
            return _info(self._container.get_blob_client(name).get_blob_properties())

    def _list(self, prefix: str) -> Iterator[BlobInfo]:
        with storage_errors(f"list {prefix!r}"):
            for props in self._container.list_blobs(name_starts_with=prefix or None):
                yield _info(props)

    def _delete(self, name: str) -> None:
        with storage_errors(f"delete blob {name!r}"):
            try:
                # What the coordinator deletes is mostly a revoked scope's (checkpoints are
                # revoked at their commit): naming the lease saves breaking it.
                self._container.delete_blob(name, lease=self._lease_id(name))
                return
            except AzureError as exc:
                failure = lease_failure(exc)
                if failure is None:
                    raise
            if failure == "held":  # a lease of someone else's
                self._break_lease(name)
            self._container.delete_blob(name)

    def _lease_id(self, name: str) -> str:
        """The lease :meth:`_revoke` takes on ``name``: the same on every replica, so any
        of them deletes the object in one request. Knowing it lets a SAS write, as
        breaking the lease would: a lease stops mistakes, not a hostile SAS holder."""
        return str(uuid.uuid5(_LEASES, f"{self.name}/{name}"))

    def _break_lease(self, name: str) -> None:
        """Raises the SDK's error: the callers translate it."""
        BlobLeaseClient(self._container.get_blob_client(name)).break_lease(lease_break_period=0)

    def _revoke(self, scope: str) -> None:
        # A SAS cannot be revoked one by one (a stored access policy revokes every URL
        # that names it, and a container holds 5; a user delegation key, every URL it
        # signed). A blob with a lease refuses every write that does not name the lease,
        # trainers' uploads included (412 LeaseIdMissing), so the scope's objects get
        # an infinite one; only the coordinator uses it, to delete them.
        def lease(name: str) -> None:
            # NotFound: deleted meanwhile, nothing to hold.
            with contextlib.suppress(NotFound), storage_errors(f"lease blob {name!r}"):
                try:
                    self._container.get_blob_client(name).acquire_lease(
                        lease_duration=-1, lease_id=self._lease_id(name)
                    )
                except AzureError as exc:
                    if lease_failure(exc) != "held":  # held: refuses writes already
                        raise

        names = [info.name for info in self._list(scope)]
        if not names:
            return
        with ThreadPoolExecutor(min(PARALLEL_TRANSFERS, len(names))) as pool:
            list(pool.map(lease, names))

    def _user_delegation_key(self, expiry: datetime) -> UserDelegationKey:
        with self._lock:
            if self._delegation is None or self._delegation_expiry < expiry:
                now = datetime.now(timezone.utc)
                # One key serves every URL for a week; Azure caps keys at 7 days.
                self._delegation_expiry = now + timedelta(days=7) - _CLOCK_SKEW
                with storage_errors("user delegation key for SAS"):
                    self._delegation = self._service.get_user_delegation_key(
                        now - _CLOCK_SKEW, self._delegation_expiry
                    )
            return self._delegation

    def _sign(self, name: str, access: Access, expiry: int, scope: str | None = None) -> str:
        # ``scope`` needs nothing in the SAS: _revoke acts on the objects themselves.
        expires = datetime.fromtimestamp(expiry, timezone.utc)
        permission = (
            BlobSasPermissions(create=True, write=True)
            if access == "write"
            else BlobSasPermissions(read=True)
        )
        key: dict[str, Any] = (
            {"account_key": self._account_key}
            if self._account_key
            else {"user_delegation_key": self._user_delegation_key(expires)}
        )
        sas = generate_blob_sas(
            self._account_name,
            self.name,
            name,
            permission=permission,
            expiry=expires,
            start=datetime.now(timezone.utc) - _CLOCK_SKEW,
            **key,
        )
        return f"{self._container.get_blob_client(name).url}?{sas}"

    def ping(self) -> None:
        with storage_errors(f"container {self.name}"):
            self._container.get_container_properties()

    def close(self) -> None:
        self._container.close()
