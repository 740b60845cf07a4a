"""A replica never refuses a generation that another replica sealed since its last look.

Two coordinators in this process share one storage: A seals, and B's snapshot of the
job still shows the job before the seal (B's driver makes no pass in the test's time, so
the snapshot stays as stale as it ever is behind a balancer, for as long as a test
needs). Each route that acts for a generation, asked through B, reads the job from
storage on that miss and answers as A would, and still refuses a generation that never
sealed. (``tests/service/test_replicas.py`` runs the same behind a real round-robin balancer.)
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from rallypoint.client import CREDENTIAL_HEADER, JobSpec
from rallypoint.service.app import create_app
from rallypoint.service.settings import Settings

TOKEN = "admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
SPEC = JobSpec(min_nodes=1, max_nodes=2, last_call=timedelta(0)).model_dump(mode="json")


class Pair:
    """Replicas A and B of one storage; B's snapshot of ``job`` is from before A sealed
    generation 1 with node ``a`` in it."""

    def __init__(self, a: TestClient, b: TestClient) -> None:
        self.a, self.b = a, b
        # B starts driving the job (its first pass reads it: open, generation 0) and
        # makes no further pass: what it knows of the job is from before the seal.
        b.app.state.driver.interval = 3600.0
        joined = b.post("/v1/jobs/job/join", json=self.join("a", wait=0), headers=ADMIN)
        assert joined.status_code == 202, joined.text
        self.credential = {"a": joined.json()["credential"]}
        sealed = a.post(
            "/v1/jobs/job/nodes/a/wait", json={"round": 1, "wait": 10}, headers=self.as_("a")
        )
        assert sealed.json()["status"] == "sealed", sealed.text
        assert sealed.json()["assignment"]["generation"] == 1

    @staticmethod
    def join(node: str, wait: float) -> dict[str, Any]:
        return {"node_id": node, "addr": "h", "port": 1, "spec": SPEC, "wait": wait}

    def as_(self, node: str) -> dict[str, str]:
        return {**ADMIN, CREDENTIAL_HEADER: self.credential[node]}

    def misses(self, client: TestClient) -> float:
        text = client.get("/metrics", headers=ADMIN).text
        metric = r'^rallypoint_generation_miss_reads_total\{job="job"\} (\S+)$'
        found = re.search(metric, text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0


@pytest.fixture(params=[True, False], ids=["fast-path", "routes"])
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Pair]:
    settings = Settings(storage=f"local:{tmp_path}", token=TOKEN)
    with (
        TestClient(create_app(settings), base_url="http://a") as a,
        TestClient(create_app(settings, fast_path=request.param), base_url="http://b") as b,
    ):
        yield Pair(a, b)


def stale(reply: Any) -> bool:
    return bool(reply.status_code == 409 and reply.json()["code"] == "stale_generation")


def test_a_heartbeat_of_a_generation_sealed_elsewhere_continues(pair: Pair) -> None:
    path = "/v1/jobs/job/nodes/a/heartbeat"
    for _ in range(2):
        beat = pair.b.post(path, json={"generation": 1}, headers=pair.as_("a"))
        assert beat.status_code == 200, beat.text
        assert beat.json() == {"action": "continue", "generation": 1}
    # One read, and what it read is the snapshot now: the second beat read nothing.
    assert pair.misses(pair.b) == 1
    held = pair.b.post(path, json={"generation": 1, "wait": 0.05}, headers=pair.as_("a"))
    assert held.json() == {"action": "continue", "generation": 1}
    never = pair.b.post(path, json={"generation": 2}, headers=pair.as_("a"))
    assert stale(never), never.text
    assert "never sealed (latest is 1)" in never.json()["message"]
    assert pair.misses(pair.b) == 2  # a generation that never sealed is read, then refused


def test_an_assignment_of_a_generation_sealed_elsewhere_is_given(pair: Pair) -> None:
    got = pair.b.get("/v1/jobs/job/generations/1/nodes/a", headers=pair.as_("a"))
    assert got.status_code == 200, got.text
    assert got.json()["generation"] == 1 and got.json()["rank"] == 0
    members = pair.b.get("/v1/jobs/job/generations/1/members", headers=ADMIN)
    assert members.status_code == 200 and members.json()[0]["node_id"] == "a"
    assert stale(pair.b.get("/v1/jobs/job/generations/2/nodes/a", headers=pair.as_("a")))
    assert stale(pair.b.get("/v1/jobs/job/generations/2/members", headers=ADMIN))


def test_the_store_of_a_generation_sealed_elsewhere_is_open(pair: Pair) -> None:
    value = base64.b64encode(b"1").decode()
    body = {"op": "set", "keys": ["k"], "values": [value], "node_id": "a"}
    done = pair.b.post("/v1/jobs/job/store/1", json=body, headers=pair.as_("a"))
    assert done.status_code == 200, done.text
    get = {"op": "get", "keys": ["k"], "node_id": "a"}
    assert pair.b.post("/v1/jobs/job/store/1", json=get, headers=pair.as_("a")).json()[
        "values"
    ] == [value]
    assert stale(pair.b.post("/v1/jobs/job/store/2", json=body, headers=pair.as_("a")))


def test_a_checkpoint_of_a_generation_sealed_elsewhere_begins_and_commits(pair: Pair) -> None:
    begin = {"node_id": "a", "generation": 1, "step": 5, "files": ["f"]}
    begun = pair.b.post("/v1/jobs/job/checkpoints", json=begin, headers=pair.as_("a"))
    assert begun.status_code == 200, begun.text
    version = begun.json()["version"]
    report = {
        "node_id": "a",
        "generation": 1,
        "files": [{"name": "f", "size": 1, "checksum": "xxh3-128:00"}],
        "storage": False,
        "memory": ["a"],  # a one-node job's own memory tier commits it
    }
    path = f"/v1/jobs/job/checkpoints/{version}/shards"
    reported = pair.b.post(path, json=report, headers=pair.as_("a"))
    assert reported.status_code == 200, reported.text
    assert reported.json()["state"] == "committed"
    never = {**begin, "generation": 2}
    assert stale(pair.b.post("/v1/jobs/job/checkpoints", json=never, headers=pair.as_("a")))
    assert stale(pair.b.post(path, json={**report, "generation": 2}, headers=pair.as_("a")))


def test_a_wait_for_a_round_after_a_generation_sealed_elsewhere_sees_its_seal(
    pair: Pair,
) -> None:
    # Through A: a leaves (generation 1 ends), b joins and round 2 seals with b alone.
    left = pair.a.post("/v1/jobs/job/nodes/a/leave", json={"reason": "done"}, headers=pair.as_("a"))
    assert left.status_code == 200, left.text
    joined = pair.a.post("/v1/jobs/job/join", json=Pair.join("b", wait=10), headers=ADMIN)
    assert joined.json()["assignment"]["generation"] == 2, joined.text
    pair.credential["b"] = joined.json()["credential"]
    # B has not seen generation 1 sealed: a wait for round 2 reads the job, and answers.
    waited = pair.b.post(
        "/v1/jobs/job/nodes/b/wait", json={"round": 2, "wait": 0}, headers=pair.as_("b")
    )
    assert waited.status_code == 200, waited.text
    assert waited.json()["assignment"]["generation"] == 2
    assert pair.misses(pair.b) == 1
