"""Checkpoint versions as plain code (no HTTP), on SQLite and on a real Azurite."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

from rallypoint.client.models import (
    BeginCheckpoint,
    CheckpointInfo,
    ReportShard,
    RestoreReport,
    ShardFile,
)
from rallypoint.service._checkpoints import Checkpoints
from rallypoint.service._rendezvous import Rendezvous
from rallypoint.service.errors import (
    CheckpointConflict,
    IncompleteUpload,
    InvalidCredential,
    InvalidRequest,
    StaleGeneration,
    UnknownCheckpoint,
    UnknownNode,
)
from rallypoint.service.storage import BlobStore, Storage

from .._rules import assignment, save, seal
from ..conftest import Clock

TIMEOUT = 600.0


@pytest.fixture
def ckpts(rdzv: Rendezvous, blobs: BlobStore) -> Checkpoints:
    return Checkpoints(rdzv, blobs, keep=2, timeout=timedelta(seconds=TIMEOUT))


def shard_report(node: str, gen: int, size: int, **fields: Any) -> ReportShard:
    """``node``'s report of its one file, ``shard.safetensors`` of ``size`` bytes."""
    shard = ShardFile(name="shard.safetensors", size=size, checksum="x:1")
    return ReportShard(node_id=node, generation=gen, files=[shard], **fields)


def test_ranks_racing_to_begin_a_step_get_one_version(ckpts: Checkpoints, rdzv: Rendezvous) -> None:
    nodes = [f"n{i}" for i in range(8)]
    gen, creds = seal(rdzv, nodes)
    with ThreadPoolExecutor(8) as pool:
        begun = list(
            pool.map(
                lambda n: ckpts.begin(
                    "job", BeginCheckpoint(node_id=n, generation=gen, step=5), creds[n]
                ),
                nodes,
            )
        )
    assert {b.version for b in begun} == {1}
    assert sorted(b.rank for b in begun) == list(range(8))
    assert all(b.state == "pending" and set(b.upload_urls) == {"shard.safetensors"} for b in begun)
    other = ckpts.begin("job", BeginCheckpoint(node_id="n0", generation=gen, step=6), creds["n0"])
    assert other.version == 2


def test_the_last_report_commits_and_moves_the_pointer(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore
) -> None:
    nodes = ["a", "b", "c"]
    gen, creds = seal(rdzv, nodes)
    version = save(ckpts, blobs, nodes, gen, 100, creds)
    job = rdzv.get_job("job")
    assert job.checkpoint is not None and (job.checkpoint.version, job.checkpoint.step) == (
        version,
        100,
    )
    manifest = json.loads(blobs.get(f"job/v{version:010d}/manifest.json"))
    assert manifest["world_size"] == 3 and manifest["metadata"] == {"step": 100}
    assert [s["rank"] for s in manifest["shards"]] == [0, 1, 2]
    assert [s["metadata"] for s in manifest["shards"]] == [{"node": n} for n in nodes]
    latest = ckpts.get("job")
    assert latest.latest and latest.version == version
    assert set(latest.urls) == {
        "manifest.json",
        *(f"rank-{r:05d}/shard.safetensors" for r in range(3)),
    }
    # The next generation's members all get this pointer in their assignment.
    rdzv.leave("job", "c", gen, "test", creds["c"])
    gen2, _ = seal(rdzv, ["a", "b"])
    job = rdzv.get_job("job")
    for node in ("a", "b"):
        given = assignment(rdzv, job, node, gen2)
        assert given not in (None, "missed")
        assert given.checkpoint == job.checkpoint  # type: ignore[union-attr]


def test_the_pointer_never_moves_back(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore
) -> None:
    gen, creds = seal(rdzv, ["a"])
    newer = save(ckpts, blobs, ["a"], gen, 200, creds)
    older = save(ckpts, blobs, ["a"], gen, 150, creds)
    job = rdzv.get_job("job")
    assert job.checkpoint is not None and job.checkpoint.version == newer
    assert not ckpts.get("job", older).latest and ckpts.get("job", older).state == "committed"


def test_unuploaded_or_wrong_size_files_are_refused(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore
) -> None:
    gen, creds = seal(rdzv, ["a"])
    begun = ckpts.begin("job", BeginCheckpoint(node_id="a", generation=gen, step=1), creds["a"])
    report = shard_report("a", gen, 10)
    with pytest.raises(IncompleteUpload):
        ckpts.report("job", begun.version, report, creds["a"])
    blobs.put(f"job/v{begun.version:010d}/rank-00000/shard.safetensors", b"12345")
    with pytest.raises(IncompleteUpload):
        ckpts.report("job", begun.version, report, creds["a"])
    assert rdzv.get_job("job").checkpoint is None
    with pytest.raises(UnknownCheckpoint):
        ckpts.get("job")


def test_a_zombie_from_an_ended_generation_is_refused(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore
) -> None:
    gen, creds = seal(rdzv, ["a", "b"])
    begun = ckpts.begin("job", BeginCheckpoint(node_id="a", generation=gen, step=1), creds["a"])
    blobs.put(f"job/v{begun.version:010d}/rank-00000/shard.safetensors", b"zombie")
    rdzv.leave("job", "b", gen, "preempted", creds["b"])  # the generation ends
    with pytest.raises(StaleGeneration):
        ckpts.report("job", begun.version, shard_report("a", gen, 6), creds["a"])
    with pytest.raises(StaleGeneration):
        ckpts.begin("job", BeginCheckpoint(node_id="a", generation=gen, step=2), creds["a"])
    with pytest.raises(UnknownNode):
        gen2, _ = seal(rdzv, ["a"])
        ckpts.begin("job", BeginCheckpoint(node_id="b", generation=gen2, step=2), creds["b"])
    assert ckpts.versions("job")[0].state == "pending"
    assert rdzv.get_job("job").checkpoint is None


def test_a_report_for_another_generations_version_is_refused(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore
) -> None:
    gen, creds = seal(rdzv, ["a"])
    old = ckpts.begin("job", BeginCheckpoint(node_id="a", generation=gen, step=1), creds["a"])
    rdzv.leave("job", "a", gen, "restart", creds["a"])
    gen2, creds = seal(rdzv, ["a"])
    with pytest.raises(CheckpointConflict):
        ckpts.report("job", old.version, shard_report("a", gen2, 1), creds["a"])


def test_metadata_over_the_limit_is_refused(ckpts: Checkpoints, rdzv: Rendezvous) -> None:
    gen, creds = seal(rdzv, ["a"])
    begun = ckpts.begin("job", BeginCheckpoint(node_id="a", generation=gen, step=1), creds["a"])
    huge = shard_report("a", gen, 1, metadata={"blob": "x" * (600 * 1024)})
    with pytest.raises(InvalidRequest):
        ckpts.report("job", begun.version, huge, creds["a"])


def test_unfinished_versions_are_collected_after_the_timeout(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore, clock: Clock
) -> None:
    gen, creds = seal(rdzv, ["a", "b"])
    kept = save(ckpts, blobs, ["a", "b"], gen, 10, creds)
    # Rank a uploads and reports step 20; rank b dies mid-upload.
    begun = ckpts.begin("job", BeginCheckpoint(node_id="a", generation=gen, step=20), creds["a"])
    blobs.put(f"job/v{begun.version:010d}/rank-00000/shard.safetensors", b"half")
    info = ckpts.report("job", begun.version, shard_report("a", gen, 4), creds["a"])
    assert info.state == "pending" and info.reported == 1
    assert ckpts.collect("job") == []  # not yet: its uploads may still finish
    clock.advance(TIMEOUT + 1)
    assert ckpts.collect("job") == [begun.version]
    assert list(blobs.list(f"job/v{begun.version:010d}/")) == []
    with pytest.raises(UnknownCheckpoint):
        ckpts.get("job", begun.version)
    assert ckpts.get("job").version == kept  # the previous latest stays loadable
    assert ckpts.get("job").urls


def test_an_expired_step_gets_a_fresh_version(
    ckpts: Checkpoints, rdzv: Rendezvous, clock: Clock
) -> None:
    gen, creds = seal(rdzv, ["a"])
    first = ckpts.begin("job", BeginCheckpoint(node_id="a", generation=gen, step=1), creds["a"])
    clock.advance(TIMEOUT + 1)
    again = ckpts.begin("job", BeginCheckpoint(node_id="a", generation=gen, step=1), creds["a"])
    assert again.version > first.version and again.state == "pending"


def test_retention_keeps_the_last_k_and_always_the_latest(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore
) -> None:
    gen, creds = seal(rdzv, ["a"])
    latest = save(ckpts, blobs, ["a"], gen, 1000, creds)
    # Older steps commit later but never become latest; retention (keep=2) must not
    # take the latest although two newer versions exist.
    for step in (10, 20, 30):
        save(ckpts, blobs, ["a"], gen, step, creds)
    versions = {v.version: v for v in ckpts.versions("job")}
    assert latest in versions and versions[latest].latest
    assert len(versions) == 3  # the two newest plus the latest
    assert list(blobs.list(f"job/v{latest:010d}/"))
    for v in range(1, 5):
        assert bool(list(blobs.list(f"job/v{v:010d}/"))) == (v in versions)


def test_two_coordinators_commit_one_version(
    storage: Storage, clock: Clock, blobs: BlobStore
) -> None:
    one, two = (
        Checkpoints(Rendezvous(storage.table("jobs"), clock), blobs, timeout=timedelta(hours=1))
        for _ in range(2)
    )
    nodes = [f"n{i}" for i in range(6)]
    gen, creds = seal(one.rdzv, nodes)

    def rank(i: int) -> str:
        ckpts = (one, two)[i % 2]
        node = nodes[i]
        begun = ckpts.begin(
            "job", BeginCheckpoint(node_id=node, generation=gen, step=7), creds[node]
        )
        blobs.put(f"job/v{begun.version:010d}/rank-{begun.rank:05d}/shard.safetensors", b"x")
        return ckpts.report("job", begun.version, shard_report(node, gen, 1), creds[node]).state

    with ThreadPoolExecutor(6) as pool:
        states = list(pool.map(rank, range(6)))
    assert "committed" in states
    job = one.rdzv.get_job("job")
    assert job.checkpoint is not None and job.checkpoint.step == 7
    assert [v.state for v in one.versions("job")] == ["committed"]


def begin_as(node: str, gen: int, rank: int, world: int, step: int = 1) -> BeginCheckpoint:
    return BeginCheckpoint(node_id=node, generation=gen, step=step, rank=rank, world_size=world)


def report_as(
    ckpts: Checkpoints,
    blobs: BlobStore,
    node: str,
    gen: int,
    version: int,
    rank: int,
    creds: dict[str, str],
) -> CheckpointInfo:
    data = f"{node}:{rank}".encode()
    blobs.put(f"job/v{version:010d}/rank-{rank:05d}/data.distcp", data)
    shard = ShardFile(name="data.distcp", size=len(data), checksum="x:1")
    return ckpts.report(
        "job",
        version,
        ReportShard(node_id=node, generation=gen, files=[shard], rank=rank),
        creds[node],
    )


def test_global_ranks_commit_when_every_process_reported(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore
) -> None:
    """Two nodes of two processes each: a version of world size 4, keyed by global rank."""
    gen, creds = seal(rdzv, ["a", "b"])
    placed = {0: "a", 1: "a", 2: "b", 3: "b"}
    begun = {r: ckpts.begin("job", begin_as(n, gen, r, 4), creds[n]) for r, n in placed.items()}
    assert {b.version for b in begun.values()} == {1}
    assert {b.world_size for b in begun.values()} == {4}
    assert all(f"/rank-{r:05d}/" in begun[r].upload_urls["shard.safetensors"] for r in placed)
    states = [report_as(ckpts, blobs, n, gen, 1, r, creds).state for r, n in placed.items()]
    assert states == ["pending", "pending", "pending", "committed"]
    latest = ckpts.get("job")
    assert (latest.version, latest.world_size, latest.latest) == (1, 4, True)
    manifest = json.loads(blobs.get("job/v0000000001/manifest.json"))
    assert [(s["rank"], s["node_id"]) for s in manifest["shards"]] == sorted(placed.items())
    assert manifest["format"] == "rallypoint.checkpoint/2"


def test_a_rank_belongs_to_the_node_that_claimed_it(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore
) -> None:
    """Two processes given one global rank would overwrite each other's files."""
    gen, creds = seal(rdzv, ["a", "b"])
    ckpts.begin("job", begin_as("a", gen, 1, 4), creds["a"])
    with pytest.raises(CheckpointConflict, match="belongs to node 'a'"):
        ckpts.begin("job", begin_as("b", gen, 1, 4), creds["b"])
    with pytest.raises(CheckpointConflict, match="belongs to node 'a'"):
        report_as(ckpts, blobs, "b", gen, 1, 1, creds)
    ckpts.begin("job", begin_as("a", gen, 1, 4), creds["a"])  # the holder may ask again
    assert ckpts.versions("job")[0].reported == 0


def test_world_size_is_fixed_by_the_first_begin(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore
) -> None:
    gen, creds = seal(rdzv, ["a", "b", "c"])
    ckpts.begin("job", begin_as("a", gen, 0, 6), creds["a"])
    with pytest.raises(CheckpointConflict, match="begun by 6 ranks, not 4"):
        ckpts.begin("job", begin_as("b", gen, 1, 4), creds["b"])
    with pytest.raises(InvalidRequest, match="below the 3 nodes"):
        ckpts.begin("job", begin_as("c", gen, 1, 2, step=2), creds["c"])
    with pytest.raises(ValueError, match="not below world_size"):
        begin_as("c", gen, 6, 6)
    with pytest.raises(InvalidRequest, match="rank 6 is not a rank of version 1"):
        report_as(ckpts, blobs, "c", gen, 1, 6, creds)


def test_only_a_members_own_credential_begins_reports_or_restores(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore
) -> None:
    gen, creds = seal(rdzv, ["a", "b"])
    committed = save(ckpts, blobs, ["a", "b"], gen, 1, creds)
    begun = ckpts.begin("job", BeginCheckpoint(node_id="b", generation=gen, step=2), creds["b"])
    blobs.put(f"job/v{begun.version:010d}/rank-00001/shard.safetensors", b"b@2")
    ckpts.begin("job", BeginCheckpoint(node_id="a", generation=gen, step=2), creds["a"])
    before = (rdzv.get_job("job"), ckpts.versions("job"))
    for wrong in (creds["a"], None, "A" * 43):
        with pytest.raises(InvalidCredential):
            ckpts.report("job", begun.version, shard_report("b", gen, 3), wrong)
        with pytest.raises(InvalidCredential):
            ckpts.begin("job", BeginCheckpoint(node_id="b", generation=gen, step=3), wrong)
        with pytest.raises(InvalidCredential):
            report = RestoreReport(node_id="b", generation=gen, rank=1, bytes_from={"storage": 1})
            ckpts.restored("job", committed, report, wrong)
    assert (rdzv.get_job("job"), ckpts.versions("job")) == before
    assert before[0].checkpoint is not None and before[0].checkpoint.version == committed
