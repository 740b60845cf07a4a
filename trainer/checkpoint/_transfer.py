"""Moving bytes through the signed URLs the coordinator hands out.

``https://`` URLs are Azure SAS URLs, used through azure-storage-blob so large objects
go up in parallel blocks; ``file://`` URLs are the local backend's signed paths.

Write URLs live minutes (the coordinator's write-URL lifetime), less than a large
upload may take: :func:`upload_parts` takes a :class:`UrlSource`, asked before every
request (it renews ahead of expiry) and once more after a refusal. Blocks already
staged in Azure stay staged under the renewed URL; a local write is one request, whose
URL is checked when it starts and, for revocation only, before the object appears.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeVar, cast

import torch

from rallypoint.azure_errors import Failure, translated
from rallypoint.client.errors import SignedUrlError
from rallypoint.localfs import SourceError, pin, verify_file_url, write_atomically

from .._bytes import as_memoryview, map_private
from .._progress import Progress
from ..errors import TransferDenied, TransferError, TransferNotFound

if TYPE_CHECKING:
    from azure.storage.blob import BlobClient

__all__ = ["UrlSource", "download", "read_object", "read_range", "upload", "upload_parts"]

_PARALLEL = 8
_CHUNK = 8 << 20
T = TypeVar("T")


class UrlSource(Protocol):
    """Gives the write URL of one object, valid now: called before each request, and
    with ``renew=True`` once after storage refused a URL it gave (expired, or closed)."""

    def __call__(self, *, renew: bool = False) -> str: ...


def _fixed(url: str) -> UrlSource:
    def source(*, renew: bool = False) -> str:
        return url  # nothing to renew from: a refusal stands

    return source


def _redacted(url: str) -> str:
    return url.split("?", 1)[0]  # never log a SAS token


#: The transfer error for each code of :data:`rallypoint.azure_errors.CODES`; any other
#: code is a :class:`TransferError`.
_ERRORS: dict[str, type[TransferError]] = {
    error.code: error for error in (TransferDenied, TransferNotFound)
}


def _transfer_error(what: str, failure: Failure) -> TransferError:
    if failure.lease == "held":
        # The coordinator leases a version's objects when it commits or collects it.
        return TransferDenied(f"{what}: its version is closed to writes ({failure.detail})")
    return _ERRORS.get(failure.code, TransferError)(f"{what}: {failure.detail}")


def _azure(url: str) -> contextlib.AbstractContextManager[None]:
    """Raises the transfer error for an Azure SDK exception raised inside, ``from`` it."""
    return translated(_redacted(url), _transfer_error)


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
            root, path = verify_file_url(url, "w")
            started = time.time()
            write_atomically(root, path, data, if_absent=False, check=_still(url, started))
        except SourceError as exc:
            raise exc.__cause__ from None  # type: ignore[misc]
        except SignedUrlError as exc:
            raise TransferDenied(f"{_redacted(url)}: {exc.message}") from exc
        except OSError as exc:
            raise TransferError(f"{_redacted(url)}: {exc}") from exc
        return
    from azure.storage.blob import BlobClient

    with (
        _azure(url),
        BlobClient.from_blob_url(url, max_block_size=_CHUNK, max_single_put_size=_CHUNK) as blob,
    ):
        blob.upload_blob(cast(Any, data), length=length, overwrite=True, max_concurrency=_PARALLEL)


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
    from azure.storage.blob import BlobClient

    with _azure(url), BlobClient.from_blob_url(url) as blob:
        return bytes(blob.download_blob(max_concurrency=_PARALLEL).readall())


def _still(url: str, started: float) -> Callable[[], object]:
    """The check a local write makes before its object appears: the URL as it was when
    the write began, so only a revocation since (a commit, a collection) refuses it."""
    return lambda: verify_file_url(url, "w", now=started)


def upload_parts(
    url: str | UrlSource, parts: Sequence[memoryview], progress: Progress | None = None
) -> None:
    """Writes the concatenation of ``parts`` as one object through a signed write URL.

    Azure gets 8 MiB blocks staged in parallel straight from the buffers; local
    storage gets one sequential, fsynced write.

    Args:
        url: The URL, or a source that renews it (see :class:`UrlSource`).
        parts: The object's bytes, in order.
        progress: Counts the bytes written.

    Raises:
        TransferDenied: The URL does not grant writing, even renewed.
        TransferError: Storage failed.
    """
    source = _fixed(url) if isinstance(url, str) else url
    first = source()
    if first.startswith("file:"):
        _write_local(source, first, parts, progress)
    else:
        _write_blocks(source, first, parts, progress)


def _write_local(
    source: UrlSource, url: str, parts: Sequence[memoryview], progress: Progress | None
) -> None:
    try:
        try:
            root, path = verify_file_url(url, "w")
        except SignedUrlError:
            url = source(renew=True)
            root, path = verify_file_url(url, "w")
        on_write = progress.update if progress is not None else None
        check = _still(url, time.time())
        write_atomically(root, path, parts, if_absent=False, on_write=on_write, check=check)
    except SignedUrlError as exc:
        raise TransferDenied(f"{_redacted(url)}: {exc.message}") from exc
    except OSError as exc:
        raise TransferError(f"{_redacted(url)}: {exc}") from exc


class _Clients:
    """A client for the URL the source gives now: a renewed URL gets a client of its
    own, and takes over for the requests still to come."""

    def __init__(self, source: UrlSource, url: str) -> None:
        self._source = source
        self._lock = threading.Lock()
        self._opened: list[BlobClient] = []
        self._url = ""
        self._open(url)

    def _open(self, url: str) -> None:
        from azure.storage.blob import BlobClient

        self._url = url
        self._opened.append(BlobClient.from_blob_url(url))

    def current(self) -> tuple[int, BlobClient]:
        """The client to use, and its number (for :meth:`renew`)."""
        with self._lock:
            url = self._source()
            if url != self._url:
                self._open(url)
            return len(self._opened), self._opened[-1]

    def renew(self, refused: int) -> None:
        """Asks for a new URL after client ``refused``'s was refused, unless another
        request did since (parallel blocks are refused together)."""
        with self._lock:
            if refused == len(self._opened):
                self._open(self._source(renew=True))

    def call(self, action: Callable[[BlobClient], T]) -> T:
        """Runs ``action`` with the current client; once more, renewed, if refused."""
        number, client = self.current()
        try:
            with _azure(self._url):
                return action(client)
        except TransferDenied:
            pass  # expired, or closed: once more, under a renewed URL
        self.renew(number)
        _, client = self.current()
        with _azure(self._url):
            return action(client)

    def close(self) -> None:
        for client in self._opened:
            client.close()


def _write_blocks(
    source: UrlSource, url: str, parts: Sequence[memoryview], progress: Progress | None
) -> None:
    from azure.storage.blob import BlobBlock

    blocks = _blocks(parts)
    clients = _Clients(source, url)
    try:
        if len(blocks) <= 1:
            data = blocks[0]() if blocks else b""
            clients.call(lambda blob: blob.upload_blob(data, overwrite=True))
            if progress is not None:
                progress.update(len(data))
            return
        ids = [base64.b64encode(f"{i:08d}".encode()).decode() for i in range(len(blocks))]

        def stage(i: int) -> None:
            data = blocks[i]()
            # Blocks are the blob's, not the URL's: those staged before a renewal stay.
            clients.call(lambda blob: blob.stage_block(ids[i], data, length=len(data)))
            if progress is not None:
                progress.update(len(data))

        with ThreadPoolExecutor(_PARALLEL) as pool:
            list(pool.map(stage, range(len(blocks))))
        clients.call(lambda blob: blob.commit_block_list([BlobBlock(block_id=i) for i in ids]))
    finally:
        clients.close()


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
                pin(f.fileno())  # the mapping keeps the lock: storage never reuses the file
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
    from azure.storage.blob import BlobClient

    buffer = torch.empty(length, dtype=torch.uint8)
    seen = 0

    def hook(current: int, total: int | None) -> None:
        nonlocal seen
        if progress is not None and current > seen:
            progress.update(current - seen)
            seen = current

    with _azure(url), BlobClient.from_blob_url(url) as blob:
        stream = blob.download_blob(
            offset,
            None if offset is None else length,
            max_concurrency=_PARALLEL,
            progress_hook=hook,
        )
        if stream.size != length:
            return buffer[: min(length, stream.size)]  # the caller reports the mismatch
        stream.readinto(cast(BinaryIO, _Into(as_memoryview(buffer))))
    return buffer
