"""Peer replicas under real torchrun agents (CPU, gloo), each node with a memory tier of
its own as on separate machines: a node's SIGKILL costs no storage read, two adjacent
nodes' falls back to the newest durable version, and the replica server refuses what
its grants do not cover."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rallypoint.cli.processes import Cluster, Coordinator
from rallypoint.client import ElasticClient, JobSpec, ShardFile
from rallypoint.trainer._bytes import as_memoryview, checksum
from rallypoint.trainer.checkpoint._transfer import upload_parts
from rallypoint.trainer.errors import TransferDenied, TransferError, TransferNotFound
from rallypoint.trainer.memory import ITEMS_HEADER, NodeMemory, ReplicaServer, push, read_peer

from ..._inprocess import InProcessCoordinator
from ..._ranks import run_ranks
from ..._support import status

#: The torchrun tests' coordinator (local storage, logged), as a fixture here too.

pytestmark = pytest.mark.timeout(300)

ROWS = 24

WORKER = r"""
import json, os, sys, time, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from rallypoint.client import ElasticClient
from rallypoint.trainer import CheckpointManager
ROWS, NODES, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
client = ElasticClient.from_env(); a = client.join()
dist.init_process_group("gloo")
g, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
def full(step): return torch.arange(ROWS * 1024, dtype=torch.float32).reshape(ROWS, 1024) * step
def emit(**e):
    e.update(node=client.node_id, rank=g, world=world, generation=a.generation)
    with open(OUT, "a") as f: f.write(json.dumps(e) + "\n")
# The blob tier every 100th version: only the first one is durable.
m = CheckpointManager(client, progress=False, persist_every=100)
if a.checkpoint is None:
    if world == NODES:
        for step in (1, 2, 3):
            m.save({"w": distribute_tensor(full(step), mesh, [Shard(0)])}, step, blocking=True)
        dist.barrier()
        emit(event="saved")
    while True:
        time.sleep(0.1)  # until a node is killed and torchrun restarts this worker
target = {"w": distribute_tensor(torch.zeros(ROWS, 1024), mesh, [Shard(0)])}
r = m.load_latest(target)
emit(event="resumed", step=r.step, version=r.version, bytes=r.bytes_from,
     equal=bool(torch.equal(target["w"].full_tensor(), full(r.step))))
m.close(); dist.barrier(); dist.destroy_process_group()
"""


def run_and_kill(
    coordinator: Coordinator, tmp_path: Path, job: str, nodes: int, kill_ranks: list[int]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Path, dict[str, str]]:
    """``nodes`` agents save three versions (the first durable, the others in memory
    only), then the nodes of ``kill_ranks`` are SIGKILLed together. Returns the events,
    the generation history, the memory folder, and node ranks of the first generation."""
    script, out = tmp_path / "worker.py", tmp_path / f"{job}.jsonl"
    script.write_text(WORKER)
    memory = tmp_path / "shm"
    cluster = Cluster(
        coordinator.url,
        job,
        tmp_path,
        nnodes=f"1:{nodes}",
        script=[str(script), str(ROWS), str(nodes), str(out)],
        memory=memory,
    )
    cluster.events_file = out
    names = [f"n{i}" for i in range(nodes)]
    try:
        cluster.start(*names)
        cluster.wait_for(lambda e: e["event"] == "saved" and e["world"] == nodes, timeout=150)
        members = status(coordinator, job)["members"]
        ranks = {m["node_id"]: m["rank"] for m in members}
        for name in names:
            if ranks[name] in kill_ranks:
                cluster.kill(name)
        codes = cluster.wait(timeout=200)
    finally:
        cluster.stop()
    survivors = [n for n in names if ranks[n] not in kill_ranks]
    assert all(codes[n] == 0 for n in survivors), codes
    history = status(coordinator, job)["history"]
    by_rank = {str(r): n for n, r in ranks.items()}
    return cluster.events(), history, memory, by_rank


@pytest.mark.e2e
def test_a_killed_node_is_restored_from_its_peer_replica(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """3 nodes; rank 1's node is SIGKILLed with its memory. Its files are on rank 2's
    node too: the 2 survivors reshard 3 -> 2 with 0 bytes from storage, one of them
    reading the lost files from the other's replica server."""
    events, history, memory, by_rank = run_and_kill(coordinator, tmp_path, "peer1", 3, [1])
    saved = [e for e in events if e["event"] == "saved"]
    resumed = [e for e in events if e["event"] == "resumed"]
    assert len(saved) == 3 and len(resumed) == 2, events
    assert {e["step"] for e in resumed} == {3}  # the newest, a memory-only version
    assert len({e["version"] for e in resumed}) == 1
    assert all(e["equal"] for e in resumed)
    assert all(e["bytes"]["storage"] == 0 for e in resumed), resumed
    # The successor holds the lost node's files; the other survivor reads them from it.
    reader = next(e for e in resumed if e["node"] == by_rank["0"])
    assert reader["bytes"]["peer"] > 0
    assert history[-1]["checkpoint"]["durable"] is False
    # Each worker reported its restore: the coordinator counts the bytes by source.
    scraped = httpx.get(f"{coordinator.url}/metrics", timeout=10).text
    counted = {
        s.labels["source"]: s.value
        for family in text_string_to_metric_families(scraped)
        for s in family.samples
        if s.name == "rallypoint_checkpoint_restore_bytes_total" and s.labels["job"] == "peer1"
    }
    assert counted == {
        source: sum(e["bytes"][source] for e in resumed) for source in ("memory", "peer", "storage")
    }
    # The survivors' agents exited cleanly: their memory tiers are gone.
    for node in (by_rank["0"], by_rank["2"]):
        assert list((memory / node).glob("*/*")) == []


@pytest.mark.e2e
def test_two_adjacent_nodes_lost_fall_back_to_the_newest_durable_version(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """4 nodes; ranks 1 and 2 go together: rank 1's files were on nodes 1 and 2 only.
    The survivors resume from the first version, the only one in storage, both alike."""
    events, history, _, _ = run_and_kill(coordinator, tmp_path, "peer2", 4, [1, 2])
    resumed = [e for e in events if e["event"] == "resumed"]
    assert len(resumed) == 2, events
    assert {e["step"] for e in resumed} == {1}
    assert len({e["version"] for e in resumed}) == 1
    assert all(e["equal"] and e["bytes"]["storage"] > 0 for e in resumed)
    assert history[-1]["checkpoint"]["durable"] is True


FAILED_COPY = r"""
import torch
from rallypoint.trainer import CheckpointManager

def run(client, a):
    if a.rank == 1:
        server.stop()  # rank 0's copy to this node will fail
    import torch.distributed as dist
    dist.barrier()
    m = CheckpointManager(client, progress=False, persist_every=100)
    m.save({"w": torch.arange(1024.0)}, 1, blocking=True)  # the first: to storage
    info = m.save({"w": torch.arange(1024.0) * 2}, 2, blocking=True).result()
    dist.barrier()
    got = client.checkpoint(info.version)
    m.close()
    return {"durability": got.durability, "in_storage": got.in_storage,
            "holders": got.holders, "node": client.node_id}
"""


@pytest.mark.e2e
def test_a_copy_that_fails_goes_to_storage_instead(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """Rank 1's replica server is gone: rank 0's copy to it fails, so rank 0 uploads its
    files; rank 1's copy to rank 0 works and stays in memory. The version commits, in
    memory (rank 1's files are not in storage)."""
    rows = run_ranks(
        coordinator.url, "failed", ["f0", "f1"], FAILED_COPY, tmp_path, memory=tmp_path / "shm"
    )
    assert all("error" not in r for r in rows), rows
    seen = rows[0]
    assert seen["durability"] == "memory" and seen["in_storage"] == [0]
    # Rank 0's files are on its own node (and in storage), rank 1's on both nodes.
    first, second = rows[0]["node"], rows[1]["node"]
    assert seen["holders"] == {"0": [first], "1": sorted([first, second])}


# --- the replica server's rules ----------------------------------------------------------


class Pair:
    """A running two-node job: node a, and node b with a replica server (as its agent
    runs one)."""

    def __init__(self, url: str, root: Path) -> None:
        self.a = ElasticClient(url, "rules", "a")
        self.b = ElasticClient(url, "rules", "b")
        self.server = ReplicaServer(
            NodeMemory(root, "rules", "b"),
            self.b,
            "127.0.0.1",
            lambda: self.b.assignment.generation if self.b.assignment else 0,
        ).start()
        self.join()

    def join(self) -> None:
        """Both join the next generation (a member's new join ends the running one)."""
        spec = JobSpec(min_nodes=2, max_nodes=2)
        with ThreadPoolExecutor(2) as pool:
            done = pool.submit(self.a.join, "127.0.0.1", spec=spec)
            self.b.join("127.0.0.1", spec=spec, peer=self.server.url)
            done.result()

    def close(self) -> None:
        self.server.stop()
        self.a.close()
        self.b.close()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    coordinator = InProcessCoordinator(["--storage", f"local:{tmp_path / 'storage'}"]).start()
    p = Pair(coordinator.url, tmp_path / "shm")
    yield p
    p.close()
    coordinator.stop()


def one_file(size: int) -> tuple[memoryview, list[tuple[int, int, str]]]:
    raw = memoryview(bytes(range(256)) * (size // 256) + bytes(size % 256))
    return raw, [(0, size, checksum([raw]))]


def test_the_replica_server_takes_only_what_a_grant_covers(pair: Pair) -> None:
    begun = pair.a.begin_checkpoint(7, ["data.distcp"], rank=0, world_size=2, memory=True)
    grant = begun.replica
    assert grant is not None and grant.node_id == "b" and grant.url == pair.server.url
    raw, items = one_file(4096)
    name = "rank-00000/data.distcp"
    push(grant, begun.version, name, [raw], items)
    assert pair.server.memory.replica_path(begun.version, name).read_bytes() == bytes(raw)
    # Another rank's file, another version, a tampered grant: refused.
    with pytest.raises(TransferDenied, match="does not cover"):
        push(grant, begun.version, "rank-00001/data.distcp", [raw], items)
    with pytest.raises(TransferDenied, match="does not allow"):
        push(grant, begun.version + 1, name, [raw], items)
    body, signature = grant.token.split(".")
    forged = grant.model_copy(update={"token": f"{body[:-4]}AAAA.{signature}"})
    with pytest.raises(TransferDenied, match="signature"):
        push(forged, begun.version, name, [raw], items)
    # Bytes that fail their checksum are not kept.
    with pytest.raises(TransferError, match="fails its checksum"):
        push(grant, begun.version, "rank-00000/other", [raw], [(0, 4096, "xxh3-128:" + "0" * 32)])
    assert not pair.server.memory.replica_path(begun.version, "rank-00000/other").exists()
    # A grant for the node's earlier agent (same node, another URL): nothing there.
    earlier = grant.model_copy(update={"url": grant.url.rsplit("/", 1)[0] + "/" + "0" * 16})
    with pytest.raises(TransferNotFound):
        push(earlier, begun.version, name, [raw], items)


def test_a_zombie_of_an_ended_generation_cannot_write_or_read_replicas(pair: Pair) -> None:
    # A version committed with rank 0's files in memory on a and b, rank 1's in storage.
    begun = pair.a.begin_checkpoint(7, ["data.distcp"], rank=0, world_size=2, memory=True)
    assert begun.replica is not None
    raw, items = one_file(4096)
    name = "rank-00000/data.distcp"
    push(begun.replica, begun.version, name, [raw], items)
    pair.a.report_checkpoint(
        begun.version,
        [ShardFile(name="data.distcp", size=4096, checksum=items[0][2])],
        rank=0,
        storage=False,
        memory=["a", "b"],
    )
    other = pair.b.begin_checkpoint(7, ["data.distcp"], rank=1, world_size=2)
    upload_parts(other.upload_urls["data.distcp"], [raw])
    pair.b.report_checkpoint(
        other.version,
        [ShardFile(name="data.distcp", size=4096, checksum=items[0][2])],
        rank=1,
    )
    info = pair.a.checkpoint(begun.version)
    # a runs no replica server: its copy serves only a's own restarts, never a peer.
    assert info.durability == "memory" and info.holders == {"0": ["b"]}
    read = info.peers["b"]
    assert bytes(as_memoryview(read_peer(read, begun.version, name, 8, 16))) == bytes(raw[8:24])
    # Node a joins again: generation 1 ends and both run in generation 2. Grants of the
    # ended generation open nothing, for writing or reading.
    pair.join()
    with pytest.raises(TransferDenied, match="generation"):
        push(begun.replica, begun.version, name, [raw], items)
    with pytest.raises(TransferDenied, match="ended generation"):
        read_peer(read, begun.version, name, 0, 16)
    fresh = pair.a.checkpoint(begun.version).peers["b"]
    assert bytes(as_memoryview(read_peer(fresh, begun.version, name, 0, 16))) == bytes(raw[:16])


def test_a_standby_takes_copies_granted_beside_the_generation_it_parks_by(
    tmp_path: Path,
) -> None:
    coordinator = InProcessCoordinator(["--storage", f"local:{tmp_path / 'storage'}"]).start()
    spec = JobSpec(min_nodes=2, max_nodes=2, standbys=1)
    a, b, s = (ElasticClient(coordinator.url, "spare", n) for n in "abs")
    joining = [True]
    server = ReplicaServer(
        NodeMemory(tmp_path / "shm", "spare", "s"),
        s,
        "127.0.0.1",
        lambda: s.assignment.generation if s.assignment else 0,
        lambda: joining[0],
    ).start()
    pool = ThreadPoolExecutor(2)
    try:
        done = pool.submit(a.join, "127.0.0.1", spec=spec)
        b.join("127.0.0.1", spec=spec)
        done.result()
        parked = pool.submit(s.join, "127.0.0.1", spec=spec, peer=server.url)
        begun = a.begin_checkpoint(7, ["data.distcp"], rank=0, world_size=2, memory=True)
        for _ in range(100):  # until s has parked (its join registered)
            if begun.standby is not None:
                break
            time.sleep(0.05)
            begun = a.begin_checkpoint(7, ["data.distcp"], rank=0, world_size=2, memory=True)
        assert begun.standby is not None and begun.standby.node_id == "s"
        raw, items = one_file(4096)
        name = "rank-00000/data.distcp"
        # s runs no generation (0) and takes the copy granted in generation 1.
        push(begun.standby, begun.version, name, [raw], items)
        assert server.memory.find(begun.version, name) is not None
        # A node that waits to join nothing takes no copy of a newer generation.
        joining[0] = False
        with pytest.raises(TransferDenied, match="this node runs 0"):
            push(begun.standby, begun.version, name, [raw], items)
        assert not parked.done()  # still parked: the copies ended nothing
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        server.stop()
        for c in (a, b, s):
            c.close()
        coordinator.stop()


def test_a_tampered_transfer_url_is_refused(pair: Pair) -> None:
    begun = pair.a.begin_checkpoint(7, ["data.distcp"], rank=0, world_size=2, memory=True)
    assert begun.replica is not None
    url = f"{pair.server.url}/v/{begun.version}/rank-00000/data.distcp"
    raw, items = one_file(64)
    token = begun.replica.token
    middle = len(token) // 4
    flipped = token[:middle] + ("B" if token[middle] == "A" else "A") + token[middle + 1 :]
    for t in ("", token.split(".")[0], flipped, token + "x"):
        response = httpx.put(
            f"{url}?token={quote(t)}",
            content=b'[[0,64,"%s"]]' % items[0][2].encode() + bytes(raw),
            headers={ITEMS_HEADER: str(len(b'[[0,64,"%s"]]' % items[0][2].encode()))},
            timeout=10,
        )
        assert response.status_code == 403, (t, response.text)
        assert json.loads(response.text)["code"] == "access_denied"
    assert not pair.server.memory.replica_path(begun.version, "rank-00000/data.distcp").exists()
