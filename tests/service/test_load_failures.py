"""No loop, whatever the cause (issue 33): a generation whose ranks read the version they
were named but cannot load it (a ZeRO partition count that does not match, a model that
does not fit, an error in the user's load code) ends with the error's first line; after
two such generations in a row at one world size, a round of that size waits for a world
of another size instead of sealing a third, and its joins time out naming the reason.
As rules over storage (SQLite and Azurite), then through the API as a trainer and an
operator see it.
"""

from __future__ import annotations

import io
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rallypoint.cli._inspect import print_jobs, print_status
from rallypoint.cli.processes import Cluster, Coordinator
from rallypoint.client import CREDENTIAL_HEADER, JoinTimeout
from rallypoint.client import StaleGeneration as ClientStaleGeneration
from rallypoint.client.models import JobSpec, LoadFailure, RestoreFailure, ShardFile
from rallypoint.service._checkpoints import Checkpoints
from rallypoint.service._rendezvous import Rendezvous
from rallypoint.service.errors import (
    CheckpointConflict,
    InvalidCredential,
    StaleGeneration,
    UnknownNode,
)
from rallypoint.trainer import CheckpointCorrupt, CheckpointManager, TransferError, upload

from .._rules import commit, end, seal
from .._support import FILE, TOKEN, clients, ends, join_all, managers, status
from ..conftest import Start

ZERO = "ZeRORuntimeException: The checkpoint being loaded used a DP world size of 3"


def report(node: str, gen: int, rank: int = 0, reason: str = ZERO) -> RestoreFailure:
    return RestoreFailure(node_id=node, generation=gen, rank=rank, reason=reason)


def fail(ckpts: Checkpoints, version: int, gen: int, creds: dict[str, str]) -> LoadFailure:
    """Both ranks of a world-2 generation fail to load: the first report ends it."""
    first = ckpts.load_failed("job", version, report("a", gen, 0, ZERO + "\n  trace"), creds["a"])
    with pytest.raises(StaleGeneration):  # the generation ended with the first report
        ckpts.load_failed("job", version, report("b", gen, 1), creds["b"])
    return first


def test_a_world_that_failed_twice_to_load_waits_for_another_size(
    ckpts: Checkpoints, rdzv: Rendezvous
) -> None:
    gen, creds = seal(rdzv, ["a", "b", "c"])
    version = commit(ckpts, ["a", "b", "c"], gen, 10, creds)
    end(rdzv, gen, ["c"], creds)  # c is gone: the survivors form a world of 2

    gen2, creds = seal(rdzv, ["a", "b"])
    failure = fail(ckpts, version, gen2, creds)
    assert failure == LoadFailure(version=version, world_size=2, rank=0, reason=ZERO)
    info = rdzv.status("job")
    assert info.history[-1].ended_reason == f"rank 0 could not load v{version}: {ZERO}"
    assert info.history[-1].load_failure == failure
    assert info.load_failure == failure and info.blocked is None  # once may be bad luck
    assert not any(v.unrecoverable for v in ckpts.versions("job"))  # the version is whole

    gen3, creds = seal(rdzv, ["a", "b"])  # the second generation of 2 seals
    fail(ckpts, version, gen3, creds)
    info = rdzv.status("job")
    assert info.load_failure is not None and info.load_failure.count == 2
    blocked = f"waiting: v{version} failed to load at world 2 in 2 generations in a row"
    assert info.blocked is not None and info.blocked.startswith(blocked)

    # The survivors come back: a third round of 2 does not seal, however long it waits.
    for node in ("a", "b"):
        rdzv.register("job", node, f"host-{node}", 1, None)
    clock = rdzv.clock
    for _ in range(5):  # alive (they beat), past last_call: only the rule holds them
        rdzv.record_beats("job", ["a", "b"])
        clock.advance(2)  # type: ignore[attr-defined]
        job, _ = rdzv.tick("job")
        assert job.status == "open" and job.generation == gen3
    assert rdzv.status("job").blocked is not None

    # A replacement makes a world of 3: it seals, named the same version.
    rdzv.register("job", "d", "host-d", 1, None)
    rdzv.record_beats("job", ["a", "b", "d"])
    clock.advance(2)  # type: ignore[attr-defined]
    job, _ = rdzv.tick("job")
    assert job.status == "sealed" and job.world_size == 3
    assert rdzv.sealed("job", job.generation).checkpoint.version == version  # type: ignore[union-attr]
    assert rdzv.status("job").blocked is None


def test_an_end_of_another_kind_breaks_the_run(ckpts: Checkpoints, rdzv: Rendezvous) -> None:
    gen, creds = seal(rdzv, ["a", "b"])
    version = commit(ckpts, ["a", "b"], gen, 10, creds)
    end(rdzv, gen, ["b"], creds)
    gen, creds = seal(rdzv, ["a", "b"])
    fail(ckpts, version, gen, creds)
    gen, creds = seal(rdzv, ["a", "b"])
    end(rdzv, gen, ["b"], creds)  # a member left before loading: not a load failure
    assert rdzv.get_job("job").load_failure is None
    gen, creds = seal(rdzv, ["a", "b"])
    assert fail(ckpts, version, gen, creds).count == 1
    gen, _ = seal(rdzv, ["a", "b"])  # one failure in the run: a world of 2 still seals
    assert rdzv.get_job("job").status == "sealed"


def test_only_a_member_reports_and_only_for_the_version_it_was_named(
    ckpts: Checkpoints, rdzv: Rendezvous
) -> None:
    gen, creds = seal(rdzv, ["a", "b"])
    older = commit(ckpts, ["a", "b"], gen, 10, creds)
    version = commit(ckpts, ["a", "b"], gen, 20, creds)
    end(rdzv, gen, ["b"], creds)
    gen, creds = seal(rdzv, ["a", "b"])
    with pytest.raises(InvalidCredential):
        ckpts.load_failed("job", version, report("a", gen), creds["b"])
    with pytest.raises(UnknownNode):
        ckpts.load_failed("job", version, report("z", gen), creds["a"])
    with pytest.raises(StaleGeneration):
        ckpts.load_failed("job", version, report("a", gen - 1), creds["a"])
    with pytest.raises(CheckpointConflict, match=f"resumes from v{version}, not v{older}"):
        ckpts.load_failed("job", older, report("a", gen), creds["a"])
    job = rdzv.get_job("job")
    assert job.status == "sealed" and job.generation == gen and job.load_failure is None


def test_a_trainer_reports_and_an_operator_sees_why_the_job_waits(start: Start) -> None:
    """Through the API: the report, its refusals, ``status`` (JSON and the CLI's table),
    the page and the metrics; the joins of a blocked round time out naming the reason."""
    url = start("--token", TOKEN).url
    spec = JobSpec(
        min_nodes=2,
        max_nodes=3,
        last_call=timedelta(seconds=0.5),
        heartbeat_timeout=timedelta(seconds=10),
        join_timeout=timedelta(seconds=3),
    )
    a, b = clients(url, ["a", "b"], job="zero", token=TOKEN)
    join_all([a, b], spec)
    begun = {n.node_id: n.begin_checkpoint(10, [FILE]) for n in (a, b)}
    for n in (a, b):  # a version of both ranks, in storage
        upload(begun[n.node_id].upload_urls[FILE], b"x")
        info = n.report_checkpoint(
            begun[n.node_id].version, [ShardFile(name=FILE, size=1, checksum="xxh3-128:0")]
        )
    assert info.state == "committed"
    version = info.version
    auth = {"Authorization": f"Bearer {TOKEN}"}
    route = f"{url}/v1/jobs/zero/checkpoints/{version}/load-failures"
    for _ in range(2):
        join_all([a, b], spec)  # a new generation of the same two nodes
        assert a.assignment is not None and a.assignment.checkpoint is not None
        gen = a.assignment.generation
        body = {"node_id": "a", "generation": gen, "rank": 0, "reason": ZERO}
        own = {**auth, CREDENTIAL_HEADER: a.credential or ""}
        refused = [
            httpx.post(route, json=body, headers=auth),  # no credential
            httpx.post(route, json=body, headers={**auth, CREDENTIAL_HEADER: b.credential or ""}),
            httpx.post(route, json={**body, "reason": ""}, headers=own),
            httpx.post(route.replace(f"/{version}/", "/999/"), json=body, headers=own),
        ]
        assert [r.status_code for r in refused] == [403, 403, 422, 409]
        assert all("code" in r.json() for r in refused)
        recorded = b.report_load_failure(version, ZERO + "\nTraceback ...", rank=1)
        assert recorded.reason == ZERO and recorded.rank == 1
        with pytest.raises(ClientStaleGeneration):  # the report ended the generation
            a.report_load_failure(version, ZERO, rank=0)

    info = a.membership()
    assert info.status == "open" and info.load_failure is not None
    assert info.load_failure.count == 2
    blocked = f"waiting: v{version} failed to load at world 2 in 2 generations in a row"
    assert info.blocked is not None and info.blocked.startswith(blocked)
    out = io.StringIO()
    print_status(info, out)
    assert blocked in out.getvalue()
    assert f"rank 1 could not load v{version}: {ZERO}" in out.getvalue()
    out = io.StringIO()
    print_jobs(a.jobs(), out)
    assert "blocked" in out.getvalue().splitlines()[1].split()
    page = httpx.get(f"{url}/jobs/zero", headers=auth).text
    assert "<p id='blocked' class='error'>waiting: v" in page
    metrics = httpx.get(f"{url}/metrics", headers=auth).text
    assert 'rallypoint_job_blocked{job="zero"} 1.0' in metrics
    assert 'rallypoint_job_generations_ended{job="zero",reason="load_failed"} 2.0' in metrics

    # The two nodes come back: their round never seals, and the join says why.
    with pytest.raises(JoinTimeout, match=f"did not seal within 3 s; {blocked}"):
        join_all([a, b], spec)


#: A torchrun worker whose load, like ZeRO's, needs the world size it was saved at (or,
#: with --always-fail, never succeeds); it saves every few steps and logs JSON events.
WORKER = r"""
import argparse, json, os, time
import torch, torch.distributed as dist
from rallypoint.client import ElasticClient
from rallypoint.trainer import CheckpointManager, SavePolicy

p = argparse.ArgumentParser()
p.add_argument("--events", required=True)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--save-every", type=int, default=3)
p.add_argument("--always-fail", action="store_true")
a = p.parse_args()
client = ElasticClient.from_env(); assignment = client.join()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
checkpoints = CheckpointManager(client, policy=SavePolicy(progress=False))
model = torch.nn.Linear(4, 4)

def event(kind, **fields):
    line = {"event": kind, "generation": assignment.generation, "rank": rank,
            "world_size": world, **fields}
    with open(a.events, "a") as f:
        f.write(json.dumps(line) + "\n")

start = 0
with checkpoints.resuming() as restored:
    if restored is not None:
        saved = int(restored.state["world"])
        if a.always_fail or saved != world:
            raise RuntimeError(f"saved at world {saved}, cannot load at world {world}")
        model.load_state_dict(restored.state["model"])
        start = restored.step
event("resumed", step=start + 1, version=restored.version if restored else None)
for step in range(start + 1, a.steps + 1):
    time.sleep(0.2)  # paces the run so that the test can act mid-way
    w = model.weight.detach().clone(); dist.all_reduce(w)
    if step % a.save_every == 0:
        state = {"model": model.state_dict(), "world": torch.tensor(world)}
        checkpoints.save(state, step, blocking=True)
        event("saved", step=step)
    if rank == 0:
        event("step", step=step)
event("finished", step=a.steps)
checkpoints.close()
"""


def blocked_status(coordinator: Coordinator, job: str, timeout: float = 120) -> dict[str, Any]:
    """The job's status once it says it is blocked."""
    end_at = time.monotonic() + timeout
    while time.monotonic() < end_at:
        info = status(coordinator, job)
        if info["blocked"]:
            return info
        time.sleep(0.2)
    raise TimeoutError(f"{job} never blocked: {status(coordinator, job)}")


def worker(tmp_path: Path, *args: str) -> tuple[list[str], Path]:
    script, events = tmp_path / "worker.py", tmp_path / "events.jsonl"
    script.write_text(WORKER)
    return [str(script), "--events", str(events), *args], events


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_job_whose_survivors_cannot_load_waits_for_a_replacement(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """Nodes a, b and c (one process each) save at world 3; c is SIGKILLed. The two
    survivors' generations fail to load the version (the user's load needs world 3):
    twice, each ended with the error's first line, then the round of 2 holds back and
    the status says why. A replacement d makes a world of 3, which loads it and
    finishes; nothing looped."""
    script, events = worker(tmp_path)
    cluster = Cluster(coordinator.url, "noloop", tmp_path, nnodes="2:3", script=script)
    cluster.events_file = events
    try:
        cluster.start("a", "b", "c")
        cluster.wait_for(lambda e: e["event"] == "saved" and e["world_size"] == 3, timeout=150)
        cluster.kill("c")
        info = blocked_status(coordinator, "noloop")
        version = info["checkpoint"]["version"]
        failed = info["history"][-2:]
        why = f"could not load v{version}: RuntimeError: saved at world 3, cannot load at world 2"
        assert [g["world_size"] for g in failed] == [2, 2], info["history"]
        assert all(why in g["ended_reason"] for g in failed), failed
        assert info["blocked"].startswith(
            f"waiting: v{version} failed to load at world 2 in 2 generations in a row"
        )
        cluster.add("d")
        codes = cluster.wait(timeout=150)
    finally:
        cluster.stop()
    assert codes == {"a": 0, "b": 0, "c": -9, "d": 0}, codes
    history = status(coordinator, "noloop")["history"]
    # world 3, two failed worlds of 2, the world of 3 that finished: no third failure.
    assert [g["world_size"] for g in history] == [3, 2, 2, 3], ends(history)
    assert [bool(g["load_failure"]) for g in history] == [False, True, True, False]
    log = [e for e in cluster.events() if e["event"] == "finished"]
    assert {(e["world_size"], e["step"]) for e in log} == {(3, 12)} and len(log) == 3


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_job_that_can_load_at_no_size_fails_loudly_at_its_join_timeout(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """The user's load fails whatever the world: after a SIGKILL and two failed
    generations of the survivors, their round never seals, and at the join timeout the
    agents exit non-zero, their logs naming the reason."""
    script, events = worker(tmp_path, "--always-fail")
    cluster = Cluster(
        coordinator.url, "hopeless", tmp_path, nnodes="2:3", script=script, join_timeout=20
    )
    cluster.events_file = events
    try:
        cluster.start("a", "b", "c")
        cluster.wait_for(lambda e: e["event"] == "saved", timeout=150)
        cluster.kill("c")
        info = blocked_status(coordinator, "hopeless")
        codes = cluster.wait(timeout=120)
    finally:
        cluster.stop()
    assert codes["a"] != 0 and codes["b"] != 0, codes
    history = status(coordinator, "hopeless")["history"]
    assert [g["world_size"] for g in history] == [3, 2, 2], ends(history)
    for node in ("a", "b"):
        text = (tmp_path / f"hopeless.{node}.log").read_text()
        assert "did not seal within 20 s; " + info["blocked"] in text


def test_a_framework_load_that_raises_in_loading_is_reported(start: Start) -> None:
    """``CheckpointManager.loading()``, around a framework's own load (DeepSpeed's
    ``load_checkpoint``, the Trainer's): what raises is reported against the version the
    generation was named; a corrupt version and a storage error are not (they are the
    version's or storage's, not the loader's)."""
    url = start().url
    (m,) = managers(url, ["a"], 1, 1)
    m.save({"w": torch.ones(2)}, 1, blocking=True)
    for error in (CheckpointCorrupt("a file fails its checksum"), TransferError("503")):
        m.client.join("127.0.0.1", 30000)  # a restart: the next generation, named v1
        m = CheckpointManager(m.client, progress=False)
        with pytest.raises(type(error)), m.loading():
            raise error
        assert m.client.membership().status == "sealed"  # nothing reported, nothing ended
    m.client.join("127.0.0.1", 30000)
    m = CheckpointManager(m.client, progress=False)
    with pytest.raises(ValueError, match="boom"), m.loading():
        raise ValueError("boom\nmore lines")
    info = m.client.membership()
    assert info.status == "open"
    assert info.history[-1].ended_reason == "rank 0 could not load v1: ValueError: boom"
    m.close()
