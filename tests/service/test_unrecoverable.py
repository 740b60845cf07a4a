"""No loop, whatever the cause (issue 25): a version a rank of the running generation
could not load is marked unrecoverable, with the reason, and never named again; the
generation ends at once, and the next seal names the newest version still recoverable.
As rules over SQLite and Azurite; then a torchrun job whose only copy of its latest
memory version is made unreadable.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from rallypoint.cli._inspect import print_checkpoints
from rallypoint.cli.processes import Cluster, Coordinator, example_script, judge
from rallypoint.client import CREDENTIAL_HEADER
from rallypoint.client import StaleGeneration as ClientStaleGeneration
from rallypoint.client.models import RestoreFailure, ShardFile
from rallypoint.service._checkpoints import Checkpoints
from rallypoint.service._rendezvous import Rendezvous
from rallypoint.service.errors import (
    CheckpointConflict,
    InvalidCredential,
    StaleGeneration,
    UnknownNode,
)
from rallypoint.service.storage import BlobStore
from rallypoint.trainer import CheckpointCorrupt, CheckpointError, upload
from rallypoint.trainer.checkpoint._faults import HALT_ENV, HALT_FILE_ENV

from .._rules import begin_all, end, named, pointers, save_tiered, seal_and_save, seal_with_peers
from .._support import FILE, TOKEN, clients, join_all, managers, status
from .._support import spec as coordinator_spec
from ..conftest import Start


def failure(
    node: str, gen: int, reason: str = "rank-00001/data.distcp fails its checksum"
) -> RestoreFailure:
    return RestoreFailure(node_id=node, generation=gen, rank=1, reason=reason)


def test_a_version_that_failed_to_load_is_never_named_again(
    ckpts: Checkpoints, rdzv: Rendezvous, blobs: BlobStore
) -> None:
    nodes = ["a", "b"]
    gen, creds = seal_with_peers(rdzv, nodes)
    durable, _ = save_tiered(ckpts, blobs, nodes, gen, 5, creds)
    older, _ = save_tiered(ckpts, blobs, nodes, gen, 10, creds, every=100)
    latest, persisted = save_tiered(ckpts, blobs, nodes, gen, 15, creds, every=100)
    assert not persisted and pointers(rdzv) == (latest, durable)
    end(rdzv, gen, ["b"], creds)
    gen2, creds = seal_with_peers(rdzv, nodes)
    assert named(rdzv, gen2) == latest

    info = ckpts.unreadable("job", latest, failure("a", gen2), creds["a"])
    assert info.unrecoverable and not info.latest
    assert info.unrecoverable_reason == (
        f"rank 1 of generation {gen2}: rank-00001/data.distcp fails its checksum"
    )
    # The generation ends at once: its members regroup without waiting for a timeout.
    assert rdzv.get_job("job").status == "open"
    assert rdzv.generation("job", gen2).ended_reason.startswith(
        f"checkpoint v{latest} unrecoverable: rank 1"
    )
    # The pointer moved back to the newest good version, and the next seal names it:
    # the memory version before it, which live holders still have, not the durable one.
    assert pointers(rdzv) == (older, durable)
    gen3, creds = seal_with_peers(rdzv, nodes)
    assert named(rdzv, gen3) == older
    assert [v.version for v in ckpts.versions("job") if v.unrecoverable] == [latest]
    assert ckpts.durabilities("job")["unrecoverable"] == 1
    # A second report keeps the first mark (and reason).
    again = ckpts.unreadable("job", latest, failure("b", gen3, "other"), creds["b"])
    assert again.unrecoverable_reason == info.unrecoverable_reason


def test_the_durable_version_failing_falls_back_to_the_durable_one_before(
    ckpts: Checkpoints, rdzv: Rendezvous
) -> None:
    nodes = ["a"]
    gen, creds, (first, second) = seal_and_save(ckpts, rdzv, nodes, [10, 20])
    ckpts.unreadable("job", second, failure("a", gen, "manifest.json is missing"), creds["a"])
    assert pointers(rdzv) == (first, first)
    assert named(rdzv, seal_with_peers(rdzv, nodes)[0]) == first


def test_only_a_member_of_the_running_generation_marks_a_committed_version(
    ckpts: Checkpoints, rdzv: Rendezvous
) -> None:
    nodes = ["a", "b"]
    gen, creds, (good,) = seal_and_save(ckpts, rdzv, nodes, [10])
    pending = begin_all(ckpts, nodes, gen, 20, creds)
    with pytest.raises(InvalidCredential):
        ckpts.unreadable("job", good, failure("a", gen), creds["b"])
    with pytest.raises(UnknownNode):
        ckpts.unreadable("job", good, failure("z", gen), creds["a"])
    with pytest.raises(StaleGeneration):
        ckpts.unreadable("job", good, failure("a", gen + 1), creds["a"])
    with pytest.raises(CheckpointConflict):
        ckpts.unreadable("job", pending, failure("a", gen), creds["a"])
    end(rdzv, gen, ["b"], creds)
    with pytest.raises(StaleGeneration):  # a zombie of an ended generation
        ckpts.unreadable("job", good, failure("a", gen), creds["a"])
    assert not any(v.unrecoverable for v in ckpts.versions("job"))
    assert pointers(rdzv)[0] == good


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_torchrun_job_whose_only_copy_is_unreadable_resumes_from_the_version_before(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """One node, 2 processes, every version after the first in its memory only. Once
    v3 (step 10) committed, its only copy of rank 1's file is corrupted and a worker
    is SIGKILLed: the restarted ranks cannot load v3, report it, and the job resumes
    from v2 (step 5) within 2 generations, the bytes saved at step 5 restored."""
    job, halt = "unreadable", tmp_path / "halt.json"
    events = tmp_path / "events.jsonl"
    script = [
        str(example_script().with_name("train_fsdp.py")),
        *("--steps", "15", "--checkpoint-every", "5", "--step-time", "0.05"),
        *("--persist-every", "1000", "--digests", "--dim", "32", "--events", str(events)),
    ]
    memory = tmp_path / "memory"
    cluster = Cluster(coordinator.url, job, tmp_path, nnodes="1:1", script=script, memory=memory)
    cluster.events_file = events
    try:
        # Rank 0 holds once step 10's save returned: v3 is committed, and no later
        # version can commit while it holds.
        cluster.add("a", nproc=2, env={HALT_ENV: "returned:10:0", HALT_FILE_ENV: str(halt)})
        end_at = time.monotonic() + 150
        while not (halt.is_file() and halt.read_text().endswith("}")):
            assert time.monotonic() < end_at, f"no halt; logs in {tmp_path}"
            time.sleep(0.05)
        latest = httpx.get(f"{coordinator.url}/v1/jobs/{job}/checkpoints/latest").json()
        assert (latest["version"], latest["step"], latest["durability"]) == (3, 10, "memory")
        data = memory / "a" / job / "a" / "v0000000003" / "rank-00001" / "data.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(raw)
        os.kill(json.loads(halt.read_text())["pid"], signal.SIGKILL)
        codes = cluster.wait(timeout=150)
    finally:
        cluster.stop()
    assert codes == {"a": 0}
    log = cluster.events()
    history = status(coordinator, job)["history"]
    verdict = judge(log, history)
    assert verdict.final_step == 15
    named_by = {g["generation"]: (g["checkpoint"] or {}).get("version") for g in history}
    # Generation 2 was named v3 and could not load it; generation 3 resumed from v2.
    assert [named_by[g] for g in sorted(named_by)][:3] == [None, 3, 2], history
    assert len(history) == 3, history
    assert history[1]["ended_reason"].startswith("checkpoint v3 unrecoverable: rank ")
    versions = httpx.get(f"{coordinator.url}/v1/jobs/{job}/checkpoints").json()
    marked = [(v["version"], v["unrecoverable"]) for v in versions if v["version"] <= 3]
    assert marked == [(1, False), (2, False), (3, True)]
    # Nothing a live holder had was lost: v2 came from the node's memory, as saved.
    resumed = [e for e in log if e["event"] == "resumed" and e["generation"] == 3]
    saved = {e["step"]: e["digests"] for e in log if e["event"] == "saving" and e["rank"] == 0}
    assert sorted(e["rank"] for e in resumed) == [0, 1]
    for e in resumed:
        assert (e["version"], e["step"], e["bytes"]) == (2, 6, 0)
        assert e["digests"] == saved[5]


def test_a_rank_reports_an_unreadable_version_and_everyone_sees_it(start: Start) -> None:
    """Through the API as a trainer calls it: the mark is in the version list, the CLI's
    table, the status page and the metrics; bad or foreign reports are refused and
    change nothing."""
    url = start("--token", TOKEN).url
    a, b = clients(url, ["a", "b"], job="ops", token=TOKEN)
    join_all([a, b], coordinator_spec(2, 2))
    # A one-rank-per-node version, both ranks in storage.
    versions = []
    for step in (10, 20):
        begun = {n.node_id: n.begin_checkpoint(step, [FILE]) for n in (a, b)}
        for n in (a, b):
            upload(begun[n.node_id].upload_urls[FILE], b"x")
            shard = ShardFile(name=FILE, size=1, checksum="xxh3-128:0")
            info = n.report_checkpoint(begun[n.node_id].version, [shard])
        assert info.state == "committed"
        versions.append(info.version)
    good, bad = versions
    assert a.assignment is not None
    gen = a.assignment.generation
    auth = {"Authorization": f"Bearer {TOKEN}"}
    route = f"{url}/v1/jobs/ops/checkpoints/{bad}/failures"
    body = {"node_id": "a", "generation": gen, "rank": 0, "reason": "gone"}
    refused = [
        httpx.post(route, json=body, headers=auth),  # no credential
        httpx.post(route, json=body, headers={**auth, CREDENTIAL_HEADER: b.credential or ""}),
        httpx.post(route, json={**body, "reason": ""}, headers=auth),
        httpx.post(route, json={**body, "reason": "x" * 1001}, headers=auth),
        httpx.post(route, json={**body, "generation": 7}, headers=auth),
    ]
    assert [r.status_code for r in refused][:2] == [403, 403]
    assert all(r.status_code in (400, 403, 409, 422) and "code" in r.json() for r in refused)
    assert not any(v.unrecoverable for v in a.checkpoints())

    marked = b.report_unreadable(bad, "rank-00001/data.distcp fails its checksum", rank=1)
    assert marked.unrecoverable and marked.unrecoverable_at is not None
    reason = f"rank 1 of generation {gen}: rank-00001/data.distcp fails its checksum"
    assert marked.unrecoverable_reason == reason
    assert a.checkpoint().version == good  # the latest moved back
    listed = {v.version: v for v in a.checkpoints()}
    assert listed[bad].unrecoverable and not listed[good].unrecoverable
    with pytest.raises(ClientStaleGeneration):  # the generation ended with the report
        a.report_unreadable(good, "late", rank=0)

    out = io.StringIO()
    print_checkpoints(list(listed.values()), out)
    rows = {line.split()[0]: line.split() for line in out.getvalue().splitlines()}
    assert rows[str(bad)][3] == "UNRECOVERABLE" and rows[str(good)][6] == "latest,durable"
    assert out.getvalue().rstrip().endswith(f"UTC: {reason}")
    page = httpx.get(f"{url}/jobs/ops", headers=auth).text
    assert "<span class='badge quarantined'>unrecoverable</span>" in page
    assert "fails its checksum" in page
    metrics = httpx.get(f"{url}/metrics", headers=auth).text
    assert 'rallypoint_checkpoint_unrecoverable{job="ops"} 1.0' in metrics


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_manager_reports_a_corrupt_version_but_not_a_state_that_does_not_fit(
    start: Start, tmp_path: Path
) -> None:
    """What is reported is what the version's copies are to blame for: a caller's
    tensors of another shape are the caller's fault, and must not walk the job's
    pointers back one version per restart."""
    url = start().url
    (m,) = managers(url, ["a"], 1, 1)
    m.save({"w": torch.arange(1000.0)}, 1, blocking=True)
    m.save({"w": torch.arange(1000.0) + 1}, 2, blocking=True)
    (m2,) = managers(url, ["a"], 1, 1)
    with pytest.raises((CheckpointError, ValueError), match=r"(?i)size") as mismatch:
        m2.load_latest({"w": torch.zeros(10)})
    assert not isinstance(mismatch.value, CheckpointCorrupt)
    assert not any(v.unrecoverable for v in m2.client.checkpoints())
    (shard,) = tmp_path.glob("storage/**/v0000000002/**/data.distcp")
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(data)
    with pytest.raises(CheckpointCorrupt, match="checksum"):
        m2.load_latest()
    marked = {v.version: v for v in m2.client.checkpoints()}
    assert marked[2].unrecoverable and "fails its checksum" in (
        marked[2].unrecoverable_reason or ""
    )
    (m3,) = managers(url, ["a"], 1, 1)  # the next generation
    restored = m3.load_latest()
    assert restored is not None and restored.version == 1
    assert torch.equal(restored.state["w"], torch.arange(1000.0))
