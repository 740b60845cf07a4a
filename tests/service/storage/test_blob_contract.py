"""The blob port's contract, run unchanged against the local and the Azure adapter."""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from rallypoint.service.errors import AlreadyExists, BadRequest, InvalidName, NotFound
from rallypoint.service.storage import BlobStore, Storage
from rallypoint.trainer import TransferDenied, TransferNotFound, download, upload
from rallypoint.trainer.checkpoint._transfer import upload_parts

from ..._race import one_winner

MiB = 1 << 20
MINUTE = timedelta(minutes=1)


@pytest.fixture
def blobs(storage: Storage) -> BlobStore:
    return storage.blobs("objects")


def test_put_get_info_round_trip(blobs: BlobStore) -> None:
    info = blobs.put("a/b.bin", b"hello")
    assert (info.name, info.size) == ("a/b.bin", 5)
    assert blobs.get("a/b.bin") == b"hello"
    assert blobs.info("a/b.bin").etag == info.etag
    again = blobs.put("a/b.bin", b"world!")
    assert again.etag != info.etag and again.size == 6
    assert blobs.get("a/b.bin") == b"world!"


def test_put_from_streams(blobs: BlobStore, tmp_path: Path) -> None:
    payload = os.urandom(3 * MiB + 17)
    assert blobs.put("s/bytesio", io.BytesIO(payload)).size == len(payload)
    path = tmp_path / "f.bin"
    path.write_bytes(payload)
    with path.open("rb") as f:
        assert blobs.put("s/file", f).size == len(payload)

    class Unseekable(io.RawIOBase):
        def __init__(self) -> None:
            self._src = io.BytesIO(payload)

        def readable(self) -> bool:
            return True

        def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
            data = self._src.read(min(len(b), 1 << 16))
            b[: len(data)] = data
            return len(data)

    assert blobs.put("s/pipe", Unseekable()).size == len(payload)
    for name in ("s/bytesio", "s/file", "s/pipe"):
        assert blobs.get(name) == payload


def test_64_mib_round_trip(blobs: BlobStore, tmp_path: Path) -> None:
    payload = os.urandom(64 * MiB)
    digest = hashlib.sha256(payload).hexdigest()
    path = tmp_path / "big.bin"
    path.write_bytes(payload)
    with path.open("rb") as f:
        assert blobs.put("big/state.bin", f).size == 64 * MiB
    assert hashlib.sha256(blobs.get("big/state.bin")).hexdigest() == digest
    streamed = hashlib.sha256()
    sizes = []
    for chunk in blobs.stream("big/state.bin", chunk_size=4 * MiB):
        sizes.append(len(chunk))
        streamed.update(chunk)
    assert streamed.hexdigest() == digest
    assert max(sizes) <= 4 * MiB and sum(sizes) == 64 * MiB
    assert blobs.get("big/state.bin", offset=40 * MiB, length=3) == payload[40 * MiB : 40 * MiB + 3]


def test_ranges(blobs: BlobStore) -> None:
    blobs.put("r", b"0123456789")
    assert blobs.get("r", offset=2, length=3) == b"234"
    assert blobs.get("r", offset=7) == b"789"
    assert blobs.get("r", offset=8, length=100) == b"89"
    assert blobs.get("r", offset=3, length=0) == b""
    assert blobs.get("r", offset=10) == b""
    with pytest.raises(BadRequest):
        blobs.get("r", offset=-1)


def test_create_if_absent_race_has_one_winner(blobs: BlobStore) -> None:
    def create(i: int) -> None:
        blobs.put("race/manifest.json", f"writer {i}".encode() * 1000, if_absent=True)

    winner = one_winner(create, AlreadyExists)
    assert blobs.get("race/manifest.json") == f"writer {winner}".encode() * 1000


def test_failed_upload_leaves_the_old_object(blobs: BlobStore) -> None:
    blobs.put("v/shard", b"old")

    class Breaks(io.RawIOBase):
        sent = 0

        def readable(self) -> bool:
            return True

        def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
            if self.sent > 12 * MiB:
                raise OSError("disk went away mid-upload")
            n = min(len(b), MiB)
            b[:n] = b"x" * n
            self.sent += n
            return n

    with pytest.raises(OSError):
        blobs.put("v/shard", Breaks())
    with pytest.raises(OSError):
        blobs.put("v/new", Breaks())
    assert blobs.get("v/shard") == b"old"
    assert [b.name for b in blobs.list("v/")] == ["v/shard"]


def test_list_by_prefix(blobs: BlobStore) -> None:
    names = ["a/1", "a/2", "a/x/3", "ab/4", "b/5", "top"]
    for name in reversed(names):
        blobs.put(name, name.encode())
    assert [b.name for b in blobs.list()] == names
    assert [b.name for b in blobs.list("a/")] == ["a/1", "a/2", "a/x/3"]
    assert [b.name for b in blobs.list("a")] == ["a/1", "a/2", "a/x/3", "ab/4"]
    assert [b.name for b in blobs.list("a/x")] == ["a/x/3"]
    assert [b.name for b in blobs.list("zzz/")] == []
    assert [b.size for b in blobs.list("b/")] == [3]


def test_delete_and_missing_objects(blobs: BlobStore) -> None:
    blobs.put("d/x", b"1")
    blobs.delete("d/x")
    assert list(blobs.list("d/")) == []
    for call in (
        lambda: blobs.get("d/x"),
        lambda: blobs.info("d/x"),
        lambda: blobs.delete("d/x"),
        lambda: blobs.stream("d/x"),  # raised on the call, before any chunk
    ):
        with pytest.raises(NotFound):
            call()


def test_unicode_names_round_trip(blobs: BlobStore) -> None:
    name = "jöbs/modèle ✓/权重-0.safetensors"
    blobs.put(name, b"u")
    assert blobs.get(name) == b"u"
    assert [b.name for b in blobs.list("jöbs/")] == [name]
    assert download(blobs.sign(name, access="read", ttl=MINUTE)) == b"u"


BAD_NAMES = [
    "",
    "/abs",
    "trailing/",
    "a//b",
    "..",
    "../escape",
    "a/../../escape",
    "./a",
    "a/./b",
    "a%2Fb",
    "%2e%2e/x",
    "a\\..\\b",
    "a?b",
    "a#b",
    "nul\x00",
    "dot.",
    "x" * 1025,
    "seg/" + "y" * 256,
    7,
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_path_tricks_are_refused(blobs: BlobStore, name: object, tmp_path: Path) -> None:
    before = sorted(p for p in tmp_path.rglob("*"))
    calls = [
        lambda: blobs.put(name, b"x"),  # type: ignore[arg-type]
        lambda: blobs.get(name),  # type: ignore[arg-type]
        lambda: blobs.info(name),  # type: ignore[arg-type]
        lambda: blobs.delete(name),  # type: ignore[arg-type]
        lambda: blobs.sign(name, access="write", ttl=MINUTE),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(InvalidName):
            call()
    assert list(blobs.list()) == []
    after = sorted(p for p in tmp_path.rglob("*"))
    assert after == before  # nothing written anywhere, inside the storage directory or outside


def test_signed_urls_read_and_write_one_object(blobs: BlobStore) -> None:
    write = blobs.sign("jobs/a/v1/rank-0", access="write", ttl=MINUTE)
    upload(write, b"shard-0")
    assert blobs.get("jobs/a/v1/rank-0") == b"shard-0"
    upload(write, io.BytesIO(b"shard-0 again"))
    read = blobs.sign("jobs/a/v1/rank-0", access="read", ttl=MINUTE)
    assert download(read) == b"shard-0 again"
    with pytest.raises(TransferDenied):
        upload(read, b"a read URL cannot write")
    assert blobs.get("jobs/a/v1/rank-0") == b"shard-0 again"
    with pytest.raises(TransferNotFound):
        download(blobs.sign("jobs/a/v1/missing", access="read", ttl=MINUTE))


def test_a_url_cannot_reach_another_object(blobs: BlobStore) -> None:
    grant = blobs.grant("jobs/a/v1/", ["rank-0", "rank-1"], access="write", ttl=MINUTE)
    assert sorted(grant) == ["rank-0", "rank-1"]
    upload(grant["rank-0"], b"0")
    upload(grant["rank-1"], b"1")
    # Point a valid URL at another version's object: the signature no longer matches.
    for other in ("jobs/a/v2/rank-0", "jobs/b/v1/rank-0"):
        tampered = grant["rank-0"].replace("jobs/a/v1/rank-0", other)
        assert tampered != grant["rank-0"]
        with pytest.raises(TransferDenied):
            upload(tampered, b"evil")
    assert [b.name for b in blobs.list()] == ["jobs/a/v1/rank-0", "jobs/a/v1/rank-1"]


def test_grants_stay_inside_their_prefix(blobs: BlobStore) -> None:
    blobs.put("jobs/a/v1/x", b"x")
    blobs.put("jobs/a/v10/y", b"y")
    read = blobs.grant("jobs/a/v1/", access="read", ttl=MINUTE)
    assert list(read) == ["x"]
    assert download(read["x"]) == b"x"
    for escape in ("../v2/x", "/x", "", "a/../../b"):
        with pytest.raises(InvalidName):
            blobs.grant("jobs/a/v1/", [escape], access="write", ttl=MINUTE)
    with pytest.raises(InvalidName):
        blobs.grant("jobs/a/v1", ["x"], access="read", ttl=MINUTE)  # not a folder
    with pytest.raises(BadRequest):
        blobs.grant("jobs/a/v1/", access="write", ttl=MINUTE)  # a write grant names objects


def test_expired_and_overlong_urls(blobs: BlobStore) -> None:
    blobs.put("e/x", b"x")
    expired = blobs._sign("e/x", "read", expiry=1_000_000_000)  # 2001: long expired
    with pytest.raises(TransferDenied):
        download(expired)
    for ttl in (timedelta(0), timedelta(seconds=-1), timedelta(days=8)):
        with pytest.raises(BadRequest):
            blobs.sign("e/x", access="read", ttl=ttl)
    with pytest.raises(BadRequest):
        blobs.sign("e/x", access="delete", ttl=MINUTE)  # type: ignore[arg-type]


def test_an_expired_write_url_is_refused(blobs: BlobStore) -> None:
    blobs.put("e/x", b"old")
    for scope in (None, "e/"):
        expired = blobs._sign("e/x", "write", 1_000_000_000, scope)  # 2001: long expired
        with pytest.raises(TransferDenied):
            upload(expired, b"new")
        with pytest.raises(TransferDenied):
            upload_parts(expired, [memoryview(b"new")])
    assert blobs.get("e/x") == b"old"


def test_a_revoked_scope_refuses_its_write_urls(blobs: BlobStore) -> None:
    grant = blobs.grant("j/v1/rank-0/", ["a", "b"], access="write", ttl=MINUTE, scope="j/v1/")
    other = blobs.grant("j/v2/rank-0/", ["a"], access="write", ttl=MINUTE, scope="j/v2/")
    upload(grant["a"], b"a1")
    upload_parts(grant["b"], [memoryview(b"b"), memoryview(b"1")])
    blobs.revoke("j/v1/")
    blobs.revoke("j/v1/")  # again: nothing changes
    for name, url in grant.items():
        with pytest.raises(TransferDenied):
            upload(url, b"zombie")
        with pytest.raises(TransferDenied):
            upload_parts(url, [memoryview(b"zombie")])
        assert blobs.get(f"j/v1/rank-0/{name}") == f"{name}1".encode()
    read = blobs.grant("j/v1/", access="read", ttl=MINUTE)
    assert download(read["rank-0/a"]) == b"a1"  # reads are not revoked
    upload(other["a"], b"v2")  # another scope is untouched
    assert blobs.get("j/v2/rank-0/a") == b"v2"
    # The container itself still writes and deletes what the URLs may not.
    blobs.put("j/v1/rank-0/a", b"a2")
    assert blobs.get("j/v1/rank-0/a") == b"a2"
    for name in ("a", "b"):
        blobs.delete(f"j/v1/rank-0/{name}")
    blobs.forget("j/v1/")
    assert [b.name for b in blobs.list()] == ["j/v2/rank-0/a"]


def test_an_upload_renews_a_refused_url_once_and_keeps_its_blocks(blobs: BlobStore) -> None:
    data = os.urandom(20 * MiB)  # three blocks on Azure, staged in parallel
    parts = [memoryview(data)[: 7 * MiB], memoryview(data)[7 * MiB :]]
    expired = blobs._sign("r/x", "write", 1_000_000_000, "r/")
    fresh = blobs.sign("r/x", access="write", ttl=MINUTE, scope="r/")
    renewals = []

    def source(*, renew: bool = False) -> str:
        if renew:
            renewals.append(fresh)
        return fresh if renewals else expired

    upload_parts(source, parts)
    assert len(renewals) == 1  # blocks refused together renew once
    assert blobs.get("r/x") == data
    # A URL renewed ahead of its expiry takes over mid-object: the blocks staged
    # through the first one stay the object's.
    urls = [blobs.sign("r/y", access="write", ttl=MINUTE, scope="r/") for _ in range(2)]
    calls = []

    def renewing(*, renew: bool = False) -> str:
        calls.append(renew)
        return urls[0] if len(calls) <= 2 else urls[1]

    upload_parts(renewing, parts)
    assert blobs.get("r/y") == data and not any(calls)


def test_scopes_are_folders_that_hold_the_object(blobs: BlobStore) -> None:
    with pytest.raises(InvalidName):
        blobs.sign("j/v1/a", access="write", ttl=MINUTE, scope="j/v2/")
    with pytest.raises(InvalidName):
        blobs.sign("j/v1/a", access="write", ttl=MINUTE, scope="j/v1")
    with pytest.raises(BadRequest):
        blobs.sign("j/v1/a", access="read", ttl=MINUTE, scope="j/v1/")
    with pytest.raises(InvalidName):
        blobs.revoke("j/v1")


def test_bad_data_is_refused(blobs: BlobStore) -> None:
    with pytest.raises(BadRequest):
        blobs.put("x", "text is not bytes")  # type: ignore[arg-type]
    with pytest.raises(NotFound):
        blobs.info("x")


def _chunks(it: Iterator[bytes]) -> bytes:
    return b"".join(it)


def test_stream_of_empty_object(blobs: BlobStore) -> None:
    blobs.put("empty", b"")
    assert blobs.info("empty").size == 0
    assert _chunks(blobs.stream("empty")) == b""
    assert blobs.get("empty") == b""
