"""Signed ``file://`` URLs: the local backend's stand-in for Azure SAS URLs.

The embedded storage keeps blobs in a directory, so a trainer on the same machine reads
and writes them directly; the coordinator still decides *which* objects it may touch.
A URL names one object and carries its access, expiry and an HMAC over both, keyed by
a secret in the storage directory. It protects against bugs (a rank writing the wrong
version) rather than against an attacker who can read the storage directory anyway.

Format::

    file:///STORE/blobs/CONTAINER/NAME?sn=CONTAINER/NAME&sp=r|w&se=EXPIRY&sig=HEX
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO, cast
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

from ._recycle import claim
from .errors import SignedUrlError

__all__ = [
    "KEY_FILE",
    "SourceError",
    "load_key",
    "sign_file_url",
    "verify_file_url",
    "write_atomically",
]

KEY_FILE = "url.key"


def load_key(store: Path, *, create: bool = False) -> bytes:
    """Reads the store's URL-signing key, creating it (mode 0600) if asked."""
    path = store / KEY_FILE
    if create and not path.exists():
        tmp = store / f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic create-if-absent: two processes agree on one key
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise SignedUrlError(f"cannot read the URL key of store {store}: {exc}") from exc


def _signature(key: bytes, signed_name: str, permission: str, expiry: int) -> str:
    message = f"{signed_name}\n{permission}\n{expiry}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign_file_url(store: Path, key: bytes, signed_name: str, permission: str, expiry: int) -> str:
    """Builds a URL for ``store/blobs/signed_name``.

    Args:
        store: The storage directory (absolute).
        key: The store's signing key.
        signed_name: ``CONTAINER/NAME`` of the object.
        permission: ``r`` or ``w``.
        expiry: Unix time after which the URL is refused.
    """
    path = quote(str(store / "blobs" / signed_name))
    query = urlencode(
        {
            "sn": signed_name,
            "sp": permission,
            "se": str(expiry),
            "sig": _signature(key, signed_name, permission, expiry),
        }
    )
    return f"file://{path}?{query}"


def verify_file_url(url: str, permission: str) -> tuple[Path, Path]:
    """Checks a signed URL for ``permission``.

    Returns:
        The storage directory and the object's path in it.

    Raises:
        SignedUrlError: Malformed, expired, tampered, or not granting ``permission``.
    """
    parts = urlsplit(url)
    if parts.scheme != "file" or parts.netloc not in ("", "localhost"):
        raise SignedUrlError(f"not a local storage URL: {url.split('?')[0]}")
    query = {k: v[0] for k, v in parse_qs(parts.query).items() if len(v) == 1}
    try:
        signed_name, granted, sig = query["sn"], query["sp"], query["sig"]
        expiry = int(query["se"])
    except (KeyError, ValueError) as exc:
        raise SignedUrlError("URL lacks its signature fields (sn, sp, se, sig)") from exc
    path = Path(unquote(parts.path))
    suffix = f"/blobs/{signed_name}"
    if not str(path).endswith(suffix) or ".." in signed_name.split("/"):
        raise SignedUrlError("URL path does not match the object it was signed for")
    store = Path(str(path)[: -len(suffix)] or "/")
    if not hmac.compare_digest(sig, _signature(load_key(store), signed_name, granted, expiry)):
        raise SignedUrlError("URL signature does not match: it was altered")
    if granted != permission:
        raise SignedUrlError(f"URL grants {granted!r} access, not {permission!r}")
    if time.time() > expiry:
        raise SignedUrlError("URL has expired")
    return store, path


class SourceError(Exception):
    """Reading the caller's data failed (not the store); ``__cause__`` holds why."""


_COPY_CHUNK = 8 << 20


def write_atomically(
    store: Path,
    path: Path,
    source: bytes | bytearray | memoryview | BinaryIO | Sequence[memoryview],
    *,
    if_absent: bool,
    on_write: Callable[[int], None] | None = None,
) -> bool:
    """Writes an object of the local store so that no reader ever sees half of it.

    The bytes go to a temporary file in ``store/tmp`` (same file system; for 1 MiB or
    more of known size, a collected object's file, see ``_recycle``), are fsynced, and
    the file is renamed into place (``os.link`` for create-if-absent, which fails if
    the name exists); the folder is fsynced so the rename survives a crash.

    Args:
        store: The storage directory.
        path: The object's path inside it.
        source: Bytes, a list of buffers written one after the other (no copy), or a
            binary file object read to its end through one reused buffer (a fresh
            buffer per chunk costs a page fault per 4 KiB).
        if_absent: Create only.
        on_write: Called with the bytes written after each chunk (progress).

    Returns:
        False if ``if_absent`` and the object exists; True once written.

    Raises:
        SourceError: Reading ``source`` failed.
        OSError: The write failed, or a blob occupies a folder of ``path``.
    """
    tmp_dir = store / "tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir / f"{os.getpid()}-{secrets.token_hex(8)}"
    parts: Sequence[bytes | bytearray | memoryview] | None = None
    if isinstance(source, (bytes, bytearray, memoryview)):
        parts = [source]
    elif isinstance(source, (list, tuple)):
        parts = source
    # A large object of known size goes over a collected object's blocks (see _recycle).
    fd = None if parts is None else claim(store, sum(memoryview(p).nbytes for p in parts), tmp)
    recycled = fd is not None
    if fd is None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with open(fd, "wb", buffering=0) as f:
            if parts is not None:
                for part in parts:
                    # One write may take at most 2 GiB on Linux, and may take less.
                    view = memoryview(part).cast("B")
                    while view:
                        n = f.write(view[:_COPY_CHUNK]) or 0
                        view = view[n:]
                        if on_write is not None:
                            on_write(n)
            else:
                _copy(cast(BinaryIO, source), f)
            if recycled:
                f.truncate()  # at the position: a longer old file's tail goes
            os.fsync(f.fileno())
        path.parent.mkdir(parents=True, exist_ok=True)
        if if_absent:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        else:
            os.replace(tmp, path)
        _fsync_dir(path.parent)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _copy(source: BinaryIO, target: BinaryIO) -> None:
    buffer = bytearray(_COPY_CHUNK)
    view = memoryview(buffer)
    readinto = getattr(source, "readinto", None)
    while True:
        try:
            if readinto is not None:
                n = readinto(buffer)
                chunk = view[:n] if n else b""
            else:
                chunk = source.read(_COPY_CHUNK)
        except Exception as exc:
            raise SourceError(str(exc)) from exc
        if not chunk:
            return
        target.write(chunk)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
