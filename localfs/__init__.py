"""The local backend's file system machinery, shared by the coordinator and trainers.

The embedded storage keeps blobs in a directory that trainers on the same machine read
and write directly. Both sides need the same rules for it, so they live here, in neither:

- **Signed** ``file://`` **URLs** (the local stand-in for SAS): the coordinator signs
  them (:func:`sign_file_url`, scoped ones with :func:`scope_key`) and revokes their
  scopes (:func:`revoke_scope`); a trainer checks one before it touches the object
  (:func:`verify_file_url`).
- **Durable writes**: :func:`write_atomically` writes, fsyncs and renames into place, so
  no reader ever sees half an object and a crash never leaves one.
- **Block recycling**: a collected object's file is kept for the next write of a large
  object (:func:`retire`), except while a reader holds it mapped (:func:`pin`).

Only the standard library and the client's errors (:class:`SignedUrlError`), so the base
install can use it; POSIX only (``fcntl``), as the local backend is.

Example::

    from rallypoint.localfs import load_key, sign_file_url, verify_file_url

    url = sign_file_url(root, load_key(root, create=True), "ckpt/v1/0.bin", "r", expiry)
    root, path = verify_file_url(url, "r")
"""

from ._fileurl import (
    KEY_FILE,
    SCOPES,
    SourceError,
    forget_scope,
    load_key,
    revoke_scope,
    scope_key,
    sign_file_url,
    verify_file_url,
    write_atomically,
)
from ._recycle import RECYCLE_DIR, RECYCLE_MIN, claim, pin, retire

__all__ = [
    "KEY_FILE",
    "RECYCLE_DIR",
    "RECYCLE_MIN",
    "SCOPES",
    "SourceError",
    "claim",
    "forget_scope",
    "load_key",
    "pin",
    "retire",
    "revoke_scope",
    "scope_key",
    "sign_file_url",
    "verify_file_url",
    "write_atomically",
]
