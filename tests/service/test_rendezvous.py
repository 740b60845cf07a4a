"""Rendezvous generations as plain code: no HTTP, a clock the test controls."""

from __future__ import annotations

import hashlib
import math
import secrets
import threading
from collections import Counter

import pytest

from rallypoint.client.models import JobSpec, RankProgress
from rallypoint.service._health import Heard
from rallypoint.service._rendezvous import (
    Job,
    Node,
    Rendezvous,
    _beat_op,
    _node_entity,
    member_partition,
)
from rallypoint.service.errors import (
    InvalidCredential,
    JobConflict,
    JobFull,
    StaleGeneration,
    UnknownJob,
    UnknownNode,
)
from rallypoint.service.storage import BatchOp, Cond, Storage

from .._rules import assignment, join, register_all, spec
from ..conftest import Clock


def join_all(rdzv: Rendezvous, nodes: list[str], s: JobSpec | None = None) -> int:
    return register_all(rdzv, nodes, s)[0]


def ranks(rdzv: Rendezvous, job: Job, nodes: list[str], round: int) -> dict[str, int]:
    out = {}
    for n in nodes:
        a = assignment(rdzv, job, n, round)
        assert a is not None and a != "missed", n
        assert a.world_size == job.world_size and a.generation == round
        out[n] = a.rank
    return out


def test_create_job_is_idempotent_and_refuses_conflicts(rdzv: Rendezvous) -> None:
    job, created = rdzv.create_job("job", spec(2, 4))
    again, created_again = rdzv.create_job("job", spec(2, 4))
    assert created and not created_again and again.spec == job.spec
    with pytest.raises(JobConflict):
        rdzv.create_job("job", spec(2, 8))
    with pytest.raises(JobConflict):
        join(rdzv, "job", "a", "h", 1, spec(3, 4))
    assert [j.job_id for j in rdzv.list_jobs()] == ["job"]


def test_join_without_a_spec_needs_an_existing_job(rdzv: Rendezvous) -> None:
    with pytest.raises(UnknownJob):
        join(rdzv, "nojob", "a", "h", 1)


def test_seals_at_max_nodes_with_ranks_in_join_order(rdzv: Rendezvous, clock: Clock) -> None:
    nodes = ["c", "a", "b"]
    round = 0
    for n in nodes:
        round = join(rdzv, "job", n, f"host-{n}", 1000 + ord(n), spec(2, 3))
        clock.advance(0.1)
    job, _ = rdzv.tick("job")
    assert (job.generation, job.status, job.world_size) == (1, "sealed", 3)
    assert ranks(rdzv, job, nodes, round) == {"c": 0, "a": 1, "b": 2}
    a = assignment(rdzv, job, "b", round)
    assert a not in (None, "missed") and not isinstance(a, str)
    assert (a.master_addr, a.master_port) == ("host-c", 1000 + ord("c"))
    sealed = rdzv.sealed("job", round)
    assert [m.node_id for m in sealed.members] == nodes
    assert a.members_digest == sealed.members_digest
    assert a.members_digest == "sha256:" + hashlib.sha256(sealed.members_json).hexdigest()


def test_last_call_waits_for_more_after_min(rdzv: Rendezvous, clock: Clock) -> None:
    s = spec(2, 4, last_call=5)
    join(rdzv, "job", "a", "h", 1, s)
    job, wait = rdzv.tick("job")
    assert job.status == "open" and wait == math.inf  # below min: only a join helps
    clock.advance(1)
    join(rdzv, "job", "b", "h", 2, s)
    clock.advance(2)
    rdzv.record_beats("job", ["a", "b"])
    job, wait = rdzv.tick("job")
    assert job.status == "open" and wait == pytest.approx(3)  # quorum at t=1, +5 s
    join(rdzv, "job", "c", "h", 3, s)
    clock.advance(2.9)
    rdzv.record_beats("job", ["a", "b", "c"])
    assert rdzv.tick("job")[0].status == "open"
    clock.advance(0.2)
    job, _ = rdzv.tick("job")
    assert (job.status, job.world_size) == ("sealed", 3)


def test_silent_waiting_nodes_are_left_out(rdzv: Rendezvous, clock: Clock) -> None:
    round = join_all(rdzv, ["a", "b", "ghost"], spec(2, 3, last_call=1, timeout=3))
    clock.advance(3.5)
    rdzv.record_beats("job", ["a", "b"])
    job, _ = rdzv.tick("job")
    assert job.world_size == 2
    assert ranks(rdzv, job, ["a", "b"], round) == {"a": 0, "b": 1}
    assert assignment(rdzv, job, "ghost", round) == "missed"


def test_a_silent_member_ends_the_generation_and_ranks_stay_stable(
    rdzv: Rendezvous, clock: Clock
) -> None:
    s = spec(2, 4, last_call=0, timeout=3)
    nodes = ["r0", "r1", "r2", "r3"]
    join_all(rdzv, nodes, s)
    job, _ = rdzv.tick("job")
    assert ranks(rdzv, job, nodes, 1) == {"r0": 0, "r1": 1, "r2": 2, "r3": 3}
    for _ in range(3):
        clock.advance(1)
        rdzv.record_beats("job", ["r0", "r2", "r3"], generation=1)  # r1 went silent
        job, _ = rdzv.tick("job")
    assert (job.generation, job.status) == (1, "open")
    assert rdzv.judge_beat(job, "r0", 1) == "restart"
    history = rdzv.status("job").history
    assert history[0].ended_reason is not None and "r1 missed heartbeats" in history[0].ended_reason

    # Survivors re-join in another order, plus a newcomer: each survivor keeps its rank,
    # and the newcomer takes the lost member's.
    for n in ["r3", "new", "r2", "r0"]:
        join(rdzv, "job", n, "h", 1)
        clock.advance(0.1)
    job, _ = rdzv.tick("job")
    assert job.generation == 2
    assert ranks(rdzv, job, ["r0", "r2", "r3", "new"], 2) == {"r0": 0, "new": 1, "r2": 2, "r3": 3}


def test_a_newcomer_ends_a_running_generation(rdzv: Rendezvous, clock: Clock) -> None:
    join_all(rdzv, ["a", "b"], spec(2, 3, last_call=0))
    job, _ = rdzv.tick("job")
    assert rdzv.judge_beat(job, "a", 1) == "continue"
    round = join(rdzv, "job", "late", "h", 9)
    assert round == 2
    job = rdzv.get_job("job")
    assert (job.generation, job.status) == (1, "open")
    assert rdzv.judge_beat(job, "a", 1) == "restart"
    assert rdzv.status("job").history[0].ended_reason == "node late joined"
    join_all(rdzv, ["b", "a"])
    job, _ = rdzv.tick("job")
    assert ranks(rdzv, job, ["a", "b", "late"], 2) == {"a": 0, "b": 1, "late": 2}


def test_a_full_job_refuses_more_nodes(rdzv: Rendezvous) -> None:
    join_all(rdzv, ["a", "b"], spec(2, 2))
    rdzv.tick("job")
    with pytest.raises(JobFull):
        join(rdzv, "job", "c", "h", 1)
    assert rdzv.get_job("job").status == "sealed"


def test_a_standby_parks_beside_a_full_generation_and_takes_a_lost_members_rank(
    rdzv: Rendezvous, clock: Clock
) -> None:
    s = spec(3, 3, last_call=0, timeout=3).model_copy(update={"standbys": 1})
    join_all(rdzv, ["a", "b", "c"], s)
    job, _ = rdzv.tick("job")
    assert (job.generation, job.world_size) == (1, 3)
    # d parks: it ends nothing, and the members are told to continue. Its registration
    # says so (its join is answered "standby" at once, so a hot standby starts its
    # workers); a member's is no standby's.
    parked = rdzv.register("job", "d", "h", 1, None, "k1")
    assert (parked.round, parked.parked) == (2, True)
    job = rdzv.get_job("job")
    assert (job.generation, job.status) == (1, "sealed")
    assert rdzv.judge_beat(job, "a", 1) == "continue"
    assert assignment(rdzv, job, "d", 2) is None  # waits for round 2
    waiting = rdzv.status("job").waiting
    assert [(w.node_id, w.standby) for w in waiting] == [("d", True)]
    # The job has room for one standby: e is refused, as a full job refuses without.
    with pytest.raises(JobFull, match="1 standbys"):
        join(rdzv, "job", "e", "h", 1)
    # A retried join of d is the same registration, still parked.
    first = rdzv.node("job", "d")
    assert rdzv.register("job", "d", "h", 1, None, "k1").parked
    assert rdzv.node("job", "d").registration == first.registration
    assert rdzv.get_job("job").status == "sealed"
    # b goes silent: d takes its rank, the world keeps its size, a and c theirs.
    for _ in range(3):
        clock.advance(1)
        rdzv.record_beats("job", ["a", "c", "d"], generation=None)
        rdzv.record_beats("job", ["a", "c"], generation=1)
        job, _ = rdzv.tick("job")
    assert (job.generation, job.status) == (1, "open")
    assert [w.standby for w in rdzv.status("job").waiting] == [False]  # its round is open
    assert not any(rdzv.register("job", n, "h", 1).parked for n in ("c", "a"))  # they join
    job, _ = rdzv.tick("job")
    assert (job.generation, job.world_size) == (2, 3)
    assert ranks(rdzv, job, ["a", "c", "d"], 2) == {"a": 0, "d": 1, "c": 2}
    # With no standby left, the job's elastic rules are as before: a member re-joining
    # ends the generation, and a newcomer parks.
    assert join(rdzv, "job", "b", "h", 1) == 3
    assert rdzv.get_job("job").status == "sealed"


def test_a_standby_that_went_silent_holds_no_place(rdzv: Rendezvous, clock: Clock) -> None:
    s = spec(2, 2, last_call=0, timeout=3).model_copy(update={"standbys": 1})
    join_all(rdzv, ["a", "b"], s)
    rdzv.tick("job")
    join(rdzv, "job", "d", "h", 1)
    with pytest.raises(JobFull):
        join(rdzv, "job", "e", "h", 1)
    # d's process died while it parked: no beat for the heartbeat timeout.
    clock.advance(3)
    rdzv.record_beats("job", ["a", "b"], generation=1)
    assert join(rdzv, "job", "e", "h", 1) == 2  # e parks in its place
    assert rdzv.get_job("job").status == "sealed"


def test_a_member_that_restarts_ends_its_generation(rdzv: Rendezvous) -> None:
    join_all(rdzv, ["a", "b"], spec(2, 2))
    rdzv.tick("job")
    assert join(rdzv, "job", "b", "h", 1) == 2
    assert rdzv.status("job").history[0].ended_reason == "member b re-joined"


def test_leaving_ends_the_generation_and_stale_requests_are_fenced(rdzv: Rendezvous) -> None:
    _, creds = register_all(rdzv, ["a", "b", "c"], spec(2, 3, last_call=0))
    job, _ = rdzv.tick("job")
    with pytest.raises(StaleGeneration):
        rdzv.judge_beat(job, "a", 7)  # never sealed
    rdzv.leave("job", "c", 1, "preempted", creds["c"])
    job = rdzv.get_job("job")
    assert job.status == "open"
    assert rdzv.status("job").history[0].ended_reason == "node c left: preempted"
    # A zombie still on generation 1 can no longer act for it.
    with pytest.raises(StaleGeneration):
        rdzv.leave("job", "a", 1, "zombie", creds["a"])
    assert rdzv.judge_beat(job, "a", 1) == "restart"
    with pytest.raises(UnknownNode):
        rdzv.leave("job", "stranger", None, "never here", None)
    join_all(rdzv, ["a", "b"])
    job, _ = rdzv.tick("job")
    assert (job.generation, job.world_size) == (2, 2)


def test_a_node_that_missed_the_seal_is_told_to_join_again(rdzv: Rendezvous) -> None:
    join_all(rdzv, ["a", "b"], spec(2, 2))
    # c registers for round 1 after the seal decision was made without it.
    job, _ = rdzv.tick("job")
    assert assignment(rdzv, job, "c", 1) == "missed"
    assert assignment(rdzv, rdzv.get_job("job"), "a", 2) is None  # round 2 not sealed


def test_two_coordinators_racing_seal_one_generation(storage: Storage, clock: Clock) -> None:
    one, two = (Rendezvous(storage.table("jobs"), clock) for _ in range(2))
    nodes = [f"n{i}" for i in range(6)]
    for i, n in enumerate(nodes):
        join(one if i % 2 else two, "job", n, "h", i, spec(3, 6, last_call=0))
    barrier = threading.Barrier(2)
    results: list[Job] = []

    def seal(r: Rendezvous) -> None:
        barrier.wait()
        results.append(r.tick("job")[0])

    threads = [threading.Thread(target=seal, args=(r,)) for r in (one, two)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = one.get_job("job")
    assert (final.generation, final.world_size) == (1, 6)
    assert len(one.status("job").history) == 1
    assert ranks(one, final, nodes, 1) == ranks(two, final, nodes, 1)


def test_status_shows_members_waiting_and_history(rdzv: Rendezvous, clock: Clock) -> None:
    join_all(rdzv, ["a", "b"], spec(2, 3, last_call=0, timeout=4))
    rdzv.tick("job")
    clock.advance(2.5)
    rdzv.record_beats("job", ["a"], generation=1)
    status = rdzv.status("job")
    assert status.generation == 1 and status.status == "sealed" and status.world_size == 2
    assert [(m.node_id, m.rank, m.state) for m in status.members] == [
        ("a", 0, "alive"),
        ("b", 1, "late"),
    ]
    assert status.members[1].heartbeat_age == pytest.approx(2.5)
    join(rdzv, "job", "c", "host-c", 1)
    status = rdzv.status("job")
    assert status.status == "open" and status.members == []
    assert [w.node_id for w in status.waiting] == ["c"]
    assert status.history[0].ended_reason == "node c joined"


def test_a_retried_join_is_the_same_join(rdzv: Rendezvous) -> None:
    s = spec(2, 2)
    assert join(rdzv, "job", "a", "h", 1, s, join_id="k1") == 1
    assert join(rdzv, "job", "a", "h", 1, s, join_id="k1") == 1  # retry while waiting
    join(rdzv, "job", "b", "h", 2, s, join_id="k2")
    job, _ = rdzv.tick("job")
    assert job.generation == 1
    # The reply was lost; the retry must not end the generation it is part of.
    assert join(rdzv, "job", "a", "h", 1, join_id="k1") == 1
    assert rdzv.get_job("job").status == "sealed"
    # A new join (a restarted process) does end it.
    assert join(rdzv, "job", "a", "h", 1, join_id="k3") == 2
    assert rdzv.get_job("job").status == "open"


def storage_calls(rdzv: Rendezvous) -> Counter[str]:
    """Counts the table calls ``rdzv`` makes from now on (the real table answers them)."""
    calls: Counter[str] = Counter()
    table = rdzv.table
    for name in ("get", "insert", "replace", "upsert", "delete", "query", "batch"):

        def counted(
            *args: object, _name: str = name, _call: object = getattr(table, name), **kw: object
        ):
            calls[_name] += 1
            return _call(*args, **kw)  # type: ignore[operator]

        setattr(table, name, counted)
    return calls


def test_a_join_on_a_recent_snapshot_is_one_storage_call(rdzv: Rendezvous) -> None:
    s = spec(2, 2, last_call=0)
    job, _ = rdzv.create_job("job", s)
    a = rdzv.register("job", "a", "h", 1, s, join_id="ka", known=job)  # makes the job's key
    calls = storage_calls(rdzv)
    rdzv.register("job", "b", "h", 2, s, join_id="kb", known=job)
    assert calls == {"batch": 1}  # registration and first beat, nothing read
    job, _ = rdzv.tick("job")
    assert job.generation == a.round == 1 and job.status == "sealed"
    rdzv.leave(
        "job", "b", 1, "preempted", rdzv.register("job", "b", "h", 2, join_id="kb").credential
    )
    job = rdzv.get_job("job")
    calls.clear()
    # A restart round: the rows as the last tick read them are still the rows.
    again = rdzv.register("job", "a", "h", 1, join_id="ka2", known=job)
    assert calls == {"batch": 1} and again.round == 2


def test_a_join_decides_on_the_row_as_stored_not_as_last_seen(
    storage: Storage, clock: Clock
) -> None:
    here, there = (Rendezvous(storage.table("jobs"), clock) for _ in range(2))
    s = spec(2, 2)
    job, _ = here.create_job("job", s)
    here.register("job", "a", "h", 1, s, join_id="k1", known=job)
    # The node's next join (a restarted process) registered through another replica, and
    # its reply was lost; its retry comes here, where the row is still the first join's.
    first = there.register("job", "a", "h", 1, s, join_id="k2")
    row = there.node("job", "a")
    retry = here.register("job", "a", "h", 1, s, join_id="k2", known=job)
    assert retry.credential == first.credential and retry.round == first.round
    assert here.node("job", "a").etag == row.etag  # a retry writes nothing
    # A replica that never saw the row: its insert fails, and it reads the row.
    third = Rendezvous(storage.table("jobs"), clock)
    assert third.register("job", "a", "h", 1, s, join_id="k2").credential == first.credential
    assert third.node("job", "a").etag == row.etag


def test_a_node_that_missed_the_seal_registers_again_with_its_key(rdzv: Rendezvous) -> None:
    join(rdzv, "job", "a", "h", 1, spec(1, 2, last_call=0), join_id="ka")
    rdzv.tick("job")  # sealed with a alone
    # c's registration for round 1 raced the seal and lost.
    rdzv.table.upsert(_node_entity("job", Node("c", "h", 3, 1, 0.0, "waiting", "kc")))
    assert assignment(rdzv, rdzv.get_job("job"), "c", 1) == "missed"
    assert join(rdzv, "job", "c", "h", 3, join_id="kc") == 2  # registers for the next


def test_a_restart_of_survivors_seals_without_waiting_for_last_call(
    rdzv: Rendezvous, clock: Clock
) -> None:
    s = spec(2, 3, last_call=60, timeout=3)
    _, creds = register_all(rdzv, ["a", "b", "c"], s)
    job, _ = rdzv.tick("job")
    assert job.world_size == 3
    rdzv.leave("job", "c", job.generation, "preempted", creds["c"])
    clock.advance(0.5)
    round = join_all(rdzv, ["a", "b"])
    job, _ = rdzv.tick("job")
    # Nobody new to wait for, and the missing member left: sealed at once.
    assert (job.generation, job.status, job.world_size) == (round, "sealed", 2)
    assert ranks(rdzv, job, ["a", "b"], round) == {"a": 0, "b": 1}


def test_a_silent_member_holds_the_restart_only_until_its_heartbeat_expires(
    rdzv: Rendezvous, clock: Clock
) -> None:
    s = spec(2, 3, last_call=60, timeout=3)
    join_all(rdzv, ["a", "b", "c"], s)
    job, _ = rdzv.tick("job")
    rdzv.record_beats("job", ["a", "b", "c"], job.generation)
    clock.advance(1)
    round = join_all(rdzv, ["a", "b"])  # c was killed: the survivors restart
    job, wait = rdzv.tick("job")
    assert job.status == "open" and wait == pytest.approx(2)  # c's beat is 1 s old
    clock.advance(2)
    job, _ = rdzv.tick("job")
    assert (job.generation, job.status, job.world_size) == (round, "sealed", 2)


def test_a_round_with_a_newcomer_still_waits_for_last_call(rdzv: Rendezvous, clock: Clock) -> None:
    s = spec(2, 4, last_call=10, timeout=30)
    join_all(rdzv, ["a", "b"], s)
    clock.advance(10)
    job, _ = rdzv.tick("job")
    assert job.world_size == 2
    join(rdzv, "job", "d", "host-d", 1)  # ends generation 1
    round = join_all(rdzv, ["a", "b"])
    job, wait = rdzv.tick("job")
    assert job.status == "open" and 0 < wait <= 10  # more newcomers may come
    clock.advance(10)
    job, _ = rdzv.tick("job")
    assert (job.generation, job.world_size) == (round, 3)


def test_a_dropped_watch_ends_the_generation_unless_the_node_beat_again(
    rdzv: Rendezvous, clock: Clock
) -> None:
    join_all(rdzv, ["a", "b", "c"], spec(3, 3, timeout=30))
    job, _ = rdzv.tick("job")
    rdzv.record_beats("job", ["a", "b", "c"], job.generation)
    cut_at = clock.now
    clock.advance(1)
    rdzv.record_beats("job", ["a"], job.generation)  # a reconnected (through any replica)
    assert not rdzv.expire("job", "a", cut_at)
    assert rdzv.expire("job", "b", cut_at)  # b did not
    job, _ = rdzv.tick("job")  # long before the 30 s timeout
    assert job.status == "open"
    info = rdzv.status("job").history[-1]
    assert info.ended_reason == "node b dropped its heartbeat connection"
    # A fresh beat clears it: b is a live waiting node again for the next round.
    rdzv.record_beats("job", ["b"])
    assert rdzv._beats("job", dropped := set()) and dropped == set()


def test_a_registration_has_its_own_credential(rdzv: Rendezvous) -> None:
    s = spec(2, 2)
    first = rdzv.register("job", "a", "h", 1, s, join_id="k1")
    assert first.credential and rdzv.register("job", "a", "h", 1, join_id="k1") == first
    assert rdzv.register("job", "a", "h", 1, join_id="k1").credential == first.credential
    b = rdzv.register("job", "b", "h", 2, s, join_id="kb")
    assert b.credential not in (None, first.credential)
    job, _ = rdzv.tick("job")
    assert rdzv.member(job, "a", 1, first.credential)[1] == 0
    # Another node's credential, none, or one of the node's earlier registration: refused.
    for wrong in (b.credential, None, "A" * 43):
        with pytest.raises(InvalidCredential):
            rdzv.member(job, "a", 1, wrong)
        with pytest.raises(InvalidCredential):
            rdzv.leave("job", "a", 1, "spoofed", wrong)
    assert rdzv.get_job("job").status == "sealed"
    renewed = rdzv.register("job", "a", "h", 1, join_id="k2")  # a restarted process
    assert renewed.credential not in (None, first.credential)
    with pytest.raises(InvalidCredential):
        rdzv.leave("job", "a", None, "the old process", first.credential)
    rdzv.leave("job", "a", None, "the new one", renewed.credential)
    assert rdzv.node("job", "a").state == "left"


def test_ended_generations_are_read_by_their_members_and_future_ones_by_nobody(
    rdzv: Rendezvous,
) -> None:
    _, creds = register_all(rdzv, ["a", "b"], spec(2, 2, last_call=0))
    job, _ = rdzv.tick("job")
    with pytest.raises(StaleGeneration):
        rdzv.member(job, "a", 2, creds["a"], ended=True)  # never sealed
    rdzv.leave("job", "b", 1, "preempted", creds["b"])
    job = rdzv.get_job("job")
    with pytest.raises(StaleGeneration):
        rdzv.member(job, "a", 1, creds["a"])  # acting for it: over
    assert rdzv.member(job, "b", 1, creds["b"], ended=True)[1] == 1  # reading what it left
    with pytest.raises(InvalidCredential):
        rdzv.member(job, "b", 1, creds["a"], ended=True)


def test_the_operator_removes_a_node_without_its_credential(rdzv: Rendezvous) -> None:
    join_all(rdzv, ["a", "b"], spec(2, 2, last_call=0))
    rdzv.tick("job")
    rdzv.remove("job", "b", "node b removed")
    job = rdzv.get_job("job")
    assert job.status == "open" and rdzv.node("job", "b").state == "left"
    assert rdzv.status("job").history[0].ended_reason == "node b removed"
    assert rdzv.judge_beat(job, "a", 1) == "restart"
    with pytest.raises(UnknownNode):
        rdzv.remove("job", "nobody", "never here")


# --- members spread over partitions (Azure serves ~2,000 entities/s per partition) ----------


def test_a_large_job_spreads_its_members_heartbeats_under_the_partition_limit() -> None:
    """Every member writes its heartbeat row once a second: at 10,000 members no
    partition takes more than 2,000 of them a second, and a small job keeps all its rows
    in its own partition."""
    from rallypoint.service._rendezvous import member_partition, member_partitions

    assert member_partitions("job", 1000) == ["job"]
    assert len(member_partitions("job", 10_000)) == 10
    per_partition = Counter(member_partition("job", f"node-{i}", 10_000) for i in range(10_000))
    assert len(per_partition) == 10 and max(per_partition.values()) < 2000, per_partition


def test_a_spread_job_seals_in_its_own_partition_and_keeps_members_apart(
    storage: Storage, clock: Clock
) -> None:
    nodes = [f"n{i}" for i in range(40)]
    s = spec(len(nodes), 2500, last_call=0)
    rdzvs = [Rendezvous(storage.table("jobs"), clock) for _ in range(3)]  # three replicas
    rdzvs[0].create_job("job", s)
    # Joins and ticks of three replicas race: one seal wins, every joiner gets one rank.
    errors: list[BaseException] = []

    def work(r: Rendezvous, mine: list[str]) -> None:
        try:
            for n in mine:
                r.register("job", n, "h", 1)
                r.tick("job")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r, nodes[i::3])) for i, r in enumerate(rdzvs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    table = storage.table("jobs")
    # Node and heartbeat rows live in the member partitions, none in the job's own.
    assert not list(table.query("job", [Cond("kind", "eq", "node")]))
    spread = sum(
        len(list(table.query(f"job~m{i}", [Cond("kind", "eq", "node")]))) for i in range(3)
    )
    assert spread == len(nodes)
    # However the replicas' seals raced, one generation sealed with every node once.
    job = rdzvs[1].get_job("job")
    assert (job.generation, job.status, job.world_size) == (1, "sealed", len(nodes))
    sealed = rdzvs[2].sealed("job", 1)
    assert sorted(sealed.ranks) == sorted(nodes)
    assert sorted(sealed.ranks.values()) == list(range(len(nodes)))
    # Heartbeats land in the members' partitions, and the rule still sees every one.
    clock.advance(2)
    rdzvs[0].record_beats("job", nodes, 1)
    job, _ = rdzvs[0].tick("job")
    assert job.status == "sealed"
    assert {m.state for m in rdzvs[0].status("job").members} == {"alive"}


def test_a_generation_ended_by_a_re_join_after_a_members_watch_was_cut_names_the_cut(
    rdzv: Rendezvous, clock: Clock
) -> None:
    """A killed node's peers fail in their collectives at once and re-join: the record
    names the first cause (the cut), not the survivor whose re-join ended it."""
    join_all(rdzv, ["a", "b", "c"], spec(3, 3, last_call=0))
    rdzv.tick("job")
    rdzv.record_beats("job", ["a", "b", "c"], 1)
    clock.advance(1)
    cut = clock()  # c's process died: its heartbeat watch closed
    clock.advance(0.3)
    rdzv.register("job", "a", "h", 1)  # a survivor's agent joins again first
    assert rdzv.status("job").history[0].ended_reason == "member a re-joined"
    clock.advance(0.7)
    assert rdzv.expire("job", "c", cut)  # a second later: c did not come back
    reason = rdzv.status("job").history[0].ended_reason
    assert reason == "node c dropped its heartbeat connection (then: member a re-joined)"


def test_a_cut_after_the_generation_ended_leaves_its_reason(rdzv: Rendezvous, clock: Clock) -> None:
    join_all(rdzv, ["a", "b"], spec(2, 2, last_call=0))
    rdzv.tick("job")
    rdzv.record_beats("job", ["a", "b"], 1)
    clock.advance(1)
    rdzv.register("job", "a", "h", 1)  # ends generation 1
    clock.advance(0.5)
    cut = clock()  # b's watch is cut only afterwards (it was told to restart)
    clock.advance(1)
    assert rdzv.expire("job", "b", cut)
    assert rdzv.status("job").history[0].ended_reason == "member a re-joined"


def test_a_generation_too_big_for_one_row_seals_across_part_rows(
    storage: Storage, clock: Clock
) -> None:
    # 3,000 nodes with the longest names a join takes, random so they do not compress:
    # about 2 MB of members, more than one 1 MiB entity holds.
    n = 3000
    s = spec(n, n, last_call=0, timeout=60)
    rdzv, rival = (Rendezvous(storage.table("jobs"), clock) for _ in range(2))
    job, _ = rdzv.create_job("job", s)
    by_partition: dict[str, list[BatchOp]] = {}
    for _ in range(n):
        node_id = secrets.token_hex(32)
        node = Node(
            node_id,
            secrets.token_hex(127) + "x",
            29500,
            1,
            clock(),
            "waiting",
            peer="http://" + secrets.token_hex(252),
            cred=secrets.token_urlsafe(32),
        )
        partition = member_partition("job", node_id, n)
        by_partition.setdefault(partition, []).extend(
            [
                BatchOp("upsert", _node_entity(partition, node)),
                _beat_op(partition, node_id, clock(), 0),
            ]
        )
    for ops in by_partition.values():
        for start in range(0, len(ops), 100):
            rdzv.table.batch(ops[start : start + 100])
    sealed, _ = rdzv.tick("job")
    assert (sealed.generation, sealed.status, sealed.world_size) == (1, "sealed", n)
    # A replica that read the job before the seal seals too, and loses: its part rows go.
    assert rival._try_seal(job) == (False, 0.0)
    parts = list(rdzv.table.query("job", [Cond("kind", "eq", "genpart")]))
    members = rdzv.sealed("job", 1).members
    assert len(parts) == rdzv.generation("job", 1).parts[1] > 1  # type: ignore[index]
    # Read back by a replica that never saw it, and still whole once the generation ends.
    assert Rendezvous(storage.table("jobs"), clock).sealed("job", 1).members == members
    assert len({m.node_id for m in members}) == n and [m.rank for m in members] == list(range(n))
    rdzv.expire("job", members[5].node_id, clock())
    clock.advance(1)
    assert rdzv.tick("job")[0].status == "open"
    ended = Rendezvous(storage.table("jobs"), clock).generation("job", 1)
    assert ended.members == members and ended.ended_reason is not None
    assert rdzv.status("job").history[0].world_size == n


def test_a_beat_written_from_its_parse_is_read_back_without_parsing_it_again(
    rdzv: Rendezvous,
) -> None:
    join_all(rdzv, ["a", "b"], spec(2, 2))
    rdzv.tick("job")
    said = (RankProgress(rank=0, step=7, idle=0.25, interval=0.1, own=0.08),)
    rdzv.record_beats("job", ["a", "b"], 1, progress={"a": said})
    # A replica that did not write it (a fresh Rendezvous on the same table) parses it.
    other: dict[str, Heard] = {}
    Rendezvous(rdzv.table, rdzv.clock)._beats("job", heard=other)
    assert other["a"].progress == said and other["b"].progress == ()
    # The one that wrote it takes its own parse, not a second one of the same text.
    heard: dict[str, Heard] = {}
    rdzv._beats("job", heard=heard)
    assert heard["a"].progress is said and heard["b"].progress == ()
