"""Moving bytes through the signed URLs the coordinator hands out.

``https://`` URLs are Azure SAS URLs, used through azure-storage-blob so large objects
go up in parallel blocks; ``file://`` URLs are the local backend's signed paths.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, cast

import torch

from rallypoint.client._fileurl import SourceError, verify_file_url, write_atomically
from rallypoint.client._recycle import pin
from rallypoint.client.errors import SignedUrlError

from ._bytes import as_memoryview, map_private
from ._progress import Progress
from .errors import TransferDenied, TransferError, TransferNotFound

__all__ = ["download", "read_object", "read_range", "upload", "upload_parts"]

_PARALLEL = 8
_CHUNK = 8 << 20


def _redacted(url: str) -> str:
    return url.split("?", 1)[0]  # never log a SAS token


def _azure_error(exc: Exception, url: str) -> TransferError:
    status = getattr(exc, "status_code", None)
    kind = {403: TransferDenied, 404: TransferNotFound}.get(status or 0, TransferError)
    detail = str(getattr(exc, "message", None) or exc).splitlines()[0]
    return kind(f"{_redacted(url)}: {detail}")


@contextlib.contextmanager
def _reading(url: str) -> Iterator[None]:
    """Translates what reading a local object through a signed URL may raise."""
    try:
        yield
    except SignedUrlError as exc:
        raise TransferDenied(f"{_redacted(url)}: {exc.message}") from exc
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise TransferNotFound(f"{_redacted(url)}: no such object") from exc
    except OSError as exc:
        raise TransferError(f"{_redacted(url)}: {exc}") from exc


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
        with _reading(url):
            _, path = verify_file_url(url, "r")
            return path.read_bytes()
    from azure.core.exceptions import AzureError
    from azure.storage.blob import BlobClient

    try:
        with BlobClient.from_blob_url(url) as blob:
            return bytes(blob.download_blob(max_concurrency=_PARALLEL).readall())
    except AzureError as exc:
        raise _azure_error(exc, url) from exc


def upload_parts(url: str, parts: Sequence[memoryview], progress: Progress | None = None) -> None:
    """Writes the concatenation of ``parts`` as one object through a signed write URL.

    Azure gets 8 MiB blocks staged in parallel straight from the buffers; the local
    store gets one sequential, fsynced write.

    Raises:
        TransferDenied: The URL does not grant writing.
        TransferError: Storage failed.
    """
    if url.startswith("file:"):
        try:
            store, path = verify_file_url(url, "w")
            on_write = progress.update if progress is not None else None
            write_atomically(store, path, parts, if_absent=False, on_write=on_write)
        except SignedUrlError as exc:
            raise TransferDenied(f"{_redacted(url)}: {exc.message}") from exc
        except OSError as exc:
            raise TransferError(f"{_redacted(url)}: {exc}") from exc
        return
    from azure.core.exceptions import AzureError
    from azure.storage.blob import BlobBlock, BlobClient

    blocks = _blocks(parts)
    try:
        with BlobClient.from_blob_url(url) as blob:
            if len(blocks) <= 1:
                data = blocks[0]() if blocks else b""
                blob.upload_blob(data, overwrite=True)
                if progress is not None:
                    progress.update(len(data))
                return
            ids = [base64.b64encode(f"{i:08d}".encode()).decode() for i in range(len(blocks))]

            def stage(i: int) -> None:
                data = blocks[i]()
                blob.stage_block(ids[i], data, length=len(data))
                if progress is not None:
                    progress.update(len(data))

            with ThreadPoolExecutor(_PARALLEL) as pool:
                list(pool.map(stage, range(len(blocks))))
            blob.commit_block_list([BlobBlock(block_id=i) for i in ids])
    except AzureError as exc:
        raise _azure_error(exc, url) from exc


def _blocks(parts: Sequence[memoryview]) -> list[Callable[[], bytes]]:
    """``parts`` cut and joined into blocks of ``_CHUNK`` bytes, each built when staged:
    a checkpoint is many tensors, most far smaller than a block, and a request per tensor
    would cost a round trip each."""
    blocks: list[Callable[[], bytes]] = []
    pending: list[memoryview] = []
    filled = 0
    for part in parts:
        at = 0
        while at < len(part):
            piece = part[at : at + _CHUNK - filled]
            pending.append(piece)
            filled += len(piece)
            at += len(piece)
            if filled == _CHUNK:
                blocks.append(functools.partial(b"".join, pending))
                pending, filled = [], 0
    if pending:
        blocks.append(functools.partial(b"".join, pending))
    return blocks


class _Into:
    """A seekable file object writing into a buffer (parallel ranged downloads)."""

    def __init__(self, target: memoryview) -> None:
        self._target = target
        self._pos = 0

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._pos = offset if whence == os.SEEK_SET else self._pos + offset
        return self._pos

    def write(self, data: bytes | memoryview) -> int:
        end = self._pos + len(data)
        if end > len(self._target):
            raise TransferError(
                f"the object holds more than the {len(self._target)} bytes expected"
            )
        self._target[self._pos : end] = data
        self._pos = end
        return len(data)


def read_object(url: str, size: int, progress: Progress | None = None) -> torch.Tensor:
    """An object's bytes as a uint8 tensor, through a signed read URL.

    A local object is mapped copy-on-write (``MAP_PRIVATE``): nothing is copied, pages
    come from the page cache as they are read, and writing to the tensor never reaches
    the file. An Azure object is downloaded in parallel ranges into fresh memory.

    Args:
        url: The signed read URL.
        size: The bytes expected; the result may differ (the caller checks).
        progress: Counts downloaded bytes (Azure only: a mapping moves nothing).

    Raises:
        TransferDenied, TransferNotFound, TransferError: As for :func:`download`.
    """
    if url.startswith("file:"):
        with _reading(url):
            _, path = verify_file_url(url, "r")
            with open(path, "rb") as f:
                pin(f.fileno())  # the mapping keeps the lock: the store never reuses the file
                return map_private(f.fileno())
    return _azure_read(url, None, size, progress)


def read_range(
    url: str, offset: int, length: int, progress: Progress | None = None
) -> torch.Tensor:
    """Bytes ``offset .. offset + length`` of an object, as a uint8 tensor.

    A local object is mapped copy-on-write as in :func:`read_object` (only the pages
    read are read); an Azure object is downloaded in parallel ranges.

    Raises:
        TransferDenied, TransferNotFound, TransferError: As for :func:`download`.
    """
    if url.startswith("file:"):
        whole = read_object(url, offset + length, progress)
        return whole[offset : offset + length]
    if length == 0:
        return torch.empty(0, dtype=torch.uint8)
    return _azure_read(url, offset, length, progress)


def _azure_read(
    url: str, offset: int | None, length: int, progress: Progress | None
) -> torch.Tensor:
    """``length`` bytes from ``offset`` (the whole object if None) of an Azure object,
    downloaded in parallel ranges into fresh memory; fewer if the object is shorter."""
    from azure.core.exceptions import AzureError
    from azure.storage.blob import BlobClient

    buffer = torch.empty(length, dtype=torch.uint8)
    seen = 0

    def hook(current: int, total: int | None) -> None:
        nonlocal seen
        if progress is not None and current > seen:
            progress.update(current - seen)
            seen = current

    try:
        with BlobClient.from_blob_url(url) as blob:
            stream = blob.download_blob(
                offset,
                None if offset is None else length,
                max_concurrency=_PARALLEL,
                progress_hook=hook,
            )
            if stream.size != length:
                return buffer[: min(length, stream.size)]  # the caller reports the mismatch
            stream.readinto(cast(BinaryIO, _Into(as_memoryview(buffer))))
    except AzureError as exc:
        raise _azure_error(exc, url) from exc
    return buffer
