"""The Azure Blob storage adapter (azure-storage-blob); also runs against Azurite."""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any, cast

from azure.core.exceptions import AzureError, HttpResponseError
from azure.storage.blob import (
    BlobProperties,
    BlobSasPermissions,
    BlobServiceClient,
    UserDelegationKey,
    generate_blob_sas,
)

from ._azure_errors import translate
from ._blob import Access, BlobInfo, BlobStore, Data

__all__ = ["PARALLEL_TRANSFERS", "AzureBlobStore"]

#: Concurrent block uploads and range downloads per object.
PARALLEL_TRANSFERS = 8
# SAS start times lie a little in the past: the trainer's clock may be behind storage's.
_CLOCK_SKEW = timedelta(minutes=5)


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


class AzureBlobStore(BlobStore):
    """See base class.

    Args:
        service: The account's client.
        container: The container's name; it is created if missing.
        account_key: The account key, to sign SAS URLs; without it, URLs carry a user
            delegation SAS, which needs the identity to hold "Storage Blob Delegator".
    """

    def __init__(self, service: BlobServiceClient, container: str, account_key: str | None) -> None:
        self.name = container
        self._service = service
        self._container = service.get_container_client(container)
        try:
            if not self._container.exists():
                self._container.create_container()
        except AzureError as exc:
            if getattr(exc, "error_code", None) != "ContainerAlreadyExists":
                raise translate(exc, f"container {container}") from exc
        self._account_key = account_key
        self._delegation: UserDelegationKey | None = None
        self._delegation_expiry = datetime.min.replace(tzinfo=timezone.utc)
        self._lock = threading.Lock()

    def _put(self, name: str, data: Data, if_absent: bool, length: int | None) -> BlobInfo:
        length = _length_of(data, length)
        try:
            meta = self._container.get_blob_client(name).upload_blob(
                cast(Any, data),
                length=length,
                overwrite=not if_absent,
                max_concurrency=PARALLEL_TRANSFERS,
            )
            if length is None:
                return self._info(name)
        except AzureError as exc:
            raise translate(exc, f"put blob {name!r}") from exc
        return BlobInfo(name, length, meta["etag"], meta["last_modified"].timestamp())

    def _get(self, name: str, offset: int, length: int | None) -> bytes:
        if length == 0:
            return b""
        try:
            downloader = self._container.download_blob(
                name, offset=offset, length=length, max_concurrency=PARALLEL_TRANSFERS
            )
            return downloader.readall()
        except HttpResponseError as exc:
            if exc.status_code == 416:  # a range past the end reads as empty, as locally
                self.info(name)
                return b""
            raise translate(exc, f"get blob {name!r}") from exc
        except AzureError as exc:
            raise translate(exc, f"get blob {name!r}") from exc

    def _stream(self, name: str, chunk_size: int) -> Iterator[bytes]:
        try:
            # The first request goes out here, so NotFound comes before the first chunk.
            downloader = self._container.download_blob(name, max_concurrency=PARALLEL_TRANSFERS)
        except AzureError as exc:
            raise translate(exc, f"get blob {name!r}") from exc

        def chunks() -> Iterator[bytes]:
            try:
                for piece in downloader.chunks():
                    if len(piece) <= chunk_size:
                        yield piece
                        continue
                    view = memoryview(piece)  # only the first piece can be larger
                    for start in range(0, len(view), chunk_size):
                        yield bytes(view[start : start + chunk_size])
            except AzureError as exc:
                raise translate(exc, f"get blob {name!r}") from exc

        return chunks()

    def _info(self, name: str) -> BlobInfo:
        try:
            return _info(self._container.get_blob_client(name).get_blob_properties())
        except AzureError as exc:
            raise translate(exc, f"blob {name!r}") from exc

    def _list(self, prefix: str) -> Iterator[BlobInfo]:
        try:
            for props in self._container.list_blobs(name_starts_with=prefix or None):
                yield _info(props)
        except AzureError as exc:
            raise translate(exc, f"list {prefix!r}") from exc

    def _delete(self, name: str) -> None:
        try:
            self._container.delete_blob(name)
        except AzureError as exc:
            raise translate(exc, f"delete blob {name!r}") from exc

    def _user_delegation_key(self, expiry: datetime) -> UserDelegationKey:
        with self._lock:
            if self._delegation is None or self._delegation_expiry < expiry:
                now = datetime.now(timezone.utc)
                # One key serves every URL for a week; Azure caps keys at 7 days.
                self._delegation_expiry = now + timedelta(days=7) - _CLOCK_SKEW
                try:
                    self._delegation = self._service.get_user_delegation_key(
                        now - _CLOCK_SKEW, self._delegation_expiry
                    )
                except AzureError as exc:
                    raise translate(exc, "user delegation key for SAS") from exc
            return self._delegation

    def _sign(self, name: str, access: Access, expiry: int) -> str:
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
            self._container.account_name,
            self.name,
            name,
            permission=permission,
            expiry=expires,
            start=datetime.now(timezone.utc) - _CLOCK_SKEW,
            **key,
        )
        return f"{self._container.get_blob_client(name).url}?{sas}"

    def ping(self) -> None:
        try:
            self._container.get_container_properties()
        except AzureError as exc:
            raise translate(exc, f"container {self.name}") from exc

    def destroy(self) -> None:
        """Deletes the container and everything in it (tests and benchmarks)."""
        try:
            self._container.delete_container()
        except AzureError as exc:
            raise translate(exc, f"container {self.name}") from exc

    def close(self) -> None:
        self._container.close()
