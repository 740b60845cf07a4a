"""Quarantine: a quarantined version is never named; a pointer at it moves back,
atomically with the mark; retention keeps the good version; unquarantine undoes it;
racing commits and seals are not lost (as rules, on SQLite and Azurite). Then the admin
API, the CLI, the status page and the metrics against a real coordinator, and a torchrun
job whose every rank resumes from the good version.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from rallypoint.cli.processes import Cluster
from rallypoint.client import CheckpointConflict as ClientCheckpointConflict
from rallypoint.client import ElasticClient
from rallypoint.client import UnknownCheckpoint as ClientUnknownCheckpoint
from rallypoint.client.models import ShardFile
from rallypoint.service._checkpoints import Checkpoints
from rallypoint.service._rendezvous import Rendezvous
from rallypoint.service.errors import CheckpointConflict, UnknownCheckpoint, UnknownJob
from rallypoint.service.storage import BatchOp, BlobStore, Entity, Storage, Table
from rallypoint.trainer import upload

from .._coordinator import Coordinator
from .._rules import (
    begin_all,
    commit,
    end,
    join,
    named,
    pointers,
    report,
    save_tiered,
    seal_and_save,
    seal_with_peers,
)
from .._support import FILE, TOKEN, cli, clients, join_all
from .._support import spec as coordinator_spec
from ..conftest import Clock, Spawn


class Racing:
    """The real table, with a hook run just before the first batch that writes the job
    entity: another replica's write lands between this one's reads and its CAS."""

    def __init__(self, table: Table, hook: Callable[[], object]) -> None:
        self.table = table
        self.hook: Callable[[], object] | None = hook
        self.tries = 0

    def batch(self, ops: Sequence[BatchOp]) -> list[Entity | None]:
        if any(op.entity.row_key == "job" for op in ops):
            self.tries += 1
            hook, self.hook = self.hook, None
            if hook is not None:
                hook()
        return self.table.batch(ops)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.table, name)


Replica = Callable[[Callable[[], object]], tuple[Checkpoints, Racing]]


@pytest.fixture
def racing(storage: Storage, clock: Clock, blobs: BlobStore) -> Replica:
    """Starts a second coordinator replica on the same storage, whose next job write
    races: ``hook`` runs just before it."""

    def replica(hook: Callable[[], object]) -> tuple[Checkpoints, Racing]:
        table = Racing(storage.table("jobs"), hook)
        other = Rendezvous(table, clock)  # type: ignore[arg-type]  # a Table in all it does
        return Checkpoints(other, blobs, keep=3, timeout=timedelta(seconds=600)), table

    return replica


@dataclass(frozen=True)
class HalfCommitted:
    """A generation of a and b that committed ``good`` (step 10) and ``bad`` (step 20),
    and began ``newest`` (step 30), which a has reported: b's report commits it."""

    gen: int
    creds: dict[str, str]
    good: int
    bad: int
    newest: int


def half_committed(ckpts: Checkpoints, rdzv: Rendezvous) -> HalfCommitted:
    nodes = ["a", "b"]
    gen, creds, (good, bad) = seal_and_save(ckpts, rdzv, nodes, [10, 20])
    newest = begin_all(ckpts, nodes, gen, 30, creds)
    report(ckpts, "a", gen, newest, creds)
    return HalfCommitted(gen, creds, good, bad, newest)


def test_quarantining_the_latest_moves_both_pointers_back_and_the_next_seal_skips_it(
    ckpts: Checkpoints, rdzv: Rendezvous
) -> None:
    nodes = ["a", "b"]
    gen, creds, (good, bad) = seal_and_save(ckpts, rdzv, nodes, [10, 20])
    assert pointers(rdzv) == (bad, bad)

    info = ckpts.quarantine("job", bad, "loss spike at step 18")
    assert info.quarantined and info.quarantine_reason == "loss spike at step 18"
    assert not info.latest and not info.latest_durable
    assert pointers(rdzv) == (good, good)
    assert ckpts.get("job").version == good  # GET …/latest
    by_number = ckpts.get("job", bad)  # readable for whoever investigates it
    assert by_number.quarantined and by_number.urls
    assert [(v.version, v.quarantined, v.latest) for v in ckpts.versions("job")] == [
        (good, False, True),
        (bad, True, False),
    ]
    # The running generation is not ended: its ranks resumed already.
    job = rdzv.get_job("job")
    assert (job.generation, job.status) == (gen, "sealed")

    end(rdzv, gen, ["b"], creds)
    gen2, creds = seal_with_peers(rdzv, nodes)
    assert named(rdzv, gen2) == good
    # Its saves move the pointer forward from the good version's step.
    newer = commit(ckpts, nodes, gen2, 11, creds)
    assert pointers(rdzv) == (newer, newer)


def test_quarantine_with_restart_ends_the_running_generation(
    ckpts: Checkpoints, rdzv: Rendezvous
) -> None:
    nodes = ["a", "b"]
    gen, _, (good, bad) = seal_and_save(ckpts, rdzv, nodes, [10, 20])
    ckpts.quarantine("job", bad, "NaNs", restart=True)
    assert rdzv.get_job("job").status == "open"
    assert rdzv.generation("job", gen).ended_reason == f"checkpoint v{bad} quarantined: NaNs"
    assert named(rdzv, seal_with_peers(rdzv, nodes)[0]) == good


def test_the_durable_pointer_moves_back_on_its_own_and_a_lost_memory_version_falls_to_it(
    rdzv: Rendezvous, blobs: BlobStore
) -> None:
    ckpts = Checkpoints(rdzv, blobs, keep=4, timeout=timedelta(seconds=600))
    nodes = ["a", "b", "c"]
    gen, creds = seal_with_peers(rdzv, nodes)
    # The first version and every 2nd after it go to storage; the others stay in memory.
    saved = [
        save_tiered(ckpts, blobs, nodes, gen, step, creds, every=2) for step in (10, 20, 30, 40)
    ]
    assert [persisted for _, persisted in saved] == [True, False, True, False]
    v1, v2, v3, v4 = (version for version, _ in saved)
    assert pointers(rdzv) == (v4, v3)

    ckpts.quarantine("job", v3)  # the durable one, not the latest
    assert pointers(rdzv) == (v4, v1)
    ckpts.quarantine("job", v4)  # the latest: back to v2, newest good by step
    assert pointers(rdzv) == (v2, v1)

    # Every agent restarted: the memory copies are gone; v3 would qualify but is
    # quarantined, so the seal falls back to the durable pointer.
    end(rdzv, gen, nodes, creds)
    gen2, creds = seal_with_peers(rdzv, nodes, agents=dict.fromkeys(nodes, 2))
    assert named(rdzv, gen2) == v1
    assert pointers(rdzv) == (v1, v1)


def test_quarantining_every_version_leaves_no_pointer_and_a_fresh_start(
    ckpts: Checkpoints, rdzv: Rendezvous
) -> None:
    nodes = ["a"]
    gen, creds, (only,) = seal_and_save(ckpts, rdzv, nodes, [5])
    ckpts.quarantine("job", only)
    assert pointers(rdzv) == (None, None)
    with pytest.raises(UnknownCheckpoint):
        ckpts.get("job")
    end(rdzv, gen, nodes, creds)
    assert named(rdzv, seal_with_peers(rdzv, nodes)[0]) is None


def test_an_older_quarantined_version_is_skipped_when_the_latest_is_lost(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore
) -> None:
    nodes = ["a", "b", "c", "d"]
    gen, creds = seal_with_peers(rdzv, nodes)
    first, _ = save_tiered(ckpts, blobs, nodes, gen, 10, creds, every=1)
    second, _ = save_tiered(ckpts, blobs, nodes, gen, 20, creds, every=1)
    save_tiered(ckpts, blobs, nodes, gen, 30, creds, every=10)  # memory only
    ckpts.quarantine("job", second)  # the durable pointer: back to the first
    end(rdzv, gen, ["a", "b"], creds)  # a's files were on a and b only: the newest is lost
    assert named(rdzv, seal_with_peers(rdzv, ["c", "d"])[0]) == first


def test_retention_keeps_the_good_version_and_quarantined_ones_only_while_recent(
    rdzv: Rendezvous, blobs: BlobStore
) -> None:
    ckpts = Checkpoints(rdzv, blobs, keep=2, timeout=timedelta(seconds=600))
    nodes = ["a"]
    gen, creds = seal_with_peers(rdzv, nodes)
    v1, v2, v3 = (commit(ckpts, nodes, gen, step, creds) for step in (10, 20, 30))
    assert [v.version for v in ckpts.versions("job")] == [v2, v3]  # keep=2

    ckpts.quarantine("job", v3)
    assert ckpts.collect("job") == []
    assert pointers(rdzv) == (v2, v2)
    # A new version: the good one behind the quarantined one stays (counting the
    # quarantined one among the last 2 would have pushed it out).
    v4 = commit(ckpts, nodes, gen, 40, creds)
    kept = {v.version: v.quarantined for v in ckpts.versions("job")}
    assert kept == {v2: False, v3: True, v4: False}
    # Once two newer good ones exist, the quarantined one has had its time.
    v5 = commit(ckpts, nodes, gen, 50, creds)
    assert [v.version for v in ckpts.versions("job")] == [v4, v5]
    assert v1 not in kept


def test_unquarantine_moves_the_pointer_forward_only_within_the_generation(
    ckpts: Checkpoints, rdzv: Rendezvous
) -> None:
    nodes = ["a", "b"]
    gen, creds, (good, bad) = seal_and_save(ckpts, rdzv, nodes, [10, 20])
    ckpts.quarantine("job", bad, "suspect")
    info = ckpts.unquarantine("job", bad)
    assert not info.quarantined and info.quarantine_reason is None and info.latest
    assert pointers(rdzv) == (bad, bad)
    assert ckpts.unquarantine("job", bad).latest  # again: nothing changes

    # Quarantined again, and a new generation resumed from the good version: undoing
    # it now moves nothing (that generation's saves must be able to move the pointer).
    ckpts.quarantine("job", bad)
    end(rdzv, gen, ["b"], creds)
    gen2, creds = seal_with_peers(rdzv, nodes)
    assert named(rdzv, gen2) == good
    assert not ckpts.unquarantine("job", bad).latest
    assert pointers(rdzv) == (good, good)
    newer = commit(ckpts, nodes, gen2, 15, creds)
    assert pointers(rdzv) == (newer, newer)


def test_quarantine_again_keeps_the_first_mark(
    ckpts: Checkpoints, rdzv: Rendezvous, clock: Clock
) -> None:
    _, _, (version,) = seal_and_save(ckpts, rdzv, ["a"], [1])
    first = ckpts.quarantine("job", version, "first")
    clock.advance(60)
    again = ckpts.quarantine("job", version, "second")
    assert (again.quarantined_at, again.quarantine_reason) == (first.quarantined_at, "first")


def test_what_cannot_be_quarantined(ckpts: Checkpoints, rdzv: Rendezvous) -> None:
    nodes = ["a", "b"]
    gen, creds = seal_with_peers(rdzv, nodes)
    with pytest.raises(UnknownJob):
        ckpts.quarantine("nope", 1)
    with pytest.raises(UnknownCheckpoint):
        ckpts.quarantine("job", 1)
    with pytest.raises(UnknownCheckpoint):
        ckpts.unquarantine("job", 1)
    pending = begin_all(ckpts, nodes, gen, 1, creds)
    with pytest.raises(CheckpointConflict, match="not committed"):
        ckpts.quarantine("job", pending)
    assert not ckpts.get("job", pending).quarantined


def test_a_commit_racing_a_quarantine_is_not_lost(
    ckpts: Checkpoints, rdzv: Rendezvous, racing: Replica
) -> None:
    half = half_committed(ckpts, rdzv)
    # The quarantine reads the job (latest: bad); b's report commits the newest version
    # before the quarantine's batch; the quarantine judges again.
    other, table = racing(lambda: report(ckpts, "b", half.gen, half.newest, half.creds))
    other.quarantine("job", half.bad)
    assert table.tries == 2
    assert pointers(rdzv) == (half.newest, half.newest)
    assert ckpts.get("job", half.bad).quarantined


def test_a_quarantine_racing_a_commit_does_not_lose_the_commit(
    ckpts: Checkpoints, rdzv: Rendezvous, racing: Replica
) -> None:
    half = half_committed(ckpts, rdzv)
    # b's report (through the other replica) reads the job (latest: bad); the
    # quarantine moves the pointer back to good before the commit's batch; the commit
    # judges again and moves it forward from there.
    other, table = racing(lambda: ckpts.quarantine("job", half.bad))
    assert report(other, "b", half.gen, half.newest, half.creds) == "committed"
    assert table.tries == 2
    assert pointers(rdzv) == (half.newest, half.newest)
    assert ckpts.get("job", half.bad).quarantined and not ckpts.get("job", half.good).latest


def test_a_seal_racing_a_quarantine_names_the_good_version(
    ckpts: Checkpoints, rdzv: Rendezvous, clock: Clock, racing: Replica
) -> None:
    nodes = ["a", "b"]
    gen, creds, (good, bad) = seal_and_save(ckpts, rdzv, nodes, [10, 20])
    end(rdzv, gen, ["b"], creds)
    for i, n in enumerate(nodes):
        join(rdzv, "job", n, f"host-{n}", 29500 + i)
    clock.advance(1)

    # Another replica's tick judges the seal (names bad), then the quarantine lands
    # before its CAS: the seal fails and the next tick names the good version.
    other, table = racing(lambda: ckpts.quarantine("job", bad))
    other.rdzv.tick("job")
    other.rdzv.tick("job")
    job = rdzv.get_job("job")
    assert job.status == "sealed" and table.tries >= 2
    assert named(rdzv, job.generation) == good


# --- through a real coordinator -------------------------------------------------------


def by_hand(node: ElasticClient, step: int) -> int:
    """A one-node job's rank saves ``step`` to storage; the committed version."""
    begun = node.begin_checkpoint(step, [FILE])
    data = f"{node.node_id}@{step}".encode()
    upload(begun.upload_urls[FILE], data)
    shard = ShardFile(name=FILE, size=len(data), checksum="xxh3-128:0")
    info = node.report_checkpoint(begun.version, [shard])
    assert info.state == "committed"
    return info.version


def test_operators_quarantine_through_the_api_and_the_cli_and_see_it_everywhere(
    spawn: Spawn, transport: str
) -> None:
    url = spawn("--token", TOKEN).url
    (node,) = clients(url, ["a"], job="ops", token=TOKEN)
    join_all([node], coordinator_spec(1, 1))
    good, bad = by_hand(node, 10), by_hand(node, 20)
    operator = ElasticClient(url, "ops", "operator", TOKEN)
    flags = ["--url", url, "--token", TOKEN]

    with pytest.raises(ClientUnknownCheckpoint) as unknown:
        operator.quarantine(99)
    assert unknown.value.status == 404
    pending = node.begin_checkpoint(30, [FILE]).version
    with pytest.raises(ClientCheckpointConflict) as conflict:
        operator.quarantine(pending, "not yet")
    assert conflict.value.status == 409
    anonymous = httpx.put(f"{url}/v1/jobs/ops/checkpoints/{bad}/quarantine", json={})
    assert anonymous.status_code == 401
    too_long = httpx.put(
        f"{url}/v1/jobs/ops/checkpoints/{bad}/quarantine",
        json={"reason": "x" * 501},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert too_long.status_code in (400, 422) and "code" in too_long.json()

    done = cli("checkpoints", "quarantine", "ops", str(bad), "--reason", "loss spike", *flags)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"v{bad} (step 20) is quarantined; latest: v{good} (step 10")
    assert operator.checkpoint().version == good
    assert operator.checkpoint(bad).quarantined  # still readable by number

    listing = cli("checkpoints", "ops", *flags)
    assert listing.returncode == 0, listing.stderr
    rows = {line.split()[0]: line.split() for line in listing.stdout.splitlines()}
    assert rows[str(bad)][3] == "QUARANTINED" and rows[str(good)][6] == "latest,durable"
    assert f"v{bad} quarantined " in listing.stdout
    assert listing.stdout.rstrip().endswith("UTC: loss spike")

    auth = {"Authorization": f"Bearer {TOKEN}"}
    page = httpx.get(f"{url}/jobs/ops", headers=auth).text
    assert "<span class='badge quarantined'>quarantined</span>" in page
    assert "loss spike" in page
    metrics = httpx.get(f"{url}/metrics", headers=auth).text
    assert 'rallypoint_checkpoint_quarantined{job="ops"} 1.0' in metrics

    undone = cli("checkpoints", "unquarantine", "ops", str(bad), *flags)
    assert undone.returncode == 0, undone.stderr
    assert undone.stdout.startswith(f"v{bad} (step 20) is not quarantined; latest: v{bad} ")
    assert not operator.checkpoint().quarantined
    assert operator.checkpoint().version == bad


# A trainer under torchrun: a fresh job saves steps 10 and 20 and waits for the operator
# to end its generation; the next generation reports what each rank restored.
TRAINER = r"""
import json, sys, time
import torch, torch.distributed as dist
from rallypoint.client import ElasticClient
from rallypoint.trainer import CheckpointManager

events = sys.argv[1]
client = ElasticClient.from_env()
assignment = client.join()
dist.init_process_group("gloo")
rank = dist.get_rank()
manager = CheckpointManager(client, progress=False)
state = {"w": torch.zeros(4)}


def event(kind, **fields):
    line = {"event": kind, "generation": assignment.generation, "rank": rank, **fields}
    with open(events, "a") as f:
        f.write(json.dumps(line) + "\n")


restored = manager.load_latest(state)
if restored is None:
    for step in (10, 20):
        state["w"].fill_(step)
        handle = manager.save(state, step, rank_state={"rank": rank, "step": step}, blocking=True)
        version = handle.result().version
        dist.barrier()  # every rank reported: the version is committed
        event("saved", step=step, version=version)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until the agent ends this generation
        time.sleep(0.1)
    sys.exit(3)
event(
    "resumed",
    step=restored.step,
    version=restored.version,
    w=state["w"].tolist(),
    rank_state=restored.rank_state,
)
manager.close()
dist.destroy_process_group()
"""


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_torchrun_job_resumes_from_the_good_version_on_every_rank(tmp_path: Path) -> None:
    coordinator = Coordinator(["--storage", f"local:{tmp_path / 'storage'}"]).start()
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    events = tmp_path / "events.jsonl"
    cluster = Cluster(
        coordinator.url,
        "bad",
        tmp_path,
        nnodes="2:2",
        script=[str(script), str(events)],
        memory=tmp_path / "memory",
    )
    cluster.events_file = events

    def each_rank(kind: str, **where: Any) -> list[dict[str, Any]]:
        return [
            cluster.wait_for(
                lambda e, r=rank: (
                    e["event"] == kind
                    and e["rank"] == r
                    and all(e[k] == v for k, v in where.items())
                )
            )
            for rank in (0, 1)
        ]

    try:
        cluster.start("a", "b")
        saved = each_rank("saved", step=10) + each_rank("saved", step=20)
        good, bad = saved[0]["version"], saved[2]["version"]
        assert [e["version"] for e in saved] == [good, good, bad, bad] and good < bad
        done = cli(
            *("checkpoints", "quarantine", "bad", str(bad), "--reason", "loss spike"),
            *("--restart", "--url", coordinator.url),
        )
        assert done.returncode == 0, done.stderr
        resumed = each_rank("resumed")
        codes = cluster.wait(timeout=120)
        history = httpx.get(f"{coordinator.url}/v1/jobs/bad", timeout=10).json()["history"]
    finally:
        cluster.stop()
        coordinator.stop()
    assert codes == {"a": 0, "b": 0}
    assert [
        (e["generation"], e["step"], e["version"], e["w"], e["rank_state"]) for e in resumed
    ] == [(2, 10, good, [10.0] * 4, {"rank": rank, "step": 10}) for rank in (0, 1)]
    assert history[0]["ended_reason"] == f"checkpoint v{bad} quarantined: loss spike"
    assert history[1]["checkpoint"]["version"] == good
