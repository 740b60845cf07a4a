"""The blob port: named objects in one container, and signed URLs for trainers."""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import BinaryIO, Literal

from ..errors import BadRequest, InvalidName
from ._names import check_blob_name, check_blob_prefix
from ._port import Port

__all__ = ["Access", "BlobInfo", "BlobStore", "Data"]

Access = Literal["read", "write"]
#: What :meth:`BlobStore.put` takes: bytes, or a binary file object read to its end.
Data = bytes | bytearray | memoryview | BinaryIO

#: Signed URLs live at most this long: they are handed to trainers and cannot be revoked.
MAX_URL_TTL = timedelta(days=7)


@dataclass(frozen=True)
class BlobInfo:
    """What the container knows of one object."""

    name: str
    size: int
    etag: str
    last_modified: float  # seconds since the epoch


class BlobStore(Port):
    """Objects named like paths (``jobs/j1/v3/rank-0.safetensors``) in one container.

    Names are non-empty, at most 1024 characters, ``/``-separated segments that are
    neither empty, ``.`` nor ``..`` (nor end in ``.``) and hold no ``\\\\ % ? #`` or
    control characters; any other name is refused with :class:`InvalidName` here,
    before a request is sent. Adapters implement the ``_``-prefixed hooks.
    """

    def put(
        self, name: str, data: Data, *, if_absent: bool = False, length: int | None = None
    ) -> BlobInfo:
        """Stores an object, replacing any old one unless ``if_absent``.

        Readers see either the old or the new object, never a part of one. Large objects
        are uploaded in parallel blocks.

        Args:
            name: The object's name.
            data: The bytes, or a binary file object read to its end.
            if_absent: Create only: fail if the object exists (exactly one of several
                racing creators wins).
            length: The number of bytes a file object holds, if known.

        Raises:
            AlreadyExists: ``if_absent`` and the object exists.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)) and not hasattr(data, "read"):
            raise BadRequest(f"blob data must be bytes or a binary file, not {type(data).__name__}")
        return self._put(check_blob_name(name), data, if_absent, length)

    def get(self, name: str, *, offset: int = 0, length: int | None = None) -> bytes:
        """Reads an object, or ``length`` bytes of it from ``offset``.

        Raises:
            NotFound: No such object.
        """
        if offset < 0 or (length is not None and length < 0):
            raise BadRequest(f"a range needs offset >= 0 and length >= 0, not {offset}, {length}")
        return self._get(check_blob_name(name), offset, length)

    def stream(self, name: str, *, chunk_size: int = 4 << 20) -> Iterator[bytes]:
        """Reads an object as chunks of at most ``chunk_size`` bytes.

        Raises:
            NotFound: No such object (raised before the first chunk).
        """
        if chunk_size <= 0:
            raise BadRequest(f"chunk_size must be positive, not {chunk_size}")
        return self._stream(check_blob_name(name), chunk_size)

    def info(self, name: str) -> BlobInfo:
        """Describes one object.

        Raises:
            NotFound: No such object.
        """
        return self._info(check_blob_name(name))

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        """Iterates, in name order, over the objects whose names start with ``prefix``."""
        return self._list(check_blob_prefix(prefix))

    def delete(self, name: str) -> None:
        """Deletes an object.

        Raises:
            NotFound: No such object.
        """
        self._delete(check_blob_name(name))

    def sign(self, name: str, *, access: Access, ttl: timedelta, scope: str | None = None) -> str:
        """A URL through which a trainer reads or writes exactly this one object.

        ``https://`` URLs with a SAS for Azure, signed ``file://`` URLs for local storage.
        A URL grants only the access asked for, only to this name, only for ``ttl``
        (at most 7 days).

        Args:
            name: The object.
            access: ``read`` or ``write``.
            ttl: How long the URL is valid.
            scope: For a write URL, a folder (ending in ``/``) holding the object:
                :meth:`revoke` of it ends the URL before its expiry, as far as the
                backend can (see :meth:`revoke`).

        Raises:
            InvalidName: The name is invalid, or not inside ``scope``.
            AccessDenied: ``scope`` was revoked (a backend that can tell).
        """
        if access not in ("read", "write"):
            raise BadRequest(f"access must be 'read' or 'write', not {access!r}")
        if not timedelta(0) < ttl <= MAX_URL_TTL:
            raise BadRequest(f"a signed URL lives more than 0 s and at most {MAX_URL_TTL}")
        name = check_blob_name(name)
        if scope is not None:
            if access != "write":
                raise BadRequest("only write URLs have a scope: a revocation ends writes")
            if not name.startswith(check_blob_prefix(scope, folder=True)):
                raise InvalidName(f"blob {name!r} is not inside scope {scope!r}")
        # Rounded up: a URL of 1 s must not be born expired.
        return self._sign(name, access, math.ceil(time.time() + ttl.total_seconds()), scope)

    def grant(
        self,
        prefix: str,
        names: Iterable[str] | None = None,
        *,
        access: Access,
        ttl: timedelta,
        scope: str | None = None,
    ) -> dict[str, str]:
        """Signed URLs for objects under one folder, keyed by their names below it.

        Scoping is per object: Azure's flat namespace (and Azurite) has no SAS for a
        folder, so a grant is one URL per object, and none reaches outside ``prefix``.

        Args:
            prefix: The folder, ending in ``/``.
            names: Names relative to ``prefix``. For ``read`` they default to every object
                under it; a ``write`` grant must name its objects.
            access: ``read`` or ``write``.
            ttl: How long the URLs are valid (at most 7 days).
            scope: For a write grant, a folder holding ``prefix`` (see :meth:`sign`).

        Raises:
            InvalidName: A name is invalid or the prefix is not a folder.
            BadRequest: A ``write`` grant without names.
            AccessDenied: ``scope`` was revoked (a backend that can tell).
        """
        check_blob_prefix(prefix, folder=True)
        if names is None:
            if access == "write":
                raise BadRequest("a write grant must name the objects it may write")
            names = [info.name[len(prefix) :] for info in self.list(prefix)]
        return {
            relative: self.sign(
                prefix + check_blob_name(relative), access=access, ttl=ttl, scope=scope
            )
            for relative in names
        }

    def revoke(self, scope: str) -> None:
        """Ends the write URLs signed for ``scope`` before their expiry, as far as the
        backend can; the container's own :meth:`put` and :meth:`delete` still work.

        Local storage: at once, for every URL of the scope, and the scope signs no more
        (:class:`AccessDenied`). Azure: the objects now under the scope get an infinite
        lease, which refuses writes that do not name it (every trainer's upload); a
        SAS can still create objects the scope does not hold yet, and one with write
        permission could break the lease: short expiry is what bounds those.

        Raises:
            InvalidName: ``scope`` is not a folder.
            StorageUnavailable: The container cannot be reached.
        """
        self._revoke(check_blob_prefix(scope, folder=True))

    def forget(self, scope: str) -> None:
        """Drops what :meth:`revoke` keeps of ``scope``, once its objects are deleted.

        Raises:
            InvalidName: ``scope`` is not a folder.
            StorageUnavailable: The container cannot be reached.
        """
        self._forget(check_blob_prefix(scope, folder=True))

    # Adapter hooks: arguments are checked, errors must be the domain's.
    @abc.abstractmethod
    def _put(self, name: str, data: Data, if_absent: bool, length: int | None) -> BlobInfo: ...

    @abc.abstractmethod
    def _get(self, name: str, offset: int, length: int | None) -> bytes: ...

    @abc.abstractmethod
    def _stream(self, name: str, chunk_size: int) -> Iterator[bytes]: ...

    @abc.abstractmethod
    def _info(self, name: str) -> BlobInfo: ...

    @abc.abstractmethod
    def _list(self, prefix: str) -> Iterator[BlobInfo]: ...

    @abc.abstractmethod
    def _delete(self, name: str) -> None: ...

    @abc.abstractmethod
    def _sign(self, name: str, access: Access, expiry: int, scope: str | None = None) -> str: ...

    @abc.abstractmethod
    def _revoke(self, scope: str) -> None: ...

    def _forget(self, scope: str) -> None:
        pass
