"""Never a world the job cannot take (issue 62, item 7): a job declares the world sizes
it takes (``JobSpec.world_sizes``, in nodes) or learns them from a worker's
``WorldSizeError`` (a global batch that a world does not split). A round seals the
largest of them its nodes make, and nodes beyond it wait as standbys, with no join
timeout, the status saying why; a newcomer ends a running generation only when it and
the nodes waiting make a larger size the job takes.

As rules over storage (SQLite and Azurite), then through the API as a trainer (the
client, and the trainer's own report of a ``WorldSizeError``) and an operator see it.
"""

from __future__ import annotations

import io
import threading
from datetime import timedelta
from typing import Any

import httpx
import pytest

from rallypoint.cli._inspect import print_status
from rallypoint.client import CREDENTIAL_HEADER, Assignment, JobFull
from rallypoint.client import StaleGeneration as ClientStaleGeneration
from rallypoint.client.models import MAX_WORLD_SIZES, JobSpec, WorldSizeReport
from rallypoint.service._rendezvous import Rendezvous
from rallypoint.service.errors import InvalidCredential, JobConflict, StaleGeneration, UnknownNode
from rallypoint.service.errors import JobFull as ServiceJobFull
from rallypoint.trainer import WorldSizeError, plan_batch, report_world_sizes

from .._rules import spec
from .._support import TOKEN, clients, join_all
from ..conftest import Clock, Start

#: What the HF Trainer's planning raises at a world of 3 for a global batch of 16.
ERROR = "WorldSizeError: a world of 3 ranks cannot split the global batch of 16 samples"


def register(rdzv: Rendezvous, nodes: str, s: JobSpec | None = None, **kw: Any) -> dict[str, str]:
    """Registers each node (one letter each) for the job's next round: their credentials."""
    out = {}
    for n in nodes:
        node = rdzv.register("job", n, f"host-{n}", 1, s, **kw)
        assert node.credential is not None
        out[n] = node.credential
    return out


def tick(rdzv: Rendezvous, clock: Clock, seconds: float = 1.0, beating: str = "") -> None:
    """Time passes (the nodes in ``beating`` beat first), and the coordinator ticks."""
    if beating:
        rdzv.record_beats("job", list(beating))
    clock.advance(seconds)
    rdzv.tick("job")


def ranks(rdzv: Rendezvous) -> dict[str, int]:
    job = rdzv.get_job("job")
    assert job.status == "sealed", job
    return rdzv.sealed("job", job.generation).ranks


def test_a_report_teaches_the_sizes_and_the_next_round_leaves_the_third_node_waiting(
    rdzv: Rendezvous, clock: Clock
) -> None:
    s = spec(2, 3, last_call=1)
    creds = register(rdzv, "abc", s)
    tick(rdzv, clock)
    assert ranks(rdzv) == {"a": 0, "b": 1, "c": 2}
    gen = rdzv.get_job("job").generation

    # Rank 2 of the world of 3 cannot split a global batch of 16: the ranks that can.
    report = WorldSizeReport(generation=gen, world_sizes=[1, 2, 4, 8, 16], rank=2, reason=ERROR)
    job = rdzv.learn_world_sizes("job", "c", report, creds["c"])
    assert job.status == "open" and job.learned_sizes == (2,)
    ended = f"rank 2 cannot train a world of 3 nodes: {ERROR}; the job takes worlds of 2 nodes"
    assert rdzv.status("job").history[-1].ended_reason == ended
    assert rdzv.summary(job).world_sizes == [2]
    with pytest.raises(StaleGeneration):  # another rank's report: the generation is over
        rdzv.learn_world_sizes("job", "a", report, creds["a"])

    # All three come back: the round seals the two survivors of lowest rank.
    creds = register(rdzv, "abc")
    tick(rdzv, clock, beating="abc")
    assert ranks(rdzv) == {"a": 0, "b": 1}
    job = rdzv.get_job("job")
    assert rdzv.outcome(job, "c", job.generation) == "missed"
    # c joins again (as its wait does once it missed the round): it ends nothing, and
    # waits beside the generation as a standby, with no join timeout.
    node = rdzv.register("job", "c", "host-c", 1, None)
    assert node.parked and node.round == job.generation + 1
    assert rdzv.get_job("job").etag == job.etag
    (waiting,) = rdzv.status("job").waiting
    assert waiting.node_id == "c" and waiting.standby
    assert waiting.reason is not None and waiting.reason.startswith(
        "standby: 2 members and 1 waiting make no larger world size the job takes (2 nodes)"
    )
    # No place is left for a fourth (max_nodes 3): it is refused, as a full job's are.
    with pytest.raises(ServiceJobFull, match="waiting for a world size it takes"):
        rdzv.register("job", "d", "host-d", 1, None)

    # a is lost: c takes its rank, b keeps its own.
    for _ in range(4):
        tick(rdzv, clock, beating="bc")
    tick(rdzv, clock, 0.0, beating="bc")
    register(rdzv, "b")  # its agent joins again
    tick(rdzv, clock, 0.0, beating="bc")
    assert ranks(rdzv) == {"c": 0, "b": 1}
    history = rdzv.status("job").history
    assert [g.world_size for g in history] == [3, 2, 2]
    assert (
        history[1].ended_reason is not None
        and "node a missed heartbeats" in history[1].ended_reason
    )


def test_declared_sizes_seal_the_largest_one_and_newcomers_that_make_a_larger_one_grow_it(
    rdzv: Rendezvous, clock: Clock
) -> None:
    s = spec(1, 4, last_call=1).model_copy(update={"world_sizes": (2, 4)})
    register(rdzv, "a", s)
    tick(rdzv, clock, 2, beating="a")
    job = rdzv.get_job("job")
    assert job.status == "open"  # a world of 1 is not one the job takes
    blocked = "waiting: 1 node(s) make no world size the job takes (2, 4 nodes)"
    info = rdzv.status("job")
    assert info.blocked == blocked and info.world_sizes == [2, 4]
    assert [w.reason for w in info.waiting] == [blocked]

    register(rdzv, "bc")
    tick(rdzv, clock, 2, beating="abc")
    assert ranks(rdzv) == {"a": 0, "b": 1}  # 3 nodes: the largest size they make is 2
    job = rdzv.get_job("job")
    assert rdzv.outcome(job, "c", job.generation) == "missed"
    # A hot join that would make 3 parks, and its ready ends nothing...
    d = rdzv.register("job", "d", "host-d", 1, None, warm=True)
    assert d.parked
    assert not rdzv.ready("job", "d", d.round)
    assert rdzv.get_job("job").etag == job.etag
    # ...but with c's, 2 + 2 is a size the job takes: c's ready ends the generation.
    c = rdzv.register("job", "c", "host-c", 1, None, warm=True)
    assert c.parked and rdzv.get_job("job").etag == job.etag
    assert rdzv.ready("job", "c", c.round)
    assert rdzv.status("job").history[-1].ended_reason == "node c joined"
    register(rdzv, "ab")
    tick(rdzv, clock, 0.0, beating="abcd")
    assert ranks(rdzv) == {"a": 0, "b": 1, "c": 2, "d": 3}


def test_a_job_that_learned_no_size_within_its_range_waits_and_says_why(
    rdzv: Rendezvous, clock: Clock
) -> None:
    s = spec(2, 3, last_call=1)
    creds = register(rdzv, "abc", s)
    tick(rdzv, clock)
    gen = rdzv.get_job("job").generation
    report = WorldSizeReport(generation=gen, world_sizes=[1, 4], reason=ERROR)
    job = rdzv.learn_world_sizes("job", "a", report, creds["a"])
    assert job.learned_sizes == ()
    register(rdzv, "abc")
    tick(rdzv, clock, 2, beating="abc")
    info = rdzv.status("job")
    assert info.status == "open" and info.world_sizes == []
    assert info.blocked == (
        "waiting: the job takes no world from 2 to 3 nodes (its spec: none; its workers: none)"
    )


def test_only_a_member_of_the_running_generation_reports(rdzv: Rendezvous, clock: Clock) -> None:
    creds = register(rdzv, "ab", spec(1, 3, last_call=1))
    tick(rdzv, clock)
    gen = rdzv.get_job("job").generation
    report = WorldSizeReport(generation=gen, world_sizes=[1], reason=ERROR)
    with pytest.raises(InvalidCredential):
        rdzv.learn_world_sizes("job", "a", report, creds["b"])
    with pytest.raises(UnknownNode):
        rdzv.learn_world_sizes("job", "z", report, creds["a"])
    with pytest.raises(StaleGeneration):
        rdzv.learn_world_sizes("job", "a", report.model_copy(update={"generation": gen + 1}), None)
    job = rdzv.get_job("job")
    assert job.status == "sealed" and job.learned_sizes is None


def test_declared_sizes_are_part_of_the_spec_a_joiner_must_match(rdzv: Rendezvous) -> None:
    s = spec(1, 4).model_copy(update={"world_sizes": (2, 4)})
    _, created = rdzv.create_job("job", s)
    assert created and rdzv.get_job("job").spec == s
    assert rdzv.create_job("job", s)[1] is False
    with pytest.raises(JobConflict):
        rdzv.create_job("job", spec(1, 4))


# --- through the API ----------------------------------------------------------------------


def test_a_trainer_reports_its_world_size_error_and_the_third_node_stands_by(start: Start) -> None:
    """Through the API: a bad spec is refused with 422; the trainer's report of a
    ``WorldSizeError`` (every rank's, the first counts) ends the generation; the next
    round seals a and b, and c waits as a standby (``status``, JSON and the CLI's)
    until a member leaves, when it goes in with b."""
    url = start("--token", TOKEN).url
    auth = {"Authorization": f"Bearer {TOKEN}"}
    base = {"min_nodes": 2, "max_nodes": 3}
    too_many = list(range(2, MAX_WORLD_SIZES + 3))
    bad = [[3, 2], [2, 2], [1, 2], [2, 4], [], ["2"], [True], [2.5], too_many]
    for sizes in bad:
        reply = httpx.put(f"{url}/v1/jobs/bad", json={**base, "world_sizes": sizes}, headers=auth)
        assert reply.status_code == 422 and reply.json()["code"] == "invalid_request", sizes
    declared = httpx.put(f"{url}/v1/jobs/good", json={**base, "world_sizes": [2, 3]}, headers=auth)
    assert declared.status_code == 201 and declared.json()["world_sizes"] == [2, 3]
    # A JSON number with no fraction is an integer, as the schema says.
    whole = httpx.put(f"{url}/v1/jobs/whole", json={**base, "world_sizes": [2.0, 3]}, headers=auth)
    assert whole.status_code == 201 and whole.json()["world_sizes"] == [2, 3]

    s = JobSpec(
        min_nodes=2,
        max_nodes=3,
        last_call=timedelta(seconds=0.5),
        heartbeat_timeout=timedelta(seconds=60),  # these clients do not beat
        join_timeout=timedelta(seconds=2),
    )
    nodes = clients(url, ["a", "b", "c"], job="hf", token=TOKEN)
    join_all(nodes, s)
    # In rank order: the two of lowest rank go on at world 2, the third waits.
    a, b, c = sorted(nodes, key=lambda n: n.assignment.rank if n.assignment else 0)
    assert c.assignment is not None and c.assignment.world_size == 3
    gen = c.assignment.generation
    route = f"{url}/v1/jobs/hf/nodes/{c.node_id}/world-sizes"
    body = {"generation": gen, "world_sizes": [1, 2, 4], "rank": 2, "reason": ERROR}
    own = {**auth, CREDENTIAL_HEADER: c.credential or ""}
    refused = [
        httpx.post(route, json=body, headers=auth),  # no credential
        httpx.post(route, json=body, headers={**auth, CREDENTIAL_HEADER: a.credential or ""}),
        httpx.post(route, json={**body, "world_sizes": [4, 2]}, headers=own),
        httpx.post(route, json={**body, "world_sizes": [0]}, headers=own),
        httpx.post(route, json={**body, "generation": gen + 1}, headers=own),
    ]
    assert [r.status_code for r in refused] == [403, 403, 422, 422, 409], refused
    assert all("code" in r.json() for r in refused)

    # Each rank's planning raised; the trainer's report is the client's call.
    errors = []
    for _ in range(2):
        with pytest.raises(WorldSizeError) as caught:
            plan_batch(16, 3, micro_batch=8)
        errors.append(caught.value)
    assert report_world_sizes(errors[0], c, rank=2, local_world_size=1) == [2]
    assert report_world_sizes(errors[0], c) is None  # reported once
    assert report_world_sizes(errors[1], a, rank=0, local_world_size=1) is None  # too late
    with pytest.raises(ClientStaleGeneration):
        a.report_world_sizes([2], ERROR, generation=gen)
    assert a.timeline().generations[0].cause == "world_size"
    metrics = httpx.get(f"{url}/metrics", headers=auth).text
    assert 'rallypoint_job_generations_ended{job="hf",reason="world_size"} 1.0' in metrics

    # The three join again: a and b train at world 2; c's join waits, as a standby.
    joined: dict[str, Assignment | BaseException] = {}

    def join(node: Any) -> None:
        try:
            joined[node.node_id] = node.join("127.0.0.1", timeout=timedelta(seconds=60))
        except BaseException as exc:
            joined[node.node_id] = exc

    threads = [threading.Thread(target=join, args=(n,), daemon=True) for n in (a, b, c)]
    for t in threads:
        t.start()
    for t in threads[:2]:
        t.join(30)
    in_world = {n: getattr(j, "world_size", j) for n, j in joined.items()}
    assert in_world == {a.node_id: 2, b.node_id: 2}
    # Past the job's 2 s join timeout, c still waits: it waits for a size.
    threads[2].join(3)
    assert c.node_id not in joined
    info = a.membership()
    assert info.world_sizes == [2] and info.world_size == 2
    (waiting,) = info.waiting
    assert waiting.node_id == c.node_id and waiting.standby and waiting.reason is not None
    assert "make no larger world size the job takes (2 nodes)" in waiting.reason
    raw = httpx.get(f"{url}/v1/jobs/hf", headers=auth).json()
    assert raw["waiting"][0]["reason"] == waiting.reason
    out = io.StringIO()
    print_status(info, out)
    assert (
        "nodes 2:3, sizes 2," in out.getvalue() and "standby  standby: 2 members" in out.getvalue()
    )
    with pytest.raises(JobFull):  # no place for a fourth to wait
        clients(url, ["d"], job="hf", token=TOKEN)[0].join(timeout=timedelta(seconds=5))

    # a leaves: c goes in with b (whose agent joins again), at a's rank.
    rank = joined[a.node_id].rank  # type: ignore[union-attr]
    a.leave("test")
    again = threading.Thread(target=join, args=(b,), daemon=True)
    again.start()
    for t in (again, threads[2]):
        t.join(30)
    now_c, now_b = joined[c.node_id], joined[b.node_id]
    assert isinstance(now_c, Assignment) and isinstance(now_b, Assignment)
    assert (now_c.rank, now_c.world_size, now_b.world_size) == (rank, 2, 2)
    # c acts for its node with the credential of the registration that went in (its
    # join, held while it missed a round and parked, said so at once, credential and all).
    assert c.heartbeat().action == "continue"


def test_a_join_that_missed_its_round_and_parks_hears_so_at_once(start: Start) -> None:
    """Three nodes join a job of world 2 at once, each request held for the seal: the
    two first in seal; the third's join, which missed the round and parks beside it,
    is answered ``standby`` at once with the node's credential (held on, it would be
    answered only at its wait's end, or never: released when the job finishes, its
    agent had no credential to leave with)."""
    url = start().url
    s = {"min_nodes": 2, "max_nodes": 3, "last_call": 0.5, "world_sizes": [2]}
    replies: dict[str, httpx.Response] = {}

    def join(node: str) -> None:
        body = {"node_id": node, "addr": "127.0.0.1", "port": 1, "spec": s, "wait": 30}
        replies[node] = httpx.post(f"{url}/v1/jobs/ws/join", json=body, timeout=40)

    threads = [threading.Thread(target=join, args=(n,), daemon=True) for n in "abc"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert sorted(r.json()["status"] for r in replies.values()) == ["sealed", "sealed", "standby"]
    (parked,) = [n for n, r in replies.items() if r.json()["status"] == "standby"]
    members = [n for n in replies if n != parked]
    credential = replies[parked].json()["credential"]
    for i, node in enumerate(members):  # the job is done: the standby is let go
        reply = httpx.post(
            f"{url}/v1/jobs/ws/nodes/{node}/leave",
            json={"reason": "finished"},
            headers={CREDENTIAL_HEADER: replies[node].json()["credential"]},
        )
        assert reply.status_code == 200, (i, reply.text)
    wait = {"round": replies[parked].json()["round"], "wait": 5}
    own = {CREDENTIAL_HEADER: credential}
    released = httpx.post(f"{url}/v1/jobs/ws/nodes/{parked}/wait", json=wait, headers=own)
    assert released.status_code == 410 and released.json()["code"] == "standby_released"
    left = httpx.post(f"{url}/v1/jobs/ws/nodes/{parked}/leave", json={"reason": "x"}, headers=own)
    assert left.status_code == 200, left.text
