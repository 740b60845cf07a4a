"""Moving bytes through the signed URLs the coordinator hands out.

``https://`` URLs are Azure SAS URLs, used through azure-storage-blob so large objects
go up in parallel blocks; ``file://`` URLs are the local backend's signed paths.
"""

from __future__ import annotations

from typing import Any, BinaryIO, cast

from rallypoint.client._fileurl import SourceError, verify_file_url, write_atomically
from rallypoint.client.errors import SignedUrlError

from .errors import TransferDenied, TransferError, TransferNotFound

__all__ = ["download", "upload"]

_PARALLEL = 8
_CHUNK = 8 << 20


def _redacted(url: str) -> str:
    return url.split("?", 1)[0]  # never log a SAS token


def _azure_error(exc: Exception, url: str) -> TransferError:
    status = getattr(exc, "status_code", None)
    kind = {403: TransferDenied, 404: TransferNotFound}.get(status or 0, TransferError)
    detail = str(getattr(exc, "message", None) or exc).splitlines()[0]
    return kind(f"{_redacted(url)}: {detail}")


def upload(
    url: str, data: bytes | bytearray | memoryview | BinaryIO, *, length: int | None = None
) -> None:
    """Writes an object through a signed write URL, replacing any old one.

    Raises:
        TransferDenied: The URL does not grant writing (expired, altered, read-only).
        TransferError: Storage failed.
    """
    if url.startswith("file:"):
        try:
            store, path = verify_file_url(url, "w")
            write_atomically(store, path, data, if_absent=False)
        except SourceError as exc:
            raise exc.__cause__ from None  # type: ignore[misc]
        except SignedUrlError as exc:
            raise TransferDenied(f"{_redacted(url)}: {exc.message}") from exc
        except OSError as exc:
            raise TransferError(f"{_redacted(url)}: {exc}") from exc
        return
    from azure.core.exceptions import AzureError
    from azure.storage.blob import BlobClient

    try:
        with BlobClient.from_blob_url(
            url, max_block_size=_CHUNK, max_single_put_size=_CHUNK
        ) as blob:
            blob.upload_blob(
                cast(Any, data), length=length, overwrite=True, max_concurrency=_PARALLEL
            )
    except AzureError as exc:
        raise _azure_error(exc, url) from exc


def download(url: str) -> bytes:
    """Reads a whole object through a signed read URL.

    Raises:
        TransferDenied: The URL does not grant reading.
        TransferNotFound: The object does not exist.
        TransferError: Storage failed.
    """
    if url.startswith("file:"):
        try:
            _, path = verify_file_url(url, "r")
            return path.read_bytes()
        except SignedUrlError as exc:
            raise TransferDenied(f"{_redacted(url)}: {exc.message}") from exc
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise TransferNotFound(f"{_redacted(url)}: no such object") from exc
        except OSError as exc:
            raise TransferError(f"{_redacted(url)}: {exc}") from exc
    from azure.core.exceptions import AzureError
    from azure.storage.blob import BlobClient

    try:
        with BlobClient.from_blob_url(url) as blob:
            return bytes(blob.download_blob(max_concurrency=_PARALLEL).readall())
    except AzureError as exc:
        raise _azure_error(exc, url) from exc
