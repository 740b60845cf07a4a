"""The embedded blob adapter: one directory per container, one file per object.

Objects keep their names as paths (``blobs/CONTAINER/jobs/j1/...``) so a person can look
at a checkpoint with ``ls``. Writes go through a temporary file and a rename, so a crash
never leaves half an object visible; deleted large objects are recycled (see
``rallypoint.localfs``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from rallypoint.client.errors import SignedUrlError
from rallypoint.localfs import (
    SourceError,
    forget_scope,
    load_key,
    retire,
    revoke_scope,
    scope_key,
    sign_file_url,
    write_atomically,
)

from ..errors import AccessDenied, AlreadyExists, BadRequest, NotFound, StorageUnavailable
from ._blob import Access, BlobInfo, BlobStore, Data

__all__ = ["LocalBlobStore"]


class LocalBlobStore(BlobStore):
    """See base class. Stored under ``PATH/blobs/CONTAINER``."""

    def __init__(self, root: Path, name: str) -> None:
        self.name = name
        self._root = root  # the storage directory: its keys, temporary and recycled files
        self._dir = root / "blobs" / name
        self._dir.mkdir(parents=True, exist_ok=True)
        self._key = load_key(root, create=True)

    def _path(self, name: str) -> Path:
        return self._dir / name

    def _stat(self, name: str) -> BlobInfo:
        try:
            st = self._path(name).stat()
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise NotFound(f"blob {name!r} does not exist") from exc
        except OSError as exc:
            raise StorageUnavailable(f"blob {name!r}: {exc}") from exc
        if not os.path.isfile(self._path(name)):
            raise NotFound(f"blob {name!r} does not exist")
        # Every put renames another file into place (a new one, or a collected object's,
        # which no name refers to any more), and writing it set a new mtime.
        etag = f'"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"'
        return BlobInfo(name, st.st_size, etag, st.st_mtime)

    def _put(self, name: str, data: Data, if_absent: bool, length: int | None) -> BlobInfo:
        try:
            written = write_atomically(self._root, self._path(name), data, if_absent=if_absent)
        except SourceError as exc:
            # The caller's own data failed to read: its error, not storage's.
            raise exc.__cause__ from None  # type: ignore[misc]
        except (NotADirectoryError, FileExistsError, IsADirectoryError) as exc:
            # Azure has no folders; a file system cannot hold both `a` and `a/b`.
            raise BadRequest(
                f"blob {name!r} collides with an object or folder of the same path "
                "(local storage cannot hold both 'a' and 'a/b')"
            ) from exc
        except OSError as exc:
            raise StorageUnavailable(f"cannot write blob {name!r}: {exc}") from exc
        if not written:
            raise AlreadyExists(f"blob {name!r} exists")
        return self._stat(name)

    def _open(self, name: str) -> int:
        try:
            return os.open(self._path(name), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise NotFound(f"blob {name!r} does not exist") from exc
        except OSError as exc:
            raise StorageUnavailable(f"cannot read blob {name!r}: {exc}") from exc

    def _get(self, name: str, offset: int, length: int | None) -> bytes:
        fd = self._open(name)
        try:
            size = os.fstat(fd).st_size
            want = size - offset if length is None else min(length, size - offset)
            if want <= 0:
                return b""
            buf = bytearray(want)
            view, done = memoryview(buf), 0
            while done < want:
                n = os.preadv(fd, [view[done:]], offset + done)
                if n == 0:
                    break
                done += n
            return bytes(buf[:done]) if done < want else bytes(buf)
        finally:
            os.close(fd)

    def _stream(self, name: str, chunk_size: int) -> Iterator[bytes]:
        fd = self._open(name)  # opened now, so NotFound comes before the first chunk

        def chunks() -> Iterator[bytes]:
            with os.fdopen(fd, "rb", buffering=0) as f:
                while chunk := f.read(chunk_size):
                    yield chunk

        return chunks()

    def _info(self, name: str) -> BlobInfo:
        return self._stat(name)

    def _list(self, prefix: str) -> Iterator[BlobInfo]:
        # Walk only the deepest folder the prefix names; filter the rest by string prefix.
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self._dir / folder
        found: list[str] = []
        for dirpath, dirnames, filenames in os.walk(start):
            rel = os.path.relpath(dirpath, self._dir)
            base = "" if rel == "." else rel + "/"
            dirnames[:] = [
                d
                for d in dirnames
                if (base + d + "/").startswith(prefix) or prefix.startswith(base + d + "/")
            ]
            found += [base + f for f in filenames if (base + f).startswith(prefix)]
        for name in sorted(found):
            try:
                yield self._stat(name)
            except NotFound:
                continue  # deleted while listing

    def _delete(self, name: str) -> None:
        path = self._path(name)
        try:
            if not path.is_file():
                raise NotFound(f"blob {name!r} does not exist")
            retire(self._root, path)  # a large file is kept for the next large write
        except FileNotFoundError as exc:
            raise NotFound(f"blob {name!r} does not exist") from exc
        except OSError as exc:
            raise StorageUnavailable(f"cannot delete blob {name!r}: {exc}") from exc
        # Prune folders left empty, as Azure has no folders to leave behind.
        parent = path.parent
        while parent != self._dir:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def _sign(self, name: str, access: Access, expiry: int, scope: str | None = None) -> str:
        permission = "w" if access == "write" else "r"
        signed_name = f"{self.name}/{name}"
        if scope is None:
            return sign_file_url(self._root, self._key, signed_name, permission, expiry)
        # A scoped URL is signed with the scope's own key: revoking the scope ends it
        # wherever the URL is (see rallypoint.localfs).
        signed_scope = f"{self.name}/{scope}"
        try:
            key = scope_key(self._root, signed_scope, create=True)
        except SignedUrlError as exc:
            raise AccessDenied(exc.message) from exc
        except OSError as exc:
            raise StorageUnavailable(f"cannot make the key of {scope!r}: {exc}") from exc
        return sign_file_url(self._root, key, signed_name, permission, expiry, signed_scope)

    def _revoke(self, scope: str) -> None:
        try:
            revoke_scope(self._root, f"{self.name}/{scope}")
        except OSError as exc:
            raise StorageUnavailable(f"cannot revoke {scope!r}: {exc}") from exc

    def _forget(self, scope: str) -> None:
        try:
            forget_scope(self._root, f"{self.name}/{scope}")
        except OSError as exc:
            raise StorageUnavailable(f"cannot forget {scope!r}: {exc}") from exc

    def ping(self) -> None:
        if not self._dir.is_dir():
            raise StorageUnavailable(f"blob folder {self._dir} is missing")
