"""The deployed shape under failure: three coordinator replicas on one Azurite behind a
real load balancer (HAProxy, health-checking ``/readyz``), with a replica SIGKILLed mid
round and mid training, Azurite frozen for 30 s, and Azurite killed and restarted on
its persisted data."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from rallypoint.cli.processes import Cluster, example_script, judge
from rallypoint.client import Assignment, CheckpointInfo, ElasticClient, JobSpec
from rallypoint.tls import ssl_context

from .._balancer import Topology
from .._support import HUNG_B, IMAGE_SIZE, hung_worker

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture
def topology(tmp_path: Path) -> Iterator[Topology]:
    t = Topology(tmp_path)
    yield t
    t.stop()


def storage_state(url: str) -> str:
    """What a replica's ``/readyz`` says of storage."""
    return str(
        httpx.get(f"{url}/readyz", timeout=2, verify=ssl_context()).json().get("storage_state")
    )


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def test_a_replica_killed_while_it_holds_the_round_costs_the_round_nothing(
    topology: Topology,
) -> None:
    spec = JobSpec(
        min_nodes=3, max_nodes=3, last_call=timedelta(0), heartbeat_timeout=timedelta(seconds=3)
    )
    assignments: dict[str, Assignment] = {}
    errors: list[BaseException] = []

    def join(node: str) -> None:
        try:
            client = ElasticClient(topology.url, "round", node)
            assignments[node] = client.join(spec=spec, timeout=timedelta(seconds=60))
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    # Both joins are held (the round waits for a third node): kill the replica that
    # holds most of them.
    wait_until(
        lambda: sum(int(s["scur"] or 0) for s in topology.balancer.stats().values()) >= 2,
        20,
        "two held joins",
    )
    killed = topology.kill_busiest()
    threads.append(threading.Thread(target=join, args=("c",)))
    threads[-1].start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    assert {a.generation for a in assignments.values()} == {1}
    assert sorted(a.rank for a in assignments.values()) == [0, 1, 2]
    history = topology.status("round")["history"]
    assert [g["generation"] for g in history] == [1] and history[0]["ended_at"] is None
    wait_until(  # two failed checks 0.5 s apart: the balancer takes it out
        lambda: topology.balancer.stats()[f"r{killed}"]["status"].startswith("DOWN"),
        10,
        "the balancer to mark the killed replica down",
    )


def cluster(topology: Topology, job: str, tmp_path: Path, steps: int, **kw: Any) -> Cluster:
    c = Cluster(
        topology.url,
        job,
        tmp_path,
        nnodes="2:2",
        steps=steps,
        heartbeat_timeout=6,
        last_call=1,
        **kw,
        image_size=IMAGE_SIZE,
    )
    c.start("a", "b")
    return c


def step_at(c: Cluster, step: int) -> dict[str, Any]:
    return c.wait_for(lambda e: e["event"] == "step" and e["step"] >= step)


def finish(c: Cluster, topology: Topology, steps: int) -> list[dict[str, Any]]:
    codes = c.wait(timeout=240)
    history = topology.status(c.job)["history"]
    verdict = judge(c.events(), history)
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == steps, codes
    return history


def test_a_replica_killed_mid_training_costs_no_restart(topology: Topology, tmp_path: Path) -> None:
    c = cluster(topology, "train", tmp_path, steps=120)
    try:
        step_at(c, 30)
        topology.kill_busiest()  # it holds heartbeat watches
        step_at(c, 60)
        history = finish(c, topology, 120)
    finally:
        c.stop()
    assert len(history) == 1, history  # one generation: nobody restarted


def committed(topology: Topology, job: str) -> list[CheckpointInfo]:
    # Through the client, as a user would: a replica whose storage breaker has not yet
    # seen storage come back answers 503 with Retry-After, and the client waits it out.
    with ElasticClient(topology.url, job, "observer") as client:
        return client.checkpoints()


def test_storage_frozen_for_30_s_during_training_costs_no_restart(
    topology: Topology, tmp_path: Path
) -> None:
    # Checkpoints every 5 steps (1.5 s), skipped while the last one waits for storage.
    script = [str(example_script()), "--steps", "100", "--step-time", "0.3"]
    script += ["--image-size", str(IMAGE_SIZE)]
    script += ["--checkpoint-every", "5", "--if-busy", "skip"]
    script += ["--events", str(tmp_path / "freeze.events.jsonl")]  # Cluster's events file
    c = cluster(topology, "freeze", tmp_path, steps=100, script=script)
    try:
        step_at(c, 10)
        with topology.azurite.frozen():
            frozen_at = time.time()
            time.sleep(30)  # the outage under test, not a wait for a result
            # Every replica stays in the balancer: storage is down for all of them.
            assert all(s["status"] == "UP" for s in topology.balancer.stats().values())
            during = [e for e in c.events() if e["event"] == "step" and e["t"] > frozen_at + 5]
        thawed_at = time.time()
        history = finish(c, topology, 100)
    finally:
        c.stop()
    assert len(history) == 1, history
    assert during, "training stalled while storage was frozen"
    after = [v for v in committed(topology, "freeze") if (v.committed_at or 0) > thawed_at]
    assert after, "no checkpoint committed after storage came back"


def test_storage_killed_and_restarted_on_its_data_is_recovered_on_its_own(
    topology: Topology,
) -> None:
    spec = JobSpec(
        min_nodes=2, max_nodes=2, last_call=timedelta(0), heartbeat_timeout=timedelta(seconds=6)
    )
    clients = [ElasticClient(topology.url, "restart", n) for n in ("a", "b")]
    threads = [threading.Thread(target=c.join, kwargs={"spec": spec}) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    with clients[0].heartbeats(), clients[1].heartbeats():
        # Stopped, not SIGKILLed: Azurite's own storage loses its last seconds to a
        # SIGKILL (it saves every few seconds), which is Azurite's, not Azure's, way.
        topology.azurite.terminate()
        replica = topology.replicas[0]
        wait_until(
            lambda: storage_state(replica.url) == "unavailable",
            10,
            "a replica to notice storage is gone",
        )
        assert topology.azurite.start(), topology.azurite.log.read_text()
        # Each replica finds storage again on its own: ready, and writes go through.
        for replica in topology.replicas:
            wait_until(
                lambda r=replica: storage_state(r.url) == "ok",
                20,
                f"replica {replica.url} to see storage again",
            )
        begun = clients[0].begin_checkpoint(1, rank=0, world_size=2)
        assert begun.version >= 1
    history = topology.status("restart")["history"]
    assert len(history) == 1 and history[0]["ended_at"] is None, history


def test_a_hung_rank_is_found_through_replicas_behind_the_balancer(
    topology: Topology, tmp_path: Path
) -> None:
    """Each beat, with its node's progress, reaches whichever replica the balancer picks
    and is kept in storage: the replica whose tick finds the hang reads them all."""
    c = Cluster(
        topology.url, "hang", tmp_path, nnodes="2:3", steps=300, step_time=0.1,
        heartbeat_timeout=6, last_call=1, image_size=IMAGE_SIZE,
    )  # fmt: skip
    try:
        c.start("a", "b", "c")
        c.wait_for(lambda e: e["event"] == "step" and e["step"] >= 10 and e["world_size"] == 3)
        generation, _, reason = hung_worker(topology, c, "b")  # type: ignore[arg-type]
        assert re.match(HUNG_B, reason), reason
        c.wait_for(lambda e: e["event"] == "step" and e["generation"] > generation)
    finally:
        c.stop()
