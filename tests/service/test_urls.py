"""Short-lived storage URLs: write URLs live minutes and are renewed by asking again,
and end when their version commits or is collected; read URLs live their own setting.
Real coordinators on SQLite + a directory and on a real Azurite (the storage port's
part is in tests/service/storage)."""

from __future__ import annotations

import io
import time
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from rallypoint.client import CheckpointBegun, ElasticClient, ShardFile, UnknownCheckpoint
from rallypoint.trainer import RallypointReader, RallypointWriter, TransferDenied, download, upload

from .._support import clients, join_all, spec
from ..conftest import Start

TTL = 2.0  # seconds: waiting it out proves expiry
FILE = "shard.bin"


def joined(start: Start, monkeypatch: pytest.MonkeyPatch, **env: str) -> ElasticClient:
    """One node of a one-node job, on a coordinator started with ``env``."""
    for name, value in env.items():
        monkeypatch.setenv(f"RALLYPOINT_{name.upper()}", value)
    (node,) = clients(start().url, ["a"])
    join_all([node], spec(1, 1))
    return node


def save(node: ElasticClient, step: int, data: bytes) -> CheckpointBegun:
    begun = node.begin_checkpoint(step, [FILE])
    upload(begun.upload_urls[FILE], data)
    files = [ShardFile(name=FILE, size=len(data), checksum="x:1")]
    assert node.report_checkpoint(begun.version, files).state == "committed"
    return begun


def read(node: ElasticClient, version: int | None = None) -> str:
    return node.checkpoint(version).urls[f"rank-00000/{FILE}"]


def test_urls_live_their_settings_and_writes_renew(
    start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = joined(start, monkeypatch, write_url_ttl=str(TTL), read_url_ttl=str(TTL))
    save(node, 1, b"one")
    reader = read(node)
    pending = node.begin_checkpoint(2, [FILE])
    # Minutes in production, TTL here; the version itself lives an hour.
    assert pending.upload_ttl == TTL and pending.expires_at - time.time() > 3000
    write = pending.upload_urls[FILE]
    upload(write, b"t")
    assert download(reader) == b"one"
    time.sleep(TTL + 1.1)  # URLs expire at whole seconds, rounded up
    with pytest.raises(TransferDenied):
        upload(write, b"too late")
    with pytest.raises(TransferDenied):
        download(reader)
    # Beginning the step again renews: the same version, new URLs.
    renewed = node.begin_checkpoint(2, [FILE])
    assert renewed.version == pending.version and renewed.upload_urls[FILE] != write
    upload(renewed.upload_urls[FILE], b"two")
    files = [ShardFile(name=FILE, size=3, checksum="x:1")]
    assert node.report_checkpoint(renewed.version, files).state == "committed"
    assert download(read(node)) == b"two"


def test_a_committed_versions_write_urls_are_refused(
    start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = joined(start, monkeypatch, checkpoint_keep="1")
    begun = save(node, 1, b"good")
    # A stale writer (a retried upload, a zombie) minutes before the URL's expiry.
    with pytest.raises(TransferDenied):
        upload(begun.upload_urls[FILE], b"evil")
    assert download(read(node)) == b"good"
    again = node.begin_checkpoint(1, [FILE])
    assert again.state == "committed" and again.upload_urls == {} and again.upload_ttl is None
    # Retention still collects the version (on Azure, its files under their leases).
    save(node, 2, b"next")
    with pytest.raises(UnknownCheckpoint):
        node.checkpoint(begun.version)
    assert download(read(node)) == b"next"


class SlowPlanner(DefaultSavePlanner):
    """Takes longer than the write URLs live between beginning the version and the
    first upload (DCP resolves every item before the writer uploads any)."""

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.index.fqn == "w0":
            time.sleep(1.5)
        return super().resolve_data(write_item)


def test_a_save_that_outlives_its_write_urls_renews_them(
    start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = joined(start, monkeypatch, write_url_ttl="1")
    # 24 MiB in one file: three blocks on Azure; DCP's metadata is the second file.
    state = {f"w{i}": torch.randn(2 << 20) for i in range(3)}
    writer = RallypointWriter(node, 7)
    dcp.save(state, storage_writer=writer, planner=SlowPlanner(), no_dist=True)
    assert writer.info is not None and writer.info.state == "committed"
    assert writer.renewals >= 1
    target = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=RallypointReader(node, writer.version), no_dist=True)
    assert all(torch.equal(target[k], state[k]) for k in state)


def _expiry(url: str) -> float:
    """When a signed URL expires: ``se`` is epoch seconds locally, ISO 8601 in a SAS."""
    se = parse_qs(urlsplit(url).query)["se"][0]
    return float(se) if se.isdigit() else datetime.fromisoformat(se).timestamp()


def test_read_and_write_url_lifetimes_are_settings(
    start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = joined(start, monkeypatch, read_url_ttl="7200", write_url_ttl="120")
    begun = node.begin_checkpoint(1, [FILE])
    assert begun.upload_ttl == 120
    assert abs(_expiry(begun.upload_urls[FILE]) - (time.time() + 120)) < 5
    upload(begun.upload_urls[FILE], b"x")
    node.report_checkpoint(begun.version, [ShardFile(name=FILE, size=1, checksum="x:1")])
    assert abs(_expiry(read(node, begun.version)) - (time.time() + 7200)) < 5


def test_url_lifetimes_are_bounded() -> None:
    from pydantic import ValidationError

    from rallypoint.service.settings import Settings

    assert (Settings().write_url_ttl, Settings().read_url_ttl) == (300, 3600)
    for bad in ({"write_url_ttl": 0}, {"write_url_ttl": 7200}, {"read_url_ttl": 8 * 86400}):
        with pytest.raises(ValidationError):
            Settings(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_write_under_way_when_its_version_is_collected_never_lands(
    start: Start, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A local write is one request, its URL's expiry judged when it started: only the
    revocation at collection keeps it out of the collected version's folder. (On Azure
    the URL has expired by then: no URL outlives its version.)"""
    node = joined(start, monkeypatch, checkpoint_timeout="2")
    begun = node.begin_checkpoint(1, [FILE])
    assert begun.upload_ttl is not None and begun.upload_ttl <= 2

    class Slow(io.RawIOBase):
        """Sends a little, then waits out the version's timeout: the next step's begin
        collects the version while this write is still open."""

        sent = False

        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            if not self.sent:
                self.sent = True
                buffer[:4] = b"data"
                return 4
            time.sleep(begun.expires_at - time.time() + 0.5)
            node.begin_checkpoint(2, [FILE])
            return 0

    with pytest.raises(TransferDenied, match="closed"):
        upload(begun.upload_urls[FILE], Slow())
    with pytest.raises(UnknownCheckpoint):
        node.checkpoint(begun.version)
    assert not list(tmp_path.glob(f"storage/blobs/*/job/v{begun.version:010d}/**/*"))
