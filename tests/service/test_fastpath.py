"""The heartbeat fast path answers exactly as the route: the same beats, well-formed and
malformed, sent to a coordinator with it and to one without it (two replicas of one
job, in this process), get the same status and body."""

from __future__ import annotations

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


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[TestClient, TestClient]]:
    settings = Settings(storage=f"local:{tmp_path}", token=TOKEN)
    with (
        TestClient(create_app(settings), base_url="http://fast") as fast,
        TestClient(create_app(settings, fast_path=False), base_url="http://route") as route,
    ):
        yield fast, route


def test_the_fast_path_answers_every_beat_as_the_route_does(
    replicas: tuple[TestClient, TestClient],
) -> None:
    fast, route = replicas
    admin = {"Authorization": f"Bearer {TOKEN}"}
    spec = JobSpec(min_nodes=1, max_nodes=2, last_call=timedelta(0))
    joined = fast.post(
        "/v1/jobs/job/join",
        json={"node_id": "a", "addr": "h", "port": 1, "spec": spec.model_dump(mode="json")},
        headers=admin,
    )
    assert joined.status_code == 200 and joined.json()["status"] == "sealed", joined.text
    credential = joined.json()["credential"]
    reader = fast.post(
        "/v1/tokens", json={"job_id": "job", "role": "reader"}, headers=admin
    ).json()["token"]
    other = fast.post(
        "/v1/tokens", json={"job_id": "other", "role": "trainer"}, headers=admin
    ).json()["token"]
    member = {**admin, CREDENTIAL_HEADER: credential}
    path = "/v1/jobs/job/nodes/a/heartbeat"
    beats: list[tuple[str, str, dict[str, str], Any]] = [
        ("a member's beat", path, member, {"generation": 1}),
        ("a held beat", path, member, {"generation": 1, "wait": 0.1}),
        ("a beat outside a generation", path, member, {}),
        ("a stale generation", path, member, {"generation": 7}),
        ("a float generation", path, member, {"generation": 1.0}),
        ("a string generation", path, member, {"generation": "1"}),
        ("a negative wait", path, member, {"generation": 1, "wait": -1}),
        ("an unknown field", path, member, {"generation": 1, "x": 1}),
        ("no credential", path, admin, {"generation": 1}),
        ("another's credential", path, {**admin, CREDENTIAL_HEADER: "x" * 43}, {"generation": 1}),
        ("a long credential", path, {**admin, CREDENTIAL_HEADER: "x" * 129}, {"generation": 1}),
        ("no token", path, {CREDENTIAL_HEADER: credential}, {"generation": 1}),
        ("a wrong token", path, {**member, "Authorization": "Bearer nope"}, {"generation": 1}),
        ("a reader's token", path, {**member, "Authorization": f"Bearer {reader}"}, {}),
        ("another job's token", path, {**member, "Authorization": f"Bearer {other}"}, {}),
        ("an unknown node", "/v1/jobs/job/nodes/zz/heartbeat", member, {"generation": 1}),
        ("an unknown job", "/v1/jobs/nojob/nodes/a/heartbeat", member, {"generation": 1}),
        ("a bad node id", "/v1/jobs/job/nodes/a%20b/heartbeat", member, {"generation": 1}),
        ("not JSON", path, member, b"{generation"),
        ("a JSON list", path, member, [1]),
    ]
    for what, url, headers, body in beats:
        kwargs: dict[str, Any] = (
            {"content": body, "headers": {**headers, "Content-Type": "application/json"}}
            if isinstance(body, bytes)
            else {"json": body, "headers": headers}
        )
        answers = [client.post(url, **kwargs) for client in (fast, route)]
        assert [a.status_code for a in answers] == [answers[1].status_code] * 2, what
        assert answers[0].content == answers[1].content, what
        for header in ("content-type", "www-authenticate"):
            assert answers[0].headers.get(header) == answers[1].headers.get(header), what


def test_a_restart_says_why_and_a_continue_is_the_bytes_it_always_was(
    replicas: tuple[TestClient, TestClient],
) -> None:
    """Both ways alike: ``reason`` only where the coordinator has one, so an agent older
    than the field reads every ``continue`` as before."""
    fast, route = replicas
    admin = {"Authorization": f"Bearer {TOKEN}"}
    spec = JobSpec(min_nodes=1, max_nodes=2, last_call=timedelta(0)).model_dump(mode="json")
    first = {"node_id": "a", "addr": "h", "port": 1, "spec": spec}
    joined = fast.post("/v1/jobs/job/join", json=first, headers=admin).json()
    member = {**admin, CREDENTIAL_HEADER: joined["credential"]}
    path = "/v1/jobs/job/nodes/a/heartbeat"
    for client in (fast, route):
        beat = client.post(path, json={"generation": 1}, headers=member)
        assert beat.content == b'{"action":"continue","generation":1}', beat.text
    # A newcomer ends generation 1 (the job may grow to 2).
    fast.post("/v1/jobs/job/join", json={"node_id": "b", "addr": "h", "port": 2}, headers=admin)
    for client in (fast, route):
        # ``generation`` is the job's latest as each replica's snapshot has it (b's join
        # may have sealed generation 2 already): the rest is the same both ways.
        reply = client.post(path, json={"generation": 1}, headers=member).json()
        assert {k: reply[k] for k in ("action", "reason")} == {
            "action": "restart",
            "reason": "node b joined",
        }, reply
