"""Bad requests get a 4xx with a machine-readable code, and change nothing stored."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rallypoint.client import CREDENTIAL_HEADER
from rallypoint.client.models import MAX_STACKS_BYTES

from .._inprocess import InProcessCoordinator


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A coordinator's URL and the credential of its job's one member, node a (every
    request here acts as a, so that the request itself is what is wrong)."""
    root = tmp_path_factory.mktemp("storage")
    coordinator = InProcessCoordinator(["--storage", f"local:{root}"]).start()
    # One job with one sealed generation, which no bad request may disturb.
    spec = {"min_nodes": 1, "max_nodes": 1, "last_call": 0, "heartbeat_timeout": 60}
    reply = httpx.post(
        f"{coordinator.url}/v1/jobs/job/join",
        json={"node_id": "a", "addr": "127.0.0.1", "port": 1234, "spec": spec, "wait": 30},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    credential = reply.json()["credential"]
    # And one checkpoint version being written (version 1), which must stay as it is.
    begun = httpx.post(
        f"{coordinator.url}/v1/jobs/job/checkpoints",
        json={"node_id": "a", "generation": 1, "step": 1},
        headers={CREDENTIAL_HEADER: credential},
        timeout=30,
    )
    assert begun.status_code == 200 and begun.json()["version"] == 1, begun.text
    yield coordinator.url, credential
    coordinator.stop()


@pytest.fixture
def url(served: tuple[str, str]) -> str:
    return served[0]


@pytest.fixture
def credential(served: tuple[str, str]) -> str:
    return served[1]


def snapshot(url: str) -> Any:
    jobs = httpx.get(f"{url}/v1/jobs").json()
    status = httpx.get(f"{url}/v1/jobs/job").json()
    del status["as_of"], status["age"]  # when the view was read, and how old it is
    for member in status["members"]:
        member.pop("heartbeat_age")  # time passes; nothing else may change
        member.pop("state")
    checkpoints = httpx.get(f"{url}/v1/jobs/job/checkpoints").json()
    return jobs, status, checkpoints


JOIN = {"node_id": "b", "addr": "h", "port": 1}
CKPT = "/v1/jobs/job/checkpoints"
ENVELOPE = "/v1/envelope"
INVALID = "invalid_request"
TOO_LARGE = "body_too_large"
UNKNOWN = "unknown_node"
BEGIN = {"node_id": "a", "generation": 1, "step": 2}
REPORT = {
    "node_id": "a",
    "generation": 1,
    "files": [{"name": "shard.safetensors", "size": 10, "checksum": "xxh3-128:0"}],
}
RESTORE = {
    "node_id": "a",
    "generation": 1,
    "rank": 0,
    "bytes_from": {"memory": 0, "peer": 0, "storage": 10},
}
RESTORES = f"{CKPT}/1/restores"
STACKS = "/v1/jobs/job/generations/1/nodes/a/stacks"

CASES: list[tuple[str, str, str, Any, int, str]] = [
    # (id, method, path, body (bytes = raw), status, code)
    ("malformed-json", "POST", "/v1/jobs/job/join", b'{"node_id": "b",', 400, "malformed_json"),
    ("not-an-object", "POST", "/v1/jobs/job/join", b"[1, 2]", 422, "invalid_request"),
    ("wrong-type", "POST", "/v1/jobs/job/join", {**JOIN, "port": "eighty"}, 422, "invalid_request"),
    ("missing-field", "POST", "/v1/jobs/job/join", {"node_id": "b"}, 422, "invalid_request"),
    ("unknown-field", "POST", "/v1/jobs/job/join", {**JOIN, "rank": 0}, 422, "invalid_request"),
    (
        "bad-node-id",
        "POST",
        "/v1/jobs/job/join",
        {**JOIN, "node_id": "../a"},
        422,
        "invalid_request",
    ),
    ("huge-wait", "POST", "/v1/jobs/job/join", {**JOIN, "wait": 3600}, 422, "invalid_request"),
    ("oversized", "POST", "/v1/jobs/job/join", {**JOIN, "addr": "h" * 70_000}, 413, TOO_LARGE),
    ("bad-job-id", "GET", "/v1/jobs/bad$id", None, 400, "invalid_id"),
    ("dotdot-job-id", "GET", "/v1/jobs/..", None, 404, "not_found"),
    (
        "dotdot-node-id",
        "POST",
        "/v1/jobs/job/join",
        {**JOIN, "node_id": ".."},
        422,
        "invalid_request",
    ),
    ("long-job-id", "GET", "/v1/jobs/" + "j" * 65, None, 400, "invalid_id"),
    ("encoded-slash", "GET", "/v1/jobs/a%2Fb", None, 404, "not_found"),
    ("encoded-slash-node", "POST", "/v1/jobs/job/nodes/a%2F..%2Fb/leave", {}, 404, "not_found"),
    ("unknown-job", "GET", "/v1/jobs/nojob", None, 404, "unknown_job"),
    ("join-unknown-job", "POST", "/v1/jobs/nojob/join", JOIN, 404, "unknown_job"),
    ("beyond-max", "POST", "/v1/jobs/job/join", {**JOIN, "wait": 0}, 409, "job_full"),
    (
        "conflicting-spec",
        "PUT",
        "/v1/jobs/job",
        {"min_nodes": 1, "max_nodes": 4, "last_call": 0, "heartbeat_timeout": 60},
        409,
        "job_conflict",
    ),
    (
        "min-over-max",
        "PUT",
        "/v1/jobs/new",
        {"min_nodes": 3, "max_nodes": 2},
        422,
        "invalid_request",
    ),
    ("negative-time", "PUT", "/v1/jobs/new", {"last_call": -1}, 422, "invalid_request"),
    (
        "future-generation",
        "POST",
        "/v1/jobs/job/nodes/a/heartbeat",
        {"generation": 9},
        409,
        "stale_generation",
    ),
    (
        "not-a-member",
        "POST",
        "/v1/jobs/job/nodes/zz/heartbeat",
        {"generation": 1},
        404,
        "unknown_node",
    ),
    (
        "stale-leave",
        "POST",
        "/v1/jobs/job/nodes/a/leave",
        {"generation": 0},
        422,
        "invalid_request",
    ),
    (
        "unknown-node-wait",
        "POST",
        "/v1/jobs/job/nodes/zz/wait",
        {"round": 2, "wait": 0},
        404,
        "unknown_node",
    ),
    ("no-route", "GET", "/v1/nothing", None, 404, "not_found"),
    ("ckpt-no-latest", "GET", f"{CKPT}/latest", None, 404, "unknown_checkpoint"),
    ("ckpt-unknown-version", "GET", f"{CKPT}/99", None, 404, "unknown_checkpoint"),
    ("ckpt-version-not-int", "GET", f"{CKPT}/abc", None, 422, "invalid_request"),
    ("ckpt-unknown-job", "GET", "/v1/jobs/nojob/checkpoints", None, 404, "unknown_job"),
    ("ckpt-stale", "POST", CKPT, {**BEGIN, "generation": 7}, 409, "stale_generation"),
    ("ckpt-not-member", "POST", CKPT, {**BEGIN, "node_id": "b"}, 404, "unknown_node"),
    ("ckpt-negative-step", "POST", CKPT, {**BEGIN, "step": -1}, 422, "invalid_request"),
    ("ckpt-path-trick", "POST", CKPT, {**BEGIN, "files": ["../x"]}, 422, "invalid_request"),
    ("ckpt-same-file-twice", "POST", CKPT, {**BEGIN, "files": ["a", "a"]}, 422, "invalid_request"),
    ("ckpt-rank-alone", "POST", CKPT, {**BEGIN, "rank": 0}, 422, INVALID),
    ("ckpt-rank-past-world", "POST", CKPT, {**BEGIN, "rank": 2, "world_size": 2}, 422, INVALID),
    ("ckpt-empty-world", "POST", CKPT, {**BEGIN, "rank": 0, "world_size": 0}, 422, INVALID),
    ("ckpt-huge-world", "POST", CKPT, {**BEGIN, "rank": 0, "world_size": 10**6}, 422, INVALID),
    ("ckpt-no-upload", "POST", f"{CKPT}/1/shards", REPORT, 409, "incomplete_upload"),
    ("ckpt-report-unknown", "POST", f"{CKPT}/42/shards", REPORT, 404, "unknown_checkpoint"),
    (
        "ckpt-report-stale",
        "POST",
        f"{CKPT}/1/shards",
        {**REPORT, "generation": 2},
        409,
        "stale_generation",
    ),
    (
        "ckpt-report-oversized",
        "POST",
        f"{CKPT}/1/shards",
        b"{" + b" " * (1100 * 1024) + b"}",
        413,
        "body_too_large",
    ),
    (
        "restore-other-source",
        "POST",
        RESTORES,
        {**RESTORE, "bytes_from": {"disk": 1}},
        422,
        INVALID,
    ),
    ("restore-negative", "POST", RESTORES, {**RESTORE, "bytes_from": {"peer": -1}}, 422, INVALID),
    ("restore-no-rank", "POST", RESTORES, {**RESTORE, "rank": None}, 422, INVALID),
    ("restore-not-member", "POST", RESTORES, {**RESTORE, "node_id": "b"}, 404, "unknown_node"),
    ("restore-stale", "POST", RESTORES, {**RESTORE, "generation": 2}, 409, "stale_generation"),
    (
        "restore-unknown-version",
        "POST",
        f"{CKPT}/42/restores",
        RESTORE,
        404,
        "unknown_checkpoint",
    ),
    # Version 1 is still being written: nothing can have been restored from it.
    ("restore-pending", "POST", RESTORES, RESTORE, 409, "checkpoint_conflict"),
    # The longest stacks, past other routes' 64 KiB, reach the route (no hang ended
    # generation 1); one character more is refused as the schema says, even as 12 bytes
    # of JSON escapes; a body past the route's 1 MiB is refused before it is read.
    ("stacks-no-hang", "PUT", STACKS, {"rank": 0, "stacks": "x" * MAX_STACKS_BYTES}, 404, UNKNOWN),
    (
        "stacks-too-long",
        "PUT",
        STACKS,
        {"rank": 0, "stacks": "\U0001f9ca" * (MAX_STACKS_BYTES + 1)},
        422,
        INVALID,
    ),
    ("stacks-oversized", "PUT", STACKS, b"{" + b" " * (1100 * 1024) + b"}", 413, TOO_LARGE),
    ("wrong-method", "DELETE", "/v1/jobs/job", None, 405, "method_not_allowed"),
    ("envelope-in-envelope", "POST", ENVELOPE, {"method": "GET", "path": ENVELOPE}, 422, INVALID),
    ("envelope-outside-v1", "POST", ENVELOPE, {"method": "GET", "path": "/healthz"}, 422, INVALID),
    ("envelope-bad-method", "POST", ENVELOPE, {"method": "PATCH", "path": "/v1/x"}, 422, INVALID),
    (
        "envelope-dotdot",
        "POST",
        ENVELOPE,
        {"method": "GET", "path": "/v1/jobs/%2e%2e/%2e%2e/healthz"},
        422,
        INVALID,
    ),
    ("envelope-no-path", "POST", ENVELOPE, {"method": "GET"}, 422, INVALID),
]
# Where the envelope answers for itself: it refuses a '.' or '..' segment before routing.
THROUGH_ENVELOPE = {
    "dotdot-job-id": (422, INVALID),
    "encoded-slash-node": (422, INVALID),
}


def enveloped(method: str, path: str, body: Any) -> bytes:
    """The envelope the client's ``transport="envelope"`` would send (raw bodies spliced
    in as they are, so a malformed one makes a malformed envelope)."""
    inner = body if isinstance(body, bytes) else json.dumps(body).encode()
    return b'{"method": %b, "path": %b, "body": %b}' % (
        json.dumps(method).encode(),
        json.dumps(path).encode(),
        inner,
    )


@pytest.mark.parametrize("via", ["direct", "envelope"])
@pytest.mark.parametrize(
    ("case", "method", "path", "body", "status", "code"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_requests_are_refused_and_change_nothing(
    url: str,
    credential: str,
    via: str,
    case: str,
    method: str,
    path: str,
    body: Any,
    status: int,
    code: str,
) -> None:
    before = snapshot(url)
    # As node a, with its credential: what is refused is the request, not the caller.
    headers = {CREDENTIAL_HEADER: credential}
    kwargs: dict[str, Any] = {"timeout": 30, "headers": headers}
    if via == "envelope":
        kwargs["content"] = enveloped(method, path, body)
        headers["Content-Type"] = "application/json"
        method, path = "POST", ENVELOPE
        status, code = THROUGH_ENVELOPE.get(case, (status, code))
    elif isinstance(body, bytes):
        kwargs["content"] = body
        headers["Content-Type"] = "application/json"
    elif body is not None:
        kwargs["json"] = body
    reply = httpx.request(method, f"{url}{path}", **kwargs)
    assert reply.status_code == status, reply.text
    payload = reply.json()
    assert payload["code"] == code
    assert isinstance(payload["message"], str) and payload["message"]
    assert snapshot(url) == before


def test_a_streamed_oversized_body_is_refused(url: str) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"node_id": "b", "addr": "'
        for _ in range(20):
            yield b"x" * 8192
        yield b'"}'

    reply = httpx.post(
        f"{url}/v1/jobs/job/join",
        content=chunks(),
        headers={"Content-Type": "application/json"},
    )
    assert reply.status_code == 413
    assert reply.json()["code"] == "body_too_large"


def test_a_zombie_from_an_ended_generation_is_fenced(tmp_path: Path) -> None:
    coordinator = InProcessCoordinator(["--storage", f"local:{tmp_path}"]).start()
    try:
        spec = {"min_nodes": 1, "max_nodes": 2, "last_call": 0, "heartbeat_timeout": 60}
        base = f"{coordinator.url}/v1/jobs/job"
        join = {"node_id": "a", "addr": "h", "port": 1, "spec": spec, "wait": 30}
        joined = httpx.post(f"{base}/join", json=join, timeout=60).json()
        assert joined["status"] == "sealed"
        a = {CREDENTIAL_HEADER: joined["credential"]}
        # b joins: generation 1 ends; a's old process keeps talking about it.
        httpx.post(f"{base}/join", json={**join, "node_id": "b", "wait": 0}, timeout=60)
        reply = httpx.post(f"{base}/nodes/a/leave", json={"generation": 1}, headers=a)
        assert (reply.status_code, reply.json()["code"]) == (409, "stale_generation")
        beat = httpx.post(f"{base}/nodes/a/heartbeat", json={"generation": 1}, headers=a).json()
        assert beat["action"] == "restart"
        history = httpx.get(base).json()["history"]
        assert history[0]["ended_reason"] == "node b joined"
    finally:
        coordinator.stop()
