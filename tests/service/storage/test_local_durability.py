"""What only the embedded backend must prove itself: crashes and several processes."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from rallypoint.localfs import SCOPES
from rallypoint.service.errors import AccessDenied
from rallypoint.service.storage import Entity, LocalStorage
from rallypoint.trainer import TransferDenied, upload

MiB = 1 << 20
MINUTE = timedelta(minutes=1)


def _run(code: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.mark.e2e
def test_sigkill_mid_write_never_leaves_half_an_object(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path, "rp")
    blobs = storage.blobs("ckpt")
    old = os.urandom(MiB)
    blobs.put("v/shard", old)
    writer = _run(
        """
        import sys
        from rallypoint.service.storage import LocalStorage
        blobs = LocalStorage(sys.argv[1], "rp").blobs("ckpt")

        class Slow:
            sent = 0
            def read(self, n):
                if self.sent == 8 << 20:
                    print("half", flush=True)
                    sys.stdin.read()  # parked here until the test kills us
                self.sent += 1 << 20
                return b"n" * (1 << 20) if self.sent <= 64 << 20 else b""

        blobs.put("v/shard", Slow())
        blobs.put("v/fresh", Slow())
        """,
        str(tmp_path),
    )
    assert writer.stdout is not None
    assert writer.stdout.readline() == b"half\n"  # it has written 8 MiB of 64
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert blobs.get("v/shard") == old
    assert [b.name for b in blobs.list()] == ["v/shard"]


@pytest.mark.e2e
def test_two_processes_share_one_table_without_losing_updates(tmp_path: Path) -> None:
    table = LocalStorage(tmp_path, "rp").table("jobs")
    table.insert(Entity("job", "counter", {"n": 0}))
    code = """
        import sys
        from rallypoint.service.errors import Modified
        from rallypoint.service.storage import Entity, LocalStorage
        table = LocalStorage(sys.argv[1], "rp").table("jobs")
        conflicts = 0
        for _ in range(100):
            while True:
                cur = table.get("job", "counter")
                try:
                    new = Entity("job", "counter", {"n": cur.data["n"] + 1})
                    table.replace(new, if_match=cur.etag)
                    break
                except Modified:
                    conflicts += 1
        print(conflicts)
    """
    procs = [_run(code, str(tmp_path)) for _ in range(3)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
    assert table.get("job", "counter").data["n"] == 300


def test_the_store_survives_reopening(tmp_path: Path) -> None:
    first = LocalStorage(tmp_path, "rp")
    first.table("jobs").insert(Entity("j", "r", {"v": "kept"}))
    first.blobs("ckpt").put("a/b", b"kept")
    url = first.blobs("ckpt").sign("a/b", access="read", ttl=__import__("datetime").timedelta(1))
    first.close()
    again = LocalStorage(tmp_path, "rp")
    assert again.table("jobs").get("j", "r").data == {"v": "kept"}
    assert again.blobs("ckpt").get("a/b") == b"kept"
    # The signing key persists too, so URLs handed out before a restart stay valid.
    from rallypoint.trainer import download

    assert download(url) == b"kept"


def test_a_revoked_scope_refuses_new_objects_signing_and_writes_in_flight(
    tmp_path: Path,
) -> None:
    blobs = LocalStorage(tmp_path, "rp").blobs("ckpt")
    grant = blobs.grant("j/v1/rank-0/", ["a", "b"], access="write", ttl=MINUTE, scope="j/v1/")

    class RevokedMidWrite(io.RawIOBase):
        """The coordinator revokes the scope while this write is under way."""

        sent = False

        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            if self.sent:
                blobs.revoke("j/v1/")
                return 0
            self.sent = True
            buffer[:4] = b"data"
            return 4

    with pytest.raises(TransferDenied, match="closed"):
        upload(grant["a"], RevokedMidWrite())
    assert list(blobs.list()) == []  # the write never appeared
    with pytest.raises(TransferDenied, match="closed"):
        upload(grant["b"], b"a new object")  # Azure cannot refuse this one before expiry
    with pytest.raises(AccessDenied):
        blobs.grant("j/v1/rank-0/", ["a"], access="write", ttl=MINUTE, scope="j/v1/")
    blobs.forget("j/v1/")  # its objects are gone: the tombstone goes too
    assert not any((tmp_path / SCOPES).iterdir())
