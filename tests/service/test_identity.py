"""Node credentials, as rules: only a node's current registration acts for it.

``join`` gives each registration of a node a credential; a request that acts for the
node (heartbeat, wait, leave, assignment, store, checkpoint begin, report and restore)
must carry it in ``X-Rallypoint-Credential``. Without it, with another node's, or with
one of the node's earlier registrations, the answer is 403 ``invalid_credential`` and
nothing changes. Store writes go only into the running generation, by its members. Real
coordinators on both backends; the coordinator's token is no node credential.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import httpx
import pytest

from rallypoint.client import (
    CREDENTIAL_HEADER,
    Assignment,
    ElasticClient,
    InvalidCredential,
    JobSpec,
    ShardFile,
    StoreRequest,
)
from rallypoint.trainer import upload
from rallypoint.trainer.agent._rendezvous import _Beats

from ..conftest import Start

JOB = "idj"
FILE = "shard.safetensors"
INVALID = (403, "invalid_credential")
ADMIN = "admin-token"
JSON = {"Content-Type": "application/json"}


def spec(nodes: int, timeout: float = 60) -> JobSpec:
    return JobSpec(
        min_nodes=nodes,
        max_nodes=nodes,
        last_call=timedelta(0),
        heartbeat_timeout=timedelta(seconds=timeout),
    )


def join_at_once(clients: list[ElasticClient], s: JobSpec | None = None) -> list[Assignment]:
    """Every client joins at once, each from a thread: their assignments."""
    with ThreadPoolExecutor(len(clients)) as pool:
        return list(pool.map(lambda c: c.join("127.0.0.1", spec=s), clients))


def join(url: str, names: list[str], s: JobSpec | None = None, **kw: Any) -> list[ElasticClient]:
    """Clients of ``names``, joined into one generation of exactly them (by default a job
    of exactly that many nodes)."""
    clients = [ElasticClient(url, JOB, n, **kw) for n in names]
    assignments = join_at_once(clients, s or spec(len(names)))
    assert len({a.generation for a in assignments}) == 1
    assert all(c.credential for c in clients)
    return clients


def as_node(credential: str | None) -> dict[str, str]:
    """Headers of a request that acts for a node with ``credential``."""
    return {CREDENTIAL_HEADER: credential} if credential is not None else {}


def wrong(holder: ElasticClient) -> dict[str, str | None]:
    """Credentials that are not another node's: none, ``holder``'s (a real credential of
    the job, of another node) and a made-up one."""
    return {"none": None, "another node's": holder.credential, "made up": "A" * 43}


def impostors(victim: ElasticClient, holder: ElasticClient) -> dict[str, ElasticClient]:
    """Clients that claim to be ``victim``, with each of :func:`wrong`."""
    return {
        label: ElasticClient(victim.url, JOB, victim.node_id, credential=credential)
        for label, credential in wrong(holder).items()
    }


def snapshot(url: str, nodes: list[str]) -> Any:
    """What a refused request must leave as it was: the job (generation, status,
    members, history, checkpoint pointers), every version, and the nodes' registrations."""
    status = httpx.get(f"{url}/v1/jobs/{JOB}", timeout=30).json()
    del status["as_of"], status["age"]  # when the view was read, and how old it is
    for member in status["members"]:
        member.pop("heartbeat_age")  # time passes; nothing else may change
        member.pop("state")
    for waiting in status["waiting"]:
        waiting.pop("heartbeat_age", None)
    versions = httpx.get(f"{url}/v1/jobs/{JOB}/checkpoints", timeout=30).json()
    for v in versions:
        v.pop("urls", None)  # signed afresh for each answer
    registrations = [httpx.get(f"{url}/v1/jobs/{JOB}/nodes/{n}", timeout=30).json() for n in nodes]
    return status, versions, registrations


def refused(reply: httpx.Response) -> tuple[int, str]:
    return reply.status_code, reply.json().get("code", "")


def b64(value: bytes) -> str:
    return base64.b64encode(value).decode()


# --- heartbeats ---------------------------------------------------------------------------


def chunked(body: bytes) -> Iterator[bytes]:
    """A body without a Content-Length: the heartbeat fast path leaves it to the route."""
    yield body


@pytest.mark.parametrize("path", ["fast path", "route"])
def test_a_heartbeat_for_another_node_is_refused_and_changes_nothing(
    start: Start, path: str
) -> None:
    url = start().url
    a, b = join(url, ["a", "b"])
    before = snapshot(url, ["a", "b"])
    beat = f"{url}/v1/jobs/{JOB}/nodes/b/heartbeat"
    for label, credential in wrong(a).items():
        for generation in (1, None):  # a member's beat, and a waiting node's
            body = httpx.Request("POST", beat, json={"generation": generation}).content
            content = body if path == "fast path" else chunked(body)
            reply = httpx.post(beat, content=content, headers=as_node(credential) | JSON)
            assert refused(reply) == INVALID, (label, generation, reply.text)
    assert snapshot(url, ["a", "b"]) == before
    # b's own credential beats for b.
    assert b.heartbeat().action == "continue"


def test_spoofed_heartbeats_do_not_keep_a_silent_member_alive(start: Start) -> None:
    """A process holding the job's token (and another node's credential) cannot keep a
    dead member "alive": the member is declared dead at its timeout all the same."""
    url = start().url
    a, _silent = join(url, ["a", "b"], spec(2, timeout=2))
    statuses: set[tuple[int, str]] = set()
    stop = threading.Event()

    def spoof() -> None:  # b is silent; someone beats for it, both ways, as fast as it can
        beat = f"{url}/v1/jobs/{JOB}/nodes/b/heartbeat"
        body = b'{"generation": 1}'
        while not stop.is_set():
            for credential in (a.credential, None):
                headers = as_node(credential) | JSON
                statuses.add(refused(httpx.post(beat, content=body, headers=headers)))
                statuses.add(refused(httpx.post(beat, content=chunked(body), headers=headers)))

    spoofer = threading.Thread(target=spoof)
    spoofer.start()
    try:
        with a.heartbeats(timedelta(seconds=0.3)) as beats:
            assert beats.restart.wait(30), "the silent member was kept alive"
    finally:
        stop.set()
        spoofer.join()
    assert statuses == {INVALID}
    ended = a.membership().history[0].ended_reason
    assert ended is not None and "b missed heartbeats" in ended, ended


# --- leave, wait and the assignment -------------------------------------------------------


@pytest.mark.parametrize("via", ["direct", "envelope"])
def test_a_leave_for_another_node_is_refused_and_changes_nothing(start: Start, via: str) -> None:
    url = start().url
    a, b = join(url, ["a", "b"])
    before = snapshot(url, ["a", "b"])
    for label, credential in wrong(a).items():
        for generation in (1, None):
            body = {"generation": generation, "reason": "spoofed"}
            path = f"/v1/jobs/{JOB}/nodes/b/leave"
            if via == "direct":
                reply = httpx.post(f"{url}{path}", json=body, headers=as_node(credential))
            else:
                envelope = {"method": "POST", "path": path, "body": body}
                reply = httpx.post(f"{url}/v1/envelope", json=envelope, headers=as_node(credential))
            assert refused(reply) == INVALID, (label, generation, reply.text)
    assert snapshot(url, ["a", "b"]) == before
    assert b.node_info().state == "waiting"
    b.leave("with its own credential")
    status = a.membership()
    assert status.status == "open" and status.history[0].ended_reason == (
        "node b left: with its own credential"
    )


def test_a_wait_and_an_assignment_for_another_node_are_refused(start: Start) -> None:
    url = start().url
    a, b = join(url, ["a", "b"])
    before = snapshot(url, ["a", "b"])
    for label, impostor in impostors(b, a).items():
        with pytest.raises(InvalidCredential):
            impostor.assignment_in(1)
        reply = httpx.post(
            f"{url}/v1/jobs/{JOB}/nodes/b/wait",
            json={"round": 2, "wait": 0},
            headers=as_node(impostor.credential),
        )
        assert refused(reply) == INVALID, (label, reply.text)
    assert snapshot(url, ["a", "b"]) == before
    assert b.assignment is not None and b.assignment_in(1).rank == b.assignment.rank


# --- checkpoints --------------------------------------------------------------------------


def test_checkpoint_begin_report_and_restore_for_another_node_are_refused(start: Start) -> None:
    url = start().url
    a, b = join(url, ["a", "b"])

    def write(node: ElasticClient, step: int) -> tuple[int, list[ShardFile]]:
        begun = node.begin_checkpoint(step, [FILE])
        data = f"{node.node_id}@{step}".encode()
        upload(begun.upload_urls[FILE], data)
        return begun.version, [ShardFile(name=FILE, size=len(data), checksum="xxh3-128:0")]

    first, files_a = write(a, 1)
    assert a.report_checkpoint(first, files_a).state == "pending"
    _, files_b = write(b, 1)
    assert b.report_checkpoint(first, files_b).state == "committed"
    # Version 2: a reported, b's file is uploaded but not reported.
    second, files_a = write(a, 2)
    a.report_checkpoint(second, files_a)
    _, files_b = write(b, 2)
    before = snapshot(url, ["a", "b"])
    assert before[0]["checkpoint"]["version"] == first
    for label, impostor in impostors(b, a).items():
        with pytest.raises(InvalidCredential):  # b's report would commit version 2
            impostor.report_checkpoint(second, files_b, generation=1)
        with pytest.raises(InvalidCredential):  # a version of a step nobody saved
            impostor.begin_checkpoint(3, [FILE], generation=1)
        with pytest.raises(InvalidCredential):
            impostor.report_restore(first, {"storage": 1}, rank=1, generation=1)
        assert snapshot(url, ["a", "b"]) == before, label
    # b's own report commits it and moves the pointer.
    assert b.report_checkpoint(second, files_b).state == "committed"
    assert a.membership().checkpoint.version == second  # type: ignore[union-attr]


# --- registrations ------------------------------------------------------------------------


def test_a_retried_join_gets_the_same_credential_and_a_new_join_a_new_one(start: Start) -> None:
    url = start().url
    base = f"{url}/v1/jobs/{JOB}"
    s = spec(2).model_dump(mode="json")
    first = {"node_id": "a", "addr": "h", "port": 1, "spec": s, "join_id": "k1", "wait": 0}
    waiting = httpx.post(f"{base}/join", json=first, timeout=30)
    assert waiting.status_code == 202
    credential = waiting.json()["credential"]
    retried = httpx.post(f"{base}/join", json=first, timeout=30)  # the reply was lost
    assert (retried.status_code, retried.json()["credential"]) == (202, credential)
    b = ElasticClient(url, JOB, "b")
    b.join("127.0.0.1", spec=spec(2))
    sealed = httpx.post(f"{base}/join", json={**first, "wait": 30}, timeout=60).json()
    assert (sealed["status"], sealed["credential"]) == ("sealed", credential)
    assert b.membership().status == "sealed"  # a retry ends nothing
    a = ElasticClient(url, JOB, "a", credential=credential)
    assert a.assignment_in(1).rank == 0

    # A new join of a (a restarted process): a new registration, a new credential, and
    # the old one acts for nothing any more.
    renewed = ElasticClient(url, JOB, "a")
    join_at_once([renewed, b])
    assert renewed.assignment is not None and renewed.assignment.generation == 2
    assert renewed.credential not in (None, credential)
    before = snapshot(url, ["a", "b"])
    stale = ElasticClient(url, JOB, "a", credential=credential)
    with pytest.raises(InvalidCredential):
        stale.assignment_in(2)
    with pytest.raises(InvalidCredential):
        stale.begin_checkpoint(1, [FILE], generation=2)
    with pytest.raises(InvalidCredential):
        stale.store(2, StoreRequest(op="set", keys=["k"], values=[b64(b"old")]))
    with pytest.raises(InvalidCredential):
        stale.leave("an old process", fenced=False)
    beat = httpx.post(
        f"{base}/nodes/a/heartbeat", json={"generation": 2}, headers=as_node(credential)
    )
    assert refused(beat) == INVALID
    assert snapshot(url, ["a", "b"]) == before
    assert renewed.heartbeat().action == "continue"
    assert not renewed.store(2, StoreRequest(op="check", keys=["k"])).found


# --- the store ----------------------------------------------------------------------------


def store(c: ElasticClient, generation: int, **body: Any) -> httpx.Response:
    """A store request as ``c`` (its node id and credential), raw: the answer as sent."""
    return httpx.post(
        f"{c.url}/v1/jobs/{JOB}/store/{generation}",
        json={"node_id": c.node_id, **body},
        headers=as_node(c.credential),
        timeout=30,
    )


def value_of(c: ElasticClient, generation: int, key: str) -> str | None:
    reply = store(c, generation, op="get", keys=[key])
    assert reply.status_code == 200, reply.text
    values: list[str | None] = reply.json()["values"]
    return values[0]


WRITES: list[dict[str, Any]] = [
    {"op": "set", "keys": ["k"], "values": [b64(b"zombie")]},
    {"op": "add", "keys": ["n"], "amount": 5},
    {"op": "compare_set", "keys": ["k"], "expected": b64(b"kept"), "desired": b64(b"zombie")},
    {"op": "delete", "keys": ["k"]},
]


def test_store_writes_go_only_into_the_running_generation(start: Start) -> None:
    url = start().url
    a, b = join(url, ["a", "b"])
    assert store(a, 1, op="set", keys=["k"], values=[b64(b"kept")]).status_code == 200
    assert store(a, 1, op="add", keys=["n"], amount=1).json()["count"] == 1
    # No key of a future generation can be planted, nor read.
    for body in WRITES:
        assert refused(store(a, 2, **body)) == (409, "stale_generation"), body
    assert refused(store(a, 2, op="get", keys=["k"])) == (409, "stale_generation")
    b.leave("preempted")  # generation 1 ends
    for body in WRITES:
        assert refused(store(a, 1, **body)) == (409, "stale_generation"), body
    # Its members still read what it left (an exit barrier of the ended generation).
    assert value_of(a, 1, "k") == b64(b"kept")
    assert store(a, 1, op="get", keys=["n"]).json()["values"] == [b64(b"1")]
    assert store(b, 1, op="check", keys=["k"]).json()["found"] is True
    # Generation 2 seals (a and a newcomer): the writes refused above left nothing in it.
    c = ElasticClient(url, JOB, "c")
    join_at_once([a, c])
    assert a.assignment is not None and a.assignment.generation == 2
    assert store(a, 2, op="num_keys").json()["count"] == 0
    assert store(a, 2, op="check", keys=["k"]).json()["found"] is False


def test_store_requests_from_outside_the_generation_are_refused(start: Start) -> None:
    url = start().url
    # 1 to 2 nodes: both join at once (the seal at 2 is immediate), then a alone.
    s = JobSpec(min_nodes=1, max_nodes=2, last_call=timedelta(seconds=30))
    a, b = join(url, ["a", "b"], s)
    b.leave("scaled in")
    (a2,) = join(url, ["a"], s)  # generation 2: a alone (a new join of a's node)
    assert a2.assignment is not None and a2.assignment.generation == 2
    assert store(a2, 2, op="set", keys=["k"], values=[b64(b"kept")]).status_code == 200
    stranger = ElasticClient(url, JOB, "stranger", credential=a2.credential)
    for body in [*WRITES, {"op": "get", "keys": ["k"]}]:
        # b is no member of generation 2, whatever its credential; a stranger never was.
        assert refused(store(b, 2, **body)) == INVALID, body
        assert refused(store(stranger, 2, **body)) == INVALID, body
        # A member's id with another's credential, or none, or without a node id at all.
        for label, credential in wrong(b).items():
            reply = httpx.post(
                f"{url}/v1/jobs/{JOB}/store/2",
                json={"node_id": "a", **body},
                headers=as_node(credential),
            )
            assert refused(reply) == INVALID, (label, body, reply.text)
        reply = httpx.post(
            f"{url}/v1/jobs/{JOB}/store/2", json=body, headers=as_node(a2.credential)
        )
        assert refused(reply) == INVALID, body
    # a's own credential of generation 1 reads generation 1's keys, not generation 2's.
    old = ElasticClient(url, JOB, "a", credential=a.credential)
    assert refused(store(old, 2, op="get", keys=["k"])) == INVALID
    assert value_of(a2, 2, "k") == b64(b"kept")


def test_store_counters_stay_within_int64(start: Start) -> None:
    url = start().url
    (a,) = join(url, ["a"])
    top = 2**63 - 1
    assert store(a, 1, op="add", keys=["n"], amount=top).json()["count"] == top
    assert refused(store(a, 1, op="add", keys=["n"], amount=1)) == (400, "invalid_request")
    assert refused(store(a, 1, op="add", keys=["n"], amount=2**64)) == (422, "invalid_request")
    assert value_of(a, 1, "n") == b64(str(top).encode())


# --- the operator -------------------------------------------------------------------------


def test_the_operator_removes_a_node_and_its_agent_sees_it_left(start: Start) -> None:
    url = start("--token", ADMIN).url
    a, b = join(url, ["a", "b"], token=ADMIN)
    # b's agent watches its generation as torchrun's plugin does.
    agent = _Beats(b, timedelta(seconds=0.5))
    remove = f"{url}/v1/jobs/{JOB}/nodes/b"
    assert httpx.delete(remove).status_code == 401
    reply = httpx.delete(remove, headers={"Authorization": f"Bearer {ADMIN}"})
    assert reply.status_code == 200, reply.text
    deadline = time.monotonic() + 30
    while agent.ended is None:
        assert time.monotonic() < deadline, "b's agent was not told"
        time.sleep(0.05)
    agent.stop()
    assert agent.left  # its agent stops rather than joining again
    assert b.node_info().state == "left"
    status = a.membership()
    assert status.status == "open" and status.history[0].ended_reason == "node b removed"
    assert a.heartbeat().action == "restart"
    unknown = httpx.delete(
        f"{url}/v1/jobs/{JOB}/nodes/nobody", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert refused(unknown) == (404, "unknown_node")
