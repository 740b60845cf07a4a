"""Durability tiers in the coordinator, as rules (no HTTP; SQLite and Azurite).

A rank's files are safe in blob storage or in the memory of two nodes; a version
commits when every rank's are safe and is durable when all are in storage; at a seal the
coordinator names the newest version the new members' memory or storage can give back.
"""

from __future__ import annotations

import pytest

from rallypoint.client import SignedUrlError, verify_grant
from rallypoint.client.models import BeginCheckpoint, ReportShard, ShardFile
from rallypoint.service._checkpoints import Checkpoints
from rallypoint.service._rendezvous import Rendezvous
from rallypoint.service.errors import InvalidRequest
from rallypoint.service.storage import BlobStore

from .._rules import end, peer, save_tiered, seal_and_save, seal_with_peers, spec
from .._support import FILE
from ..conftest import Clock


def test_the_policy_persists_the_first_version_then_every_nth(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore
) -> None:
    gen, creds = seal_with_peers(rdzv, ["a", "b", "c"])
    nodes = ["a", "b", "c"]
    persisted = [
        save_tiered(ckpts, blobs, nodes, gen, step, creds, every=3)[1] for step in range(7)
    ]
    assert persisted == [True, False, False, True, False, False, True]
    # A forced save (a preemption notice) persists whatever the count.
    assert save_tiered(ckpts, blobs, nodes, gen, 7, creds, every=3, force=True)[1]
    kinds = [v.durability for v in ckpts.versions("job")]
    assert kinds[-2:] == ["durable", "durable"]  # 6 (the 3rd after 3) and the forced 7


def test_the_policy_persists_after_its_time_bound(
    ckpts: Checkpoints, rdzv: Rendezvous, clock: Clock
) -> None:
    gen, creds = seal_with_peers(rdzv, ["a", "b"])

    def begin(step: int) -> bool:
        request = BeginCheckpoint(
            node_id="a",
            generation=gen,
            step=step,
            files=[FILE],
            persist_every=100,
            persist_after=60.0,
        )
        return ckpts.begin("job", request, creds["a"]).persist

    assert begin(1)  # the first
    clock.advance(30)
    assert not begin(2)
    clock.advance(31)
    assert begin(3)  # 61 s after the last persisted one
    assert not begin(4)


def test_a_memory_version_commits_with_copies_on_two_nodes_and_moves_only_the_latest(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore
) -> None:
    gen, creds = seal_with_peers(rdzv, ["a", "b", "c"])
    first, _ = save_tiered(ckpts, blobs, ["a", "b", "c"], gen, 10, creds, every=5)
    second, persisted = save_tiered(ckpts, blobs, ["a", "b", "c"], gen, 20, creds, every=5)
    assert not persisted
    job = rdzv.get_job("job")
    assert job.checkpoint is not None and job.checkpoint.version == second
    assert not job.checkpoint.durable
    assert job.durable is not None and job.durable.version == first
    info = ckpts.get("job", second)
    assert info.durability == "memory" and info.in_storage == []
    # The ring: a's files on a and b, b's on b and c, c's on c and a.
    assert info.holders == {"0": ["a", "b"], "1": ["b", "c"], "2": ["c", "a"]}
    assert set(info.peers) == {"a", "b", "c"}


def test_a_rank_in_memory_on_one_node_only_is_refused(ckpts: Checkpoints, rdzv: Rendezvous) -> None:
    gen, creds = seal_with_peers(rdzv, ["a", "b"])
    begun = ckpts.begin(
        "job",
        BeginCheckpoint(node_id="a", generation=gen, step=1, files=[FILE], memory=True),
        creds["a"],
    )
    files = [ShardFile(name=FILE, size=1, checksum="x:1")]
    with pytest.raises(InvalidRequest, match="on 2 nodes"):
        ckpts.report(
            "job",
            begun.version,
            ReportShard(node_id="a", generation=gen, files=files, storage=False, memory=["a"]),
            creds["a"],
        )
    with pytest.raises(InvalidRequest, match="not a member"):
        ckpts.report(
            "job",
            begun.version,
            ReportShard(
                node_id="a", generation=gen, files=files, storage=False, memory=["a", "zz"]
            ),
            creds["a"],
        )
    assert ckpts.get("job", begun.version).reported == 0


def test_a_seal_names_the_memory_version_while_one_holder_of_each_rank_lives(
    ckpts: Checkpoints, rdzv: Rendezvous
) -> None:
    nodes = ["a", "b", "c", "d"]
    gen, creds, (_, newest) = seal_and_save(ckpts, rdzv, nodes, [10, 20], every=10)
    end(rdzv, gen, ["b"], creds)  # b's files are on c too; a's on a
    gen2, _ = seal_with_peers(rdzv, ["a", "c", "d"])
    assert rdzv.sealed("job", gen2).checkpoint.version == newest  # type: ignore[union-attr]
    info = ckpts.get("job", newest)
    assert info.holders["1"] == ["c"] and info.holders["0"] == ["a"]


def test_two_adjacent_nodes_lost_fall_back_to_the_newest_durable_version(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore
) -> None:
    nodes = ["a", "b", "c", "d"]
    gen, creds, (durable, _) = seal_and_save(ckpts, rdzv, nodes, [10, 20], every=10)
    end(rdzv, gen, ["a", "b"], creds)  # a's files were on a and b only
    gen2, creds2 = seal_with_peers(rdzv, ["c", "d"])
    named = rdzv.sealed("job", gen2).checkpoint
    assert named is not None and named.version == durable and named.durable
    job = rdzv.get_job("job")
    assert job.checkpoint == named  # the lost version is not the latest any more
    # The next saves move the pointer forward from the durable version's step.
    third, _ = save_tiered(ckpts, blobs, ["c", "d"], gen2, 11, creds2, every=10)
    assert rdzv.get_job("job").checkpoint.version == third  # type: ignore[union-attr]


def test_a_restarted_agent_holds_nothing_even_with_the_same_node_id(
    ckpts: Checkpoints, rdzv: Rendezvous
) -> None:
    nodes = ["a", "b"]
    gen, creds, (durable, _) = seal_and_save(ckpts, rdzv, nodes, [10, 20], every=10)
    end(rdzv, gen, nodes, creds)
    # Both agents came back (their memory was reclaimed): new replica servers.
    gen2, _ = seal_with_peers(rdzv, nodes, agents={"a": 2, "b": 2})
    assert rdzv.sealed("job", gen2).checkpoint.version == durable  # type: ignore[union-attr]


def test_grants_name_the_ring_successor_and_fail_when_altered(
    ckpts: Checkpoints, rdzv: Rendezvous
) -> None:
    gen, creds = seal_with_peers(rdzv, ["a", "b", "c"])
    key = ckpts.peer_key("job")
    begun = ckpts.begin(
        "job",
        BeginCheckpoint(node_id="c", generation=gen, step=1, files=[FILE], memory=True),
        creds["c"],
    )
    assert begun.replica is not None and begun.replica.node_id == "a"
    claims = verify_grant(key, begun.replica.token, now=rdzv.clock())
    assert (claims.op, claims.node, claims.peer, claims.version, claims.ranks) == (
        "write",
        "a",
        peer("a"),
        begun.version,
        [2],
    )
    body, signature = begun.replica.token.split(".")
    with pytest.raises(SignedUrlError):
        altered = body[:-2] + ("AA" if body[-2:] != "AA" else "BB")
        verify_grant(key, f"{altered}.{signature}", now=rdzv.clock())
    # Another coordinator replica on the same storage signs with the same key.
    other = Checkpoints(rdzv, ckpts.blobs)
    assert other.peer_key("job") == key


def test_a_standby_holds_a_copy_of_every_slot_and_resumes_the_lost_one_from_memory(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore, clock: Clock
) -> None:
    s = spec(2, 2, last_call=0).model_copy(update={"standbys": 1})
    creds = {}
    for i, n in enumerate(["a", "b", "s"]):
        registered = rdzv.register("job", n, f"host-{n}", 29500 + i, s, None, peer(n))
        assert registered.credential
        creds[n] = registered.credential
        if n == "b":
            job, _ = rdzv.tick("job")
            assert job.status == "sealed"
    gen = rdzv.get_job("job").generation
    assert [w.node_id for w in rdzv.standbys(rdzv.get_job("job"))] == ["s"]  # s parks
    key = ckpts.peer_key("job")
    for node, rank in (("a", 0), ("b", 1)):
        begun = ckpts.begin(
            "job",
            BeginCheckpoint(node_id=node, generation=gen, step=1, files=[FILE], memory=True),
            creds[node],
        )
        assert begun.standby is not None and begun.standby.node_id == "s"
        claims = verify_grant(key, begun.standby.token, now=rdzv.clock())
        assert (claims.op, claims.gen, claims.peer, claims.ranks) == (
            "write",
            gen,
            peer("s"),
            [rank],
        )
    durable, _ = save_tiered(ckpts, blobs, ["a", "b"], gen, 10, creds, every=100)
    in_memory, persisted = save_tiered(ckpts, blobs, ["a", "b"], gen, 20, creds, every=100)
    assert not persisted
    # A node that is neither a member nor parked beside the generation holds nothing.
    pending = ckpts.begin(
        "job", BeginCheckpoint(node_id="a", generation=gen, step=30, files=[FILE]), creds["a"]
    )
    with pytest.raises(InvalidRequest, match="nor a standby"):
        ckpts.report(
            "job",
            pending.version,
            ReportShard(
                node_id="a",
                generation=gen,
                files=[ShardFile(name=FILE, size=3, checksum="x:1")],
                storage=False,
                memory=["a", "x"],
            ),
            creds["a"],
        )
    # b is lost: s takes its rank, and the version in memory is still whole (s holds
    # b's files), so the seal names it rather than the durable one.
    clock.advance(1)
    end(rdzv, gen, ["b"], creds)
    rdzv.register("job", "a", "host-a", 29500, s, None, peer("a"))  # a survivor re-joins
    job, _ = rdzv.tick("job")
    assert job.status == "sealed" and durable < in_memory
    sealed = rdzv.sealed("job", job.generation)
    assert sealed.ranks == {"a": 0, "s": 1}
    assert sealed.checkpoint is not None and sealed.checkpoint.version == in_memory
    assert ckpts.get("job", in_memory).holders == {"0": ["a", "s"], "1": ["a", "s"]}


def test_retention_keeps_the_durable_version_behind_memory_ones(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore
) -> None:
    nodes = ["a", "b"]
    gen, creds = seal_with_peers(rdzv, nodes)
    durable, _ = save_tiered(ckpts, blobs, nodes, gen, 0, creds, every=100)
    for step in range(1, 8):
        save_tiered(ckpts, blobs, nodes, gen, step, creds, every=100)
    kept = [v.version for v in ckpts.versions("job")]
    assert kept[0] == durable and len(kept) == 4  # keep=3 newest, and the durable one
