"""Signed ``file://`` URLs: the local backend's stand-in for Azure SAS URLs.

The embedded storage keeps blobs in a directory, so a trainer on the same machine reads
and writes them directly; the coordinator still decides *which* objects it may touch.
A URL names one object and carries its access, expiry and an HMAC over both, keyed by
a secret in the storage directory. It protects against bugs (a rank writing the wrong
version) rather than against an attacker who can read the storage directory anyway.

Format::

    file:///ROOT/blobs/CONTAINER/NAME?sn=CONTAINER/NAME&sp=r|w&se=EXPIRY[&sk=SCOPE]&sig=HEX

A write URL may be *scoped* (``sk``, a folder ``CONTAINER/FOLDER/`` holding the object):
then it is signed with that scope's own key, ``ROOT/scopes/<sha256 of the scope>``,
which the coordinator makes at the first signing and turns into an empty tombstone when
it revokes the scope (a checkpoint version committed or collected). Verification reads
the scope's key, so a revoked scope's URLs fail at once, whatever their expiry: the
signature itself is checked against the version's state. A tombstone rather than a
deleted file, so that a coordinator signing after the revocation (a request that read
the version as open a moment earlier) cannot bring the scope back; it is removed with
the version's objects.
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

from rallypoint.client.errors import SignedUrlError

from ._recycle import claim

__all__ = [
    "KEY_FILE",
    "SCOPES",
    "SourceError",
    "forget_scope",
    "load_key",
    "revoke_scope",
    "scope_key",
    "sign_file_url",
    "verify_file_url",
    "write_atomically",
]

KEY_FILE = "url.key"
#: The folder of the scopes' keys and tombstones, in the storage directory.
SCOPES = "scopes"


def _create(path: Path) -> None:
    """Writes a fresh 32-byte key (mode 0600) at ``path`` unless a file is there."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
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


def load_key(root: Path, *, create: bool = False) -> bytes:
    """Reads the storage directory's URL-signing key, creating it (mode 0600) if asked."""
    path = root / KEY_FILE
    if create and not path.exists():
        _create(path)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise SignedUrlError(f"cannot read the URL key in {root}: {exc}") from exc


def _scope_path(root: Path, scope: str) -> Path:
    # Hashed: a flat folder of fixed-length names, whatever the scope's depth or length.
    return root / SCOPES / hashlib.sha256(scope.encode()).hexdigest()


def scope_key(root: Path, scope: str, *, create: bool = False) -> bytes:
    """The write key of ``scope`` (``CONTAINER/FOLDER/``), made if asked and absent.

    Raises:
        SignedUrlError: The scope was revoked, or has no key and ``create`` is False.
    """
    path = _scope_path(root, scope)
    try:
        if create and not path.exists():
            path.parent.mkdir(mode=0o700, exist_ok=True)
            _create(path)
        key = path.read_bytes()
    except FileNotFoundError:
        raise SignedUrlError(
            f"the writes of {scope} are closed (its version committed or was collected)"
        ) from None
    except OSError as exc:
        raise SignedUrlError(f"cannot read the key of {scope}: {exc}") from exc
    if not key:
        raise SignedUrlError(
            f"the writes of {scope} are closed (its version committed or was collected)"
        )
    return key


def revoke_scope(root: Path, scope: str) -> None:
    """Ends every write URL of ``scope`` and any later signing for it: its key becomes an
    empty tombstone, in one rename, so a verifier reads either the key or the tombstone.

    Raises:
        OSError: The storage directory cannot be written.
    """
    path = _scope_path(root, scope)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    try:
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def forget_scope(root: Path, scope: str) -> None:
    """Removes ``scope``'s key or tombstone, once the scope's objects are gone.

    Raises:
        OSError: The storage directory cannot be written.
    """
    _scope_path(root, scope).unlink(missing_ok=True)


def _signature(key: bytes, signed_name: str, permission: str, expiry: int, scope: str) -> str:
    message = f"{signed_name}\n{permission}\n{expiry}"
    if scope:  # unscoped URLs keep the message they always had
        message += f"\n{scope}"
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def sign_file_url(
    root: Path, key: bytes, signed_name: str, permission: str, expiry: int, scope: str = ""
) -> str:
    """Builds a URL for ``root/blobs/signed_name``.

    Args:
        root: The storage directory (absolute).
        key: The storage directory's signing key, or for a scoped URL the scope's
            (:func:`scope_key`).
        signed_name: ``CONTAINER/NAME`` of the object.
        permission: ``r`` or ``w``.
        expiry: Unix time after which the URL is refused.
        scope: ``CONTAINER/FOLDER/``, a folder holding the object, whose revocation
            ends the URL; empty for none.
    """
    path = quote(str(root / "blobs" / signed_name))
    fields = {"sn": signed_name, "sp": permission, "se": str(expiry)}
    if scope:
        fields["sk"] = scope
    fields["sig"] = _signature(key, signed_name, permission, expiry, scope)
    return f"file://{path}?{urlencode(fields)}"


def verify_file_url(url: str, permission: str, *, now: float | None = None) -> tuple[Path, Path]:
    """Checks a signed URL for ``permission``.

    Args:
        url: The URL.
        permission: ``r`` or ``w``.
        now: The time its expiry is judged at (default: now). A write checks its URL
            again just before the object appears, judged at the time the write began:
            a write, like one request to Azure, is allowed to finish, but not into a
            scope revoked meanwhile.

    Returns:
        The storage directory and the object's path in it.

    Raises:
        SignedUrlError: Malformed, expired, tampered, revoked, or not granting
            ``permission``.
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
    scope = query.get("sk", "")
    path = Path(unquote(parts.path))
    suffix = f"/blobs/{signed_name}"
    if not str(path).endswith(suffix) or ".." in signed_name.split("/"):
        raise SignedUrlError("URL path does not match the object it was signed for")
    if scope and not (scope.endswith("/") and signed_name.startswith(scope)):
        raise SignedUrlError("URL names an object outside its scope")
    root = Path(str(path)[: -len(suffix)] or "/")
    key = scope_key(root, scope) if scope else load_key(root)
    expected = _signature(key, signed_name, granted, expiry, scope)
    # As bytes: hmac.compare_digest raises TypeError on text with a non-ASCII character.
    if not hmac.compare_digest(sig.encode("utf-8", "surrogatepass"), expected.encode()):
        raise SignedUrlError("URL signature does not match: it was altered")
    if granted != permission:
        raise SignedUrlError(f"URL grants {granted!r} access, not {permission!r}")
    if (time.time() if now is None else now) > expiry:
        raise SignedUrlError("URL has expired")
    return root, path


class SourceError(Exception):
    """Reading the caller's data failed (not the storage); ``__cause__`` holds why."""


_COPY_CHUNK = 8 << 20


def write_atomically(
    root: Path,
    path: Path,
    source: bytes | bytearray | memoryview | BinaryIO | Sequence[memoryview],
    *,
    if_absent: bool,
    on_write: Callable[[int], None] | None = None,
    check: Callable[[], object] | None = None,
) -> bool:
    """Writes an object of the local storage so that no reader ever sees half of it.

    The bytes go to a temporary file in ``root/tmp`` (same file system; for 1 MiB or
    more of known size, a collected object's file, see ``_recycle``), are fsynced, and
    the file is renamed into place (``os.link`` for create-if-absent, which fails if
    the name exists); the folder is fsynced so the rename survives a crash.

    Args:
        root: The storage directory.
        path: The object's path inside it.
        source: Bytes, a list of buffers written one after the other (no copy), or a
            binary file object read to its end through one reused buffer (a fresh
            buffer per chunk costs a page fault per 4 KiB).
        if_absent: Create only.
        on_write: Called with the bytes written after each chunk (progress).
        check: Called once the bytes are on disk, before the object appears; what it
            raises aborts the write (a signed URL's scope revoked meanwhile).

    Returns:
        False if ``if_absent`` and the object exists; True once written.

    Raises:
        SourceError: Reading ``source`` failed.
        OSError: The write failed, or a blob occupies a folder of ``path``.
    """
    tmp_dir = root / "tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir / f"{os.getpid()}-{secrets.token_hex(8)}"
    parts: Sequence[bytes | bytearray | memoryview] | None = None
    if isinstance(source, (bytes, bytearray, memoryview)):
        parts = [source]
    elif isinstance(source, (list, tuple)):
        parts = source
    # A large object of known size goes over a collected object's blocks (see _recycle).
    fd = None if parts is None else claim(root, sum(memoryview(p).nbytes for p in parts), tmp)
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
        if check is not None:
            check()
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
