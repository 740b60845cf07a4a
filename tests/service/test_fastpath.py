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


def answers(
    clients: tuple[TestClient, ...], url: str, headers: dict[str, str], body: Any
) -> list[Any]:
    kwargs: dict[str, Any] = (
        {"content": body, "headers": {**headers, "Content-Type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body, "headers": headers}
    )
    return [client.post(url, **kwargs) for client in clients]


def same(what: str, replies: list[Any]) -> None:
    first, second = replies
    assert first.status_code == second.status_code, (what, first.text, second.text)
    assert first.content == second.content, what
    for header in ("content-type", "www-authenticate", "retry-after"):
        assert first.headers.get(header) == second.headers.get(header), what


def test_the_fast_path_answers_every_join_and_wait_as_the_route_does(
    replicas: tuple[TestClient, TestClient],
) -> None:
    """Joins and waits, well-formed and malformed, to both replicas in turn: the second
    of each pair is the same join retried (the same ``join_id``), which storage answers
    as the first, so the replies must be the same bytes. (The round needs 4 nodes: it
    seals only once the last part asks it to.)"""
    fast, route = replicas
    admin = {"Authorization": f"Bearer {TOKEN}"}
    spec = JobSpec(min_nodes=4, max_nodes=4, last_call=timedelta(0)).model_dump(mode="json")
    reader = fast.post(
        "/v1/tokens", json={"job_id": "job", "role": "reader"}, headers=admin
    ).json()["token"]
    other = fast.post(
        "/v1/tokens", json={"job_id": "other", "role": "trainer"}, headers=admin
    ).json()["token"]

    def node(name: str, **extra: Any) -> dict[str, Any]:
        return {
            "node_id": name,
            "addr": "h",
            "port": 1,
            "spec": spec,
            "join_id": name,
            "wait": 0,
            **extra,
        }

    path = "/v1/jobs/job/join"
    joins: list[tuple[str, str, dict[str, str], Any]] = [
        ("a new job's first join, waiting", path, admin, node("a")),
        ("the second", path, admin, node("b")),
        ("another spec", path, admin, {**node("c"), "spec": {**spec, "min_nodes": 2}}),
        (
            "an unknown job without a spec",
            "/v1/jobs/nojob/join",
            admin,
            {**node("a"), "spec": None},
        ),
        ("a string port", path, admin, node("c", port="1")),
        ("a float port", path, admin, node("c", port=1.0)),  # an integral one is an int
        ("an unknown field", path, admin, node("c", x=1)),
        ("a bad node id", path, admin, node("a b")),
        ("a wait too long", path, admin, node("c", wait=61)),
        ("a bad job id", "/v1/jobs/a%20b/join", admin, node("c")),
        ("no token", path, {}, node("c")),
        ("a wrong token", path, {"Authorization": "Bearer nope"}, node("c")),
        ("a reader's token", path, {"Authorization": f"Bearer {reader}"}, node("c")),
        ("another job's token", path, {"Authorization": f"Bearer {other}"}, node("c")),
        ("not JSON", path, admin, b"{node_id"),
        ("a JSON list", path, admin, [1]),
    ]
    credentials: dict[str, str] = {}
    for what, url, headers, body in joins:
        replies = answers((fast, route), url, headers, body)
        same(what, replies)
        if replies[0].status_code == 202:
            credentials[body["node_id"]] = replies[0].json()["credential"]
    assert sorted(credentials) == ["a", "b", "c"], credentials

    member = {**admin, CREDENTIAL_HEADER: credentials["a"]}
    wait = "/v1/jobs/job/nodes/a/wait"
    waits: list[tuple[str, str, dict[str, str], Any]] = [
        ("a node's wait, not sealed", wait, member, {"round": 1, "wait": 0}),
        (
            "another's credential",
            wait,
            {**admin, CREDENTIAL_HEADER: credentials["b"]},
            {"round": 1},
        ),
        ("no credential", wait, admin, {"round": 1, "wait": 0}),
        ("a long credential", wait, {**admin, CREDENTIAL_HEADER: "x" * 129}, {"round": 1}),
        ("an unknown node", "/v1/jobs/job/nodes/zz/wait", member, {"round": 1, "wait": 0}),
        ("round 0", wait, member, {"round": 0}),
        ("a string round", wait, member, {"round": "1"}),
        ("a reader's token", wait, {**member, "Authorization": f"Bearer {reader}"}, {"round": 1}),
        ("not JSON", wait, member, b"{round"),
    ]
    for what, url, headers, body in waits:
        same(what, answers((fast, route), url, headers, body))

    # The fourth node seals the round: a's wait, through either replica, is the same
    # sealed reply (its assignment and rank).
    fourth = answers((fast,), path, admin, node("d"))[0]
    assert fourth.status_code in (200, 202), fourth.text
    sealed = answers((fast, route), wait, member, {"round": 1, "wait": 10})
    assert sealed[0].json()["status"] == "sealed", sealed[0].text
    same("a sealed round", sealed)
