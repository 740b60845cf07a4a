"""Embedded storage reuses deleted objects' files, never one a reader still maps."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import torch

from rallypoint.localfs import RECYCLE_DIR
from rallypoint.service.storage import BlobStore, LocalStorage
from rallypoint.trainer._bytes import as_memoryview
from rallypoint.trainer.checkpoint._transfer import read_object

MiB = 1 << 20


def _blobs(tmp_path: Path) -> BlobStore:
    return LocalStorage(tmp_path, "rp").blobs("ckpt")


def _inode(tmp_path: Path, name: str) -> int:
    return (tmp_path / "blobs" / "rp-ckpt" / name).stat().st_ino


def _pool(tmp_path: Path) -> list[str]:
    pool = tmp_path / RECYCLE_DIR
    return sorted(os.listdir(pool)) if pool.is_dir() else []


def test_a_deleted_large_object_lends_its_file_to_the_next_large_write(tmp_path: Path) -> None:
    blobs = _blobs(tmp_path)
    blobs.put("v1/shard", os.urandom(4 * MiB))
    old = _inode(tmp_path, "v1/shard")
    blobs.delete("v1/shard")
    assert len(_pool(tmp_path)) == 1
    assert list(blobs.list("v1/")) == []
    smaller = os.urandom(3 * MiB)
    blobs.put("v2/shard", smaller)
    assert _inode(tmp_path, "v2/shard") == old
    assert _pool(tmp_path) == []
    # Exactly the new bytes: the old file's last MiB was cut off.
    assert blobs.get("v2/shard") == smaller
    assert blobs.info("v2/shard").size == 3 * MiB
    # A larger object than any recycled file grows the one it gets.
    blobs.delete("v2/shard")
    larger = os.urandom(5 * MiB)
    blobs.put("v3/shard", larger)
    assert _inode(tmp_path, "v3/shard") == old
    assert blobs.get("v3/shard") == larger


def test_small_objects_and_streams_get_fresh_files(tmp_path: Path) -> None:
    blobs = _blobs(tmp_path)
    blobs.put("manifest.json", b"{}")
    blobs.delete("manifest.json")
    assert _pool(tmp_path) == []
    blobs.put("big", os.urandom(2 * MiB))
    blobs.delete("big")
    assert len(_pool(tmp_path)) == 1
    # A stream's size is unknown until its end: written to a new file.
    (tmp_path / "src").write_bytes(os.urandom(2 * MiB))
    with open(tmp_path / "src", "rb") as f:
        blobs.put("streamed", f)
    assert len(_pool(tmp_path)) == 1
    assert blobs.get("streamed") == (tmp_path / "src").read_bytes()


def test_a_mapped_object_is_never_written_over(tmp_path: Path) -> None:
    blobs = _blobs(tmp_path)
    first = os.urandom(2 * MiB)
    blobs.put("v1/shard", first)
    url = blobs.sign("v1/shard", access="read", ttl=timedelta(minutes=1))
    mapped = read_object(url, len(first))  # a copy-on-write view of the file's pages
    old = _inode(tmp_path, "v1/shard")
    blobs.delete("v1/shard")
    blobs.put("v2/shard", os.urandom(2 * MiB))
    assert _inode(tmp_path, "v2/shard") != old
    assert bytes(as_memoryview(mapped)) == first
    # Once the mapping is gone the next collected file is reused again.
    del mapped
    blobs.delete("v2/shard")
    reused = _pool(tmp_path)
    assert len(reused) == 1
    blobs.put("v3/shard", os.urandom(2 * MiB))
    assert _pool(tmp_path) == []


def test_the_pool_holds_at_most_64_files_and_none_older_than_an_hour(tmp_path: Path) -> None:
    blobs = _blobs(tmp_path)
    payload = os.urandom(MiB)
    for i in range(70):
        blobs.put(f"o{i:02d}", payload)
    for i in range(70):
        blobs.delete(f"o{i:02d}")
    assert len(_pool(tmp_path)) == 64
    stale = time.time() - 3601
    for name in _pool(tmp_path)[:10]:
        os.utime(tmp_path / RECYCLE_DIR / name, (stale, stale))
    blobs.put("o99", payload)
    blobs.delete("o99")  # retiring trims the pool
    assert len(_pool(tmp_path)) == 55


def test_a_recycled_object_reads_back_through_torch(tmp_path: Path) -> None:
    """The trainer's read path (mmap) sees the new bytes, not the old file's."""
    blobs = _blobs(tmp_path)
    blobs.put("v1/shard", bytes(2 * MiB))
    blobs.delete("v1/shard")
    blobs.put("v2/shard", b"\x01" * (MiB + 1))
    url = blobs.sign("v2/shard", access="read", ttl=timedelta(minutes=1))
    assert torch.equal(read_object(url, MiB + 1), torch.ones(MiB + 1, dtype=torch.uint8))
