"""The coordinator end to end: real uvicorn servers (in this process, or a process of its
own where one is killed), real ElasticClients."""

from __future__ import annotations

import hashlib
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rallypoint.client import (
    Assignment,
    ElasticClient,
    InvalidCredential,
    JobConflict,
    JobFull,
    RetryPolicy,
    StaleGeneration,
    StandbyReleased,
    Unauthorized,
    UnknownJob,
)
from rallypoint.client.models import FINISHED, ShardFile
from rallypoint.trainer import download, upload

from .._support import clients, join_all, spec
from ..conftest import Spawn, Start

# Every test here runs with the client calling each route, and through the envelope.
pytestmark = pytest.mark.usefixtures("transport")


def check_one_generation(assignments: list[Assignment]) -> None:
    generations = {a.generation for a in assignments}
    assert len(generations) == 1
    world = {a.world_size for a in assignments}
    assert world == {len(assignments)}
    assert sorted(a.rank for a in assignments) == list(range(len(assignments)))
    assert len({(a.master_addr, a.master_port) for a in assignments}) == 1
    assert len({a.members_digest for a in assignments}) == 1


def eventually_restart(node: ElasticClient, within: float = 5) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if node.heartbeat().action == "restart":
            return True
        time.sleep(0.05)
    return False


def test_nodes_join_one_generation(start: Start) -> None:
    url = start().url
    nodes = clients(url, ["a", "b", "c"])
    assignments = join_all(nodes, spec(3, 3))
    check_one_generation(assignments)
    status = nodes[0].membership()
    assert status.status == "sealed" and status.world_size == 3
    assert sorted(m.node_id for m in status.members) == ["a", "b", "c"]
    assert [j.job_id for j in nodes[0].jobs()] == ["job"]


def test_a_new_jobs_first_joins_log_no_warning(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    # The first join finds no job and creates it: what every job's start does, where the
    # driver once warned "no job 'job'" at each.
    url = start().url
    with caplog.at_level(logging.INFO, logger="rallypoint"):
        check_one_generation(join_all(clients(url, ["a", "b"]), spec(2, 2)))
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == []


def test_a_silent_member_makes_the_others_restart(start: Start) -> None:
    url = start().url
    nodes = clients(url, ["r0", "r1", "r2"])
    first = join_all(nodes, spec(2, 3, timeout=2))
    check_one_generation(first)
    by_node = {a.node_id: a.rank for a in first}
    beats = [c.heartbeats(timedelta(seconds=0.3)) for c in nodes[:2]]  # r2 is "killed"
    for b in beats:
        assert b.restart.wait(20), "survivors were not told to restart"
        assert b.error is None
    status = nodes[0].membership()
    assert (
        status.history[0].ended_reason and "r2 missed heartbeats" in status.history[0].ended_reason
    )
    second = join_all(nodes[:2])
    check_one_generation(second)
    assert second[0].generation == first[0].generation + 1
    # A survivor keeps its rank wherever the world of two has it (its files, its slot
    # of a layout); one whose rank is gone takes the free one (_seal.slotted). Which
    # node had rank 0 depends on the threads' join order, so both cases occur here.
    assert sorted(a.rank for a in second) == [0, 1]
    for a in second:
        if by_node[a.node_id] < 2:
            assert a.rank == by_node[a.node_id], (by_node, a)


def test_a_member_stopping_its_workers_is_waited_for_while_it_beats(start: Start) -> None:
    """A member told to restart that beats on (its agent stopping its workers, which may
    take longer than the heartbeat timeout) is alive: the round waits for it, rather than
    sealing without it, only for its join to end that generation (_seal.restarting)."""
    url = start().url
    a, b, c = clients(url, ["a", "b", "c"])
    first = join_all([a, b], spec(2, 3, last_call=0, timeout=1))
    assert {x.world_size for x in first} == {2}
    second: dict[str, Assignment] = {}

    def join(node: ElasticClient) -> threading.Thread:
        thread = threading.Thread(
            target=lambda: second.__setitem__(
                node.node_id, node.join("127.0.0.1", 30100, timeout=timedelta(seconds=20))
            ),
            daemon=True,
        )
        thread.start()
        return thread

    threads = [join(c)]  # ends generation 1
    assert eventually_restart(a)
    threads.append(join(a))
    # b beats on, told to restart each time, for over twice its heartbeat timeout.
    end = time.monotonic() + 2.5
    while time.monotonic() < end:
        assert b.heartbeat().action == "restart"
        time.sleep(0.2)
    assert second == {}, "the round sealed without b"  # a's and c's joins still wait
    threads.append(join(b))
    for thread in threads:
        thread.join(30)
    assert sorted(second) == ["a", "b", "c"]
    check_one_generation(list(second.values()))
    assert second["b"].generation == first[0].generation + 1


def until_parked(member: ElasticClient, standby: ElasticClient, within: float = 10) -> None:
    """Waits until the job shows a standby and ``standby``'s own join has read that it
    parks (or ``within`` s pass: the caller asserts). The status shows it a moment before
    its join's reply arrives, and the node's credential with it: under two xdist workers
    a ``ready`` sent in between was refused for want of one."""
    end = time.monotonic() + within
    while time.monotonic() < end and not (
        standby.parked_round is not None and any(w.standby for w in member.membership().waiting)
    ):
        time.sleep(0.02)


def test_a_standby_waits_past_its_join_timeout_and_takes_the_rank_of_a_leaver(
    start: Start,
) -> None:
    url = start().url
    a, b, s = clients(url, ["a", "b", "s"])
    job = spec(1, 2).model_copy(update={"standbys": 1})
    first = {x.node_id: x for x in join_all([a, b], job)}
    parked: list[Assignment] = []
    errors: list[BaseException] = []

    def stand_by() -> None:
        try:  # a timeout far shorter than the wait: a standby's wait has none
            parked.append(s.join(timeout=timedelta(seconds=0.5)))
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=stand_by)
    thread.start()
    # Parked: shown as a standby, and the members run on.
    until_parked(a, s)
    assert [w.node_id for w in a.membership().waiting if w.standby] == ["s"]
    thread.join(2)  # four times the join's timeout
    assert thread.is_alive() and not errors
    assert a.heartbeat().action == "continue"
    # b leaves: s takes its rank in a world of the same size.
    b.leave("preempted")
    assert a.heartbeat().action == "restart"
    again = join_all([a])
    thread.join(10)
    assert not errors and len(parked) == 1
    assert (parked[0].generation, parked[0].world_size) == (2, 2)
    assert parked[0].rank == first["b"].rank and again[0].rank == first["a"].rank


def test_a_hot_join_parks_until_it_says_ready_then_the_generation_ends_for_it(
    start: Start,
) -> None:
    url = start().url
    a, b, c = clients(url, ["a", "b", "c"])
    join_all([a, b], spec(1, 3))
    joined: list[BaseException | Assignment] = []
    thread = threading.Thread(target=lambda: joined.append(catch(lambda: c.join(warm=True))))
    thread.start()
    # Room for it, yet it parks: the members run on while its workers start.
    until_parked(a, c)
    assert [w.node_id for w in a.membership().waiting if w.standby] == ["c"]
    assert a.heartbeat().action == "continue" and b.heartbeat().action == "continue"
    assert c.parked_round == 2
    # Its workers wait to train: the generation ends for it, and the next seals with it.
    assert c.ready(2)
    assert eventually_restart(a)
    assert a.membership().history[0].ended_reason == "node c joined"
    again = join_all([a, b])
    thread.join(10)
    assert len(joined) == 1 and isinstance(joined[0], Assignment), joined
    assert (joined[0].generation, joined[0].world_size, joined[0].rank) == (2, 3, 2)
    check_one_generation([*again, joined[0]])
    # Ready again, for a round that sealed: nothing left to end.
    assert not c.ready(2)
    assert a.heartbeat().action == "continue"


def test_a_standby_beside_a_full_generation_ends_nothing_by_saying_ready(start: Start) -> None:
    url = start().url
    a, b, s = clients(url, ["a", "b", "s"])
    join_all([a, b], spec(1, 2).model_copy(update={"standbys": 1}))
    thread = threading.Thread(target=lambda: catch(lambda: s.join(warm=True)), daemon=True)
    thread.start()
    until_parked(a, s)
    assert s.ready(2)  # it still waits: no room, so it waits for a lost slot
    assert a.heartbeat().action == "continue" and a.membership().generation == 1
    a.leave(FINISHED)
    b.leave(FINISHED, fenced=False)
    thread.join(30)


def test_a_standby_is_released_once_the_members_finish(start: Start) -> None:
    url = start().url
    a, b, s = clients(url, ["a", "b", "s"])
    join_all([a, b], spec(1, 2).model_copy(update={"standbys": 1}))
    outcome: list[BaseException | Assignment] = []
    thread = threading.Thread(target=lambda: outcome.append(catch(s.join)))
    thread.start()
    until_parked(a, s)
    # The members' workers finished: each agent leaves as finished (the second finds
    # its generation over already, and leaves unfenced, as the agent does).
    a.leave(FINISHED)
    b.leave(FINISHED, fenced=False)
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], StandbyReleased), outcome
    assert outcome[0].status == 410
    # Not sealed into a run of its own (min_nodes 1 would let it), and a new run's
    # node (joining after the end) is not released.
    assert a.membership().generation == 1
    assert join_all([ElasticClient(url, "job", "next")])[0].generation == 2


def catch(call: Callable[[], Assignment]) -> BaseException | Assignment:
    try:
        return call()
    except BaseException as exc:  # the test reads it
        return exc


def test_leaving_restarts_the_others_and_zombies_are_fenced(start: Start) -> None:
    url = start().url
    nodes = clients(url, ["a", "b"])
    join_all(nodes, spec(1, 2))
    nodes[1].leave("preempted")
    assert nodes[0].heartbeat().action == "restart"
    with pytest.raises(StaleGeneration):
        nodes[0].leave("too late: generation 1 is over")
    again = join_all(nodes[:1])
    assert again[0].world_size == 1 and again[0].generation == 2


def test_two_coordinators_on_one_storage_behave_as_one(start: Start) -> None:
    one, two = start(), start()
    nodes = clients(one.url, ["n0", "n1", "n2"]) + clients(two.url, ["n3", "n4", "n5"])
    assignments = join_all(nodes, spec(6, 6))
    check_one_generation(assignments)
    # A departure through one, heartbeats through the other: the other replica's
    # snapshot of the job is at most one driver pass (0.1 s) old.
    nodes[4].leave("maintenance")
    assert eventually_restart(nodes[0])
    # Each replica reads its own view of the job (when, and so how old, is its own).
    fresh = {"as_of", "age"}
    assert ElasticClient(one.url, "job", "x").membership().model_dump(
        exclude=fresh
    ) == ElasticClient(two.url, "job", "x").membership().model_dump(exclude=fresh)


def registered(client: ElasticClient, count: int) -> bool:
    try:
        return len(client.membership().waiting) >= count
    except UnknownJob:
        return False


def test_a_coordinator_killed_mid_rendezvous_loses_nothing(spawn: Spawn) -> None:
    coordinator = spawn()
    patient = RetryPolicy(initial=timedelta(milliseconds=100), deadline=timedelta(seconds=60))
    nodes = clients(coordinator.url, ["a", "b", "c"], retry=patient)
    results: dict[str, Assignment] = {}

    def join(c: ElasticClient) -> None:
        # These nodes never heartbeat: the timeout must outlast the coordinator's restart
        # plus the clients' backoff, or it (rightly) ends the generation they sealed.
        s = spec(3, 3, timeout=30)
        results[c.node_id] = c.join("127.0.0.1", timeout=timedelta(seconds=90), spec=s)

    early = [threading.Thread(target=join, args=(c,)) for c in nodes[:2]]
    for t in early:
        t.start()
    deadline = time.monotonic() + 30
    while not registered(nodes[2], 2):  # both registered and long-polling
        assert time.monotonic() < deadline
        time.sleep(0.05)
    coordinator.kill()
    coordinator.start()
    join(nodes[2])
    for t in early:
        t.join(60)
    assert sorted(results) == ["a", "b", "c"], coordinator.log_tail()
    check_one_generation(list(results.values()))
    assert results["a"].generation == 1  # the registrations survived: no extra round


def test_the_token_guards_v1_but_not_the_probes(start: Start) -> None:
    url = start("--token", "s3cret").url
    assert httpx.get(f"{url}/healthz").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        reply = httpx.get(f"{url}/v1/jobs", headers=headers)
        assert reply.status_code == 401
        assert reply.json()["code"] == "unauthorized"
        assert reply.headers["www-authenticate"] == "Bearer"
    envelope = {"method": "GET", "path": "/v1/jobs"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Rallypoint-Token": "wrong"}):
        reply = httpx.post(f"{url}/v1/envelope", json=envelope, headers=headers)
        assert (reply.status_code, reply.json()["code"]) == (401, "unauthorized")
    with pytest.raises(Unauthorized):
        ElasticClient(url, "job", "a").jobs()
    # A gateway (AzureML) takes Authorization for its key: the token rides beside it.
    with pytest.raises(Unauthorized):
        ElasticClient(url, "job", "a", "wrong", endpoint_key="s3cret").jobs()
    assert ElasticClient(url, "job", "a", "s3cret", endpoint_key="gateway-key").jobs() == []
    (node,) = clients(url, ["a"], token="s3cret")
    assert join_all([node], spec(1, 1))[0].rank == 0


def test_client_errors_carry_the_code(start: Start) -> None:
    url = start().url
    (a,) = clients(url, ["a"])
    with pytest.raises(UnknownJob):
        a.membership()
    a.create_job(1, 1)
    a.create_job(1, 1)  # idempotent
    with pytest.raises(JobConflict):
        a.create_job(1, 2)
    join_all([a])
    with pytest.raises(JobFull):
        ElasticClient(url, "job", "b").join("127.0.0.1", timeout=timedelta(seconds=5))


WATCHER = """
import sys
from datetime import timedelta
from rallypoint.client import ElasticClient
c = ElasticClient(sys.argv[1], "cut", sys.argv[2])
c.join("127.0.0.1", 30000)
print("joined", flush=True)
while True:
    c.heartbeat(wait=timedelta(seconds=5))
"""


def watchers(url: str, nodes: list[str]) -> list[subprocess.Popen[str]]:
    """Members of job ``cut`` in processes of their own (:data:`WATCHER`), to be killed."""
    return [
        subprocess.Popen(
            [sys.executable, "-c", WATCHER, url, node], stdout=subprocess.PIPE, text=True
        )
        for node in nodes
    ]


def until_ended(client: ElasticClient, within: float, failure: str) -> None:
    """Waits until the job's generation is no longer sealed (``failure`` if not within)."""
    since = time.monotonic()
    while client.membership().status == "sealed":
        assert time.monotonic() - since < within, failure
        time.sleep(0.05)


def until_joined(procs: list[subprocess.Popen[str]]) -> None:
    """Waits until every watcher has its assignment."""
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "joined"


def beats(url: str, job: str) -> float:
    """The heartbeats the coordinator counted for ``job`` (each as it arrived)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "rallypoint_heartbeats_total" and s.labels == {"job": job}
    )


def beats_written_since(client: ElasticClient, since: float) -> bool:
    """Whether every member's last beat in storage was written at ``since`` or later."""
    asked = time.time()  # no later than the coordinator's clock when it answers
    members = client.membership().members
    return bool(members) and all(
        m.heartbeat_age is not None and asked - m.heartbeat_age >= since for m in members
    )


def test_a_member_killed_mid_watch_ends_its_generation_before_the_timeout(spawn: Spawn) -> None:
    coordinator = spawn()
    ElasticClient(coordinator.url, "cut", "x").create_job(
        2, 2, heartbeat_timeout=timedelta(seconds=60)
    )
    procs = watchers(coordinator.url, ["a", "b"])
    try:
        until_joined(procs)
        # A cut watch is judged against the node's last beat in storage, where the
        # driver writes beats within an interval of their arrival, stamped with it:
        # wait until both held beats arrived (counted) and beats that arrived after
        # that are in storage.
        deadline = time.monotonic() + 10
        while beats(coordinator.url, "cut") < 2:
            assert time.monotonic() < deadline, "the members never sent their held heartbeats"
            time.sleep(0.02)
        counted = time.time()
        client = ElasticClient(coordinator.url, "cut", "x")
        while not beats_written_since(client, counted):
            assert time.monotonic() < deadline, "the held heartbeats never reached storage"
            time.sleep(0.02)
        procs[1].send_signal(signal.SIGKILL)
        until_ended(client, 30, "not detected before half the timeout")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert client.membership().history[-1].ended_reason == "node b dropped its heartbeat connection"


def test_a_peers_failed_collective_ends_a_cut_members_generation_without_the_window(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member whose held heartbeat was cut counts as gone at once when another member
    reports a failed collective of that generation (_seal.corroborated): here the
    reconnect window is 30 s and the heartbeat timeout 60 s, so only the report can end
    the generation within the 15 s the test waits."""
    monkeypatch.setenv("RALLYPOINT_HEARTBEAT_RECONNECT", "30")
    coordinator = spawn()
    reporter = ElasticClient(coordinator.url, "cut", "c")
    reporter.create_job(3, 3, heartbeat_timeout=timedelta(seconds=60))
    procs = watchers(coordinator.url, ["a", "b"])
    try:
        joined = threading.Thread(target=reporter.join, args=("127.0.0.1", 30002))
        joined.start()
        until_joined(procs)
        joined.join(30)
        assert reporter.assignment is not None
        deadline = time.monotonic() + 10
        while beats(coordinator.url, "cut") < 2:  # both watchers hold a heartbeat
            assert time.monotonic() < deadline, "the members never sent their held heartbeats"
            time.sleep(0.02)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        # The report may come before the coordinator saw the cut, or after: both count.
        reporter.report_fault("RuntimeError: Connection reset by peer")
        until_ended(reporter, 15, "the report did not end the generation")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    history = reporter.membership().history
    assert history[-1].ended_reason == "node b dropped its heartbeat connection"
    # Its generation is over: a report for it now is a zombie's, refused.
    with pytest.raises(StaleGeneration):
        reporter.report_fault("late")


def test_a_member_gone_between_two_held_heartbeats_is_found_when_a_peer_reports(
    start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node that dies after a held heartbeat was answered and before its next one
    arrives cuts no watch. With a peer's report of a failed collective it counts as cut
    once a reconnect window (1 s here) has passed since its release with no beat of it;
    a member that beats again within the window is kept. The heartbeat timeout is 60 s,
    so only this rule ends the generation within the 15 s the test waits."""
    monkeypatch.setenv("RALLYPOINT_HEARTBEAT_RECONNECT", "1")
    url = start().url
    a, b, c = clients(url, ["a", "b", "c"])
    first = join_all([a, b, c], spec(3, 3, timeout=60))
    assert a.heartbeat(wait=timedelta(seconds=0.1)).action == "continue"  # released
    assert b.heartbeat(wait=timedelta(seconds=0.1)).action == "continue"  # released; b "dies"
    c.report_fault("RuntimeError: Connection reset by peer")
    a.heartbeat()  # a comes back within its window
    until_ended(c, 15, "the report did not end the generation")
    status = c.membership()
    assert status.history[-1].generation == first[0].generation
    assert status.history[-1].ended_reason == "node b dropped its heartbeat connection"


def test_a_fault_report_acts_only_for_a_member_of_its_generation(start: Start) -> None:
    url = start().url
    nodes = clients(url, ["a", "b"])
    first = join_all(nodes, spec(2, 2))
    generation = first[0].generation
    nodes[0].report_fault("RuntimeError: Connection reset by peer")  # ends nothing itself
    assert nodes[0].membership().generation == generation
    assert nodes[0].membership().status == "sealed"
    # Another node's credential does not act for this one.
    impostor = ElasticClient(url, "job", "a", credential=nodes[1].credential)
    with pytest.raises(InvalidCredential):
        impostor.report_fault("x", generation=generation)
    nodes[1].leave()
    with pytest.raises(StaleGeneration):
        nodes[0].report_fault("late")


def test_the_members_route_serves_one_list_per_generation(start: Start) -> None:
    url = start().url
    nodes = clients(url, ["a", "b", "c"])
    assignments = join_all(nodes, spec(3, 3))
    members = nodes[0].members()
    assert [(m.node_id, m.rank) for m in members] == sorted(
        ((a.node_id, a.rank) for a in assignments), key=lambda pair: pair[1]
    )
    rank0 = next(m for m in members if m.rank == 0)
    assert (rank0.addr, rank0.port) == (assignments[0].master_addr, assignments[0].master_port)
    path = f"{url}/v1/jobs/job/generations/1/members"
    first = httpx.get(path)
    etag = first.headers["etag"]
    assert etag == f'"{assignments[0].members_digest}"'
    assert "sha256:" + hashlib.sha256(first.content).hexdigest() == assignments[0].members_digest
    again = httpx.get(path, headers={"If-None-Match": etag})
    assert (again.status_code, again.content) == (304, b"")
    future = httpx.get(f"{url}/v1/jobs/job/generations/2/members")
    assert (future.status_code, future.json()["code"]) == (409, "stale_generation")
    # O(1) bytes: the assignment does not grow with the members.
    assert all(len(a.model_dump_json()) < 600 for a in assignments)


def test_a_checkpoint_goes_through_the_client_routes(start: Start) -> None:
    """The checkpoint routes a CheckpointManager calls, one by one (its own tests run on
    the default transport): begin, report, read, the restore's report and a failed
    restore's, which ends the generation."""
    url = start().url
    (node,) = clients(url, ["a"])
    join_all([node], spec(1, 1))
    begun = node.begin_checkpoint(5, ["data.distcp"])
    data = b"a@5"
    upload(begun.upload_urls["data.distcp"], data)
    shard = ShardFile(name="data.distcp", size=len(data), checksum="xxh3-128:0")
    info = node.report_checkpoint(begun.version, [shard], metadata={"loss": 0.5})
    assert (info.state, info.latest, info.step) == ("committed", True, 5)
    latest = node.checkpoint()
    assert latest.version == begun.version and [v.version for v in node.checkpoints()] == [
        begun.version
    ]
    (name,) = (n for n in latest.urls if n.endswith("data.distcp"))
    assert download(latest.urls[name]) == data
    node.report_restore(begun.version, {"storage": len(data)}, rank=0)
    marked = node.report_unreadable(begun.version, "a file failed its checksum", rank=0)
    assert marked.unrecoverable and "checksum" in (marked.unrecoverable_reason or "")
    assert eventually_restart(node)
