"""The seal and end rules as plain functions: no storage, no clock (see service/_seal.py)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from rallypoint.client.models import CheckpointPointer, JobSpec, LoadFailure
from rallypoint.service import _seal as seal
from rallypoint.service._rendezvous import Generation, Job, Member, Node
from rallypoint.service.errors import JobFull, StaleGeneration

SPEC = JobSpec(
    min_nodes=2,
    max_nodes=3,
    last_call=timedelta(seconds=5),
    heartbeat_timeout=timedelta(seconds=10),
)


def job(generation: int = 1, status: str = "sealed") -> Job:
    return Job("job", SPEC, generation, status, 2, 0.0, 100.0, "etag")  # type: ignore[arg-type]


def running(*nodes: str) -> Generation:
    members = tuple(Member(n, i, "h", 1) for i, n in enumerate(nodes))
    return Generation(1, members, 100.0, None, None, None, "etag")


def node(name: str, joined_at: float) -> Node:
    return Node(name, "h", 1, 2, joined_at, "waiting")


def test_a_join_ends_the_running_generation_unless_it_is_full() -> None:
    assert seal.join_ends(job(), running("a", "b"), "a") == "member a re-joined"
    assert seal.join_ends(job(), running("a", "b"), "c") == "node c joined"
    with pytest.raises(JobFull):
        seal.join_ends(job(), running("a", "b", "c"), "d")


def test_a_newcomer_to_a_full_generation_parks_while_the_job_has_room_for_a_standby() -> None:
    spare = job()
    spare = replace(spare, spec=SPEC.model_copy(update={"standbys": 1}))
    full, short = running("a", "b", "c"), running("a", "b")
    assert seal.parks(spare, full, "d", standbys=0)
    assert not seal.parks(spare, full, "e", standbys=1)  # the one place is taken
    assert not seal.parks(spare, full, "a", standbys=0)  # a member that re-joins restarted
    assert not seal.parks(spare, short, "d", standbys=0)  # room in the world: it grows
    assert not seal.parks(job(), full, "d", standbys=0)  # no standbys: refused, as before
    with pytest.raises(JobFull, match="and 1 standbys"):
        seal.join_ends(spare, full, "e")


def test_a_hot_join_parks_until_its_workers_are_ready_then_ends_the_generation() -> None:
    short, full = running("a", "b"), running("a", "b", "c")
    assert seal.warms(job(), short, "c", warm=True)
    assert not seal.warms(job(), short, "c", warm=False)  # a cold join ends it at once
    assert not seal.warms(job(), short, "a", warm=True)  # a member back: it restarted
    assert not seal.warms(job(), full, "d", warm=True)  # no room: join_ends refuses it
    # Round 2 follows the running generation 1: the parked newcomer's ready ends it.
    assert seal.ready_ends(job(1, "sealed"), short, "c", 2) == "node c joined"
    assert seal.ready_ends(job(1, "sealed"), full, "d", 2) is None  # a standby waits
    assert seal.ready_ends(job(1, "sealed"), short, "a", 2) is None  # a member
    assert seal.ready_ends(job(1, "open"), short, "c", 2) is None  # ended already
    assert seal.ready_ends(job(1, "sealed"), short, "c", 1) is None  # a stale round


def test_a_standby_waits_as_long_as_the_generation_beside_it_runs() -> None:
    # Round 2 follows the running generation 1: a node registered for it is parked.
    assert seal.parked(job(1, "sealed"), 2)
    # Once generation 1 ends, round 2 is open: the node waits as any joiner, and the
    # join timeout runs again; a node of an earlier round is no standby either.
    assert not seal.parked(job(1, "open"), 2)
    assert not seal.parked(job(2, "sealed"), 2)


def test_standbys_of_a_generation_that_finished_training_are_released() -> None:
    # Generation 1 ended at 100 (changed_at) because a member's workers finished.
    done = replace(job(1, "open"), last_end=(1, "node a left: finished"))
    assert seal.released(done, 2, joined_at=50.0)  # parked while 1 ran
    assert not seal.released(done, 2, joined_at=150.0)  # joined after: a new run
    # Any other end (a loss, a preemption, another leave) promotes the standby.
    for reason in ("node a missed heartbeats for 3.0 s", "node a left: preempted (SIGTERM)"):
        assert not seal.released(replace(done, last_end=(1, reason)), 2, joined_at=50.0)
    assert not seal.released(replace(done, status="sealed"), 2, joined_at=50.0)
    assert not seal.released(replace(done, last_end=(0, "node a left: finished")), 2, 50.0)


def test_a_standby_takes_the_lost_members_rank_and_the_rest_stays_parked() -> None:
    previous = {"a": 0, "b": 1, "c": 2}
    # b was lost; standbys s1 (parked first) and s2 wait: s1 takes rank 1, s2 stays out.
    waiting = [node("s2", 7), node("c", 9), node("s1", 3), node("a", 9)]
    chosen = seal.ranked(waiting, previous)[: SPEC.max_nodes]
    assert [n.node_id for n in seal.slotted(chosen, previous)] == ["a", "s1", "c"]


def test_standbys_deal_out_the_slots_and_a_lost_slot_goes_to_the_one_holding_its_files() -> None:
    s1, s2 = node("s1", 3), node("s2", 7)  # parked in this order
    assert [seal.keeper(slot, [s1, s2]) for slot in range(4)] == [s1, s2, s1, s2]
    assert seal.keeper(2, [s1]) == s1 and seal.keeper(0, []) is None
    previous = {"a": 0, "b": 1, "c": 2}
    waiting = [s2, node("c", 9), s1, node("a", 9)]
    ordered = seal.ranked(waiting, previous)
    # Both registered before generation 1 ended (at 8); a node that came after is none.
    late = node("n", 9)
    assert seal.standing_by([*ordered, late], previous, since=8.0) == [s1, s2]
    # b (rank 1) was lost: s2 holds rank 1's files, so s2 takes it and s1 stays parked.
    assert [n.node_id for n in seal.slotted(ordered, previous, 3, [s1, s2])] == ["a", "s2", "c"]
    # c (rank 2) was lost instead: s1's slot.
    previous = {"a": 0, "c": 1, "b": 2}
    assert [n.node_id for n in seal.slotted(ordered, previous, 3, [s1, s2])] == ["a", "c", "s1"]
    # The keeper gone too: the next standby in parking order takes the slot.
    ordered = seal.ranked([node("c", 9), s1, node("a", 9)], {"a": 0, "b": 1, "c": 2})
    chosen = seal.slotted(ordered, {"a": 0, "b": 1, "c": 2}, 3, [s1, s2])
    assert [n.node_id for n in chosen] == ["a", "s1", "c"]


def test_a_node_counts_while_heard_from_within_the_timeout() -> None:
    nodes = [node("a", 0), node("b", 0), node("c", 0)]
    beats = {"a": 95.0, "b": 89.0}  # c never beat
    assert [n.node_id for n in seal.alive(nodes, beats, 100.0, 0.0, 10)] == ["a"]
    # After an outage that ended at 95, nobody is judged for the silence before it.
    assert len(seal.alive(nodes, beats, 100.0, 95.0, 10)) == 3


def test_survivors_keep_their_ranks_and_newcomers_follow_in_join_order() -> None:
    waiting = [node("new2", 5), node("b", 9), node("new1", 1), node("a", 8)]
    order = seal.ranked(waiting, {"a": 1, "b": 0})
    assert [n.node_id for n in order] == ["b", "a", "new1", "new2"]


def test_a_replacement_takes_the_lost_members_rank_and_the_others_keep_theirs() -> None:
    previous = {"a": 0, "b": 1, "c": 2, "d": 3}
    # b was lost; e replaces it: e takes rank 1, c and d keep 2 and 3.
    waiting = [node("e", 9), node("d", 1), node("a", 1), node("c", 1)]
    chosen = seal.ranked(waiting, previous)
    assert [n.node_id for n in seal.slotted(chosen, previous)] == ["a", "e", "c", "d"]
    # No replacement: the world shrinks, and only d (whose rank is gone) moves, to 1.
    shrunk = seal.ranked([node("a", 1), node("c", 1), node("d", 1)], previous)
    assert [n.node_id for n in seal.slotted(shrunk, previous)] == ["a", "d", "c"]
    # A first round, or newcomers only: join order.
    fresh = seal.ranked([node("y", 2), node("x", 1)], {})
    assert [n.node_id for n in seal.slotted(fresh, {})] == ["x", "y"]


def test_a_round_waits_for_last_call_and_for_restarting_members() -> None:
    # The first round: last call after the quorum (the min_nodes-th join, at 3).
    first = [node("a", 1), node("b", 3)]
    assert seal.seal_waits(job(0, "open"), first, {}, {}, set(), 4.0) == [8.0]
    assert seal.seal_waits(job(0, "open"), first, {}, {}, set(), 8.0) == []
    # After a restart: survivors only, c still beating (last at 95): wait for it...
    back = [node("a", 1), node("b", 3)]
    previous = {"a": 0, "b": 1, "c": 2}
    assert seal.seal_waits(job(), back, previous, {"c": 95.0}, set(), 100.0) == [105.0]
    # ...unless it left, or went silent past the timeout.
    assert seal.seal_waits(job(), back, previous, {"c": 95.0}, {"c"}, 100.0) == []
    assert seal.seal_waits(job(), back, previous, {"c": 89.0}, set(), 100.0) == []


def test_only_a_newcomer_since_the_end_calls_for_the_last_call() -> None:
    # Generation 1 (a, b) ended at 100 (changed_at); a and b are back at 101.
    previous = {"a": 0, "b": 1}
    ended = job(1, "open")
    # c parked beside it (a hot join or a standby, registered at 90): gathered already.
    parked = [node("a", 101), node("b", 101), node("c", 90)]
    assert seal.seal_waits(ended, parked, previous, {}, set(), 102.0) == []
    # c came after the end: the round waits out the last call from the quorum (101).
    late = [node("a", 101), node("b", 101), node("c", 101.5)]
    assert seal.seal_waits(ended, late, previous, {}, set(), 102.0) == [106.0]


def test_a_generation_ends_for_a_cut_connection_first_then_the_longest_silence() -> None:
    gen = running("a", "b", "c")
    beats = {"a": 99.0, "b": 85.0, "c": 88.0}
    assert seal.silent(job(), gen, beats, {"c"}, 0.0, 100.0) == (
        "node c dropped its heartbeat connection",
        0.0,
        "c",
    )
    reason, _, lost = seal.silent(job(), gen, beats, set(), 0.0, 100.0)
    assert (reason, lost) == ("node b missed heartbeats for 15.0 s", "b")
    # The clocks start at the seal at the latest: nobody is late 5 s after it.
    assert seal.silent(job(), gen, {}, set(), 100.0, 105.0) == (None, 5.0, None)


def test_a_heartbeat_is_told_whether_its_generation_runs() -> None:
    assert seal.verdict(job(2), "a", None) == "continue"
    assert seal.verdict(job(2), "a", 2) == "continue"
    assert seal.verdict(job(2), "a", 1) == "restart"
    assert seal.verdict(job(2, "open"), "a", 2) == "restart"
    with pytest.raises(StaleGeneration):
        seal.verdict(job(2), "a", 3)


def test_a_member_told_to_restart_stays_alive_while_its_agent_stops_its_workers() -> None:
    # job(): changed (its generation ended, when open) at 100.
    ended = job(2, "open")
    assert seal.verdict(ended, "a", 2) == "restart"
    assert seal.restarting(ended, 2, 100.0 + seal.RESTART_GRACE)
    assert not seal.restarting(ended, 2, 100.0 + seal.RESTART_GRACE + 0.1)  # stuck stopping
    assert not seal.restarting(ended, 1, 101.0)  # an older generation's member
    assert not seal.restarting(ended, None, 101.0)  # a waiting node: its beat counts anyway
    assert not seal.restarting(job(3), 2, 101.0)  # a round sealed since: it must join


def test_a_restarted_member_is_told_why_its_own_generation_ended() -> None:
    ended = replace(job(3, "open"), last_end=(3, "node c dropped its heartbeat connection"))
    assert seal.end_reason(ended, 3) == "node c dropped its heartbeat connection"
    # A member of an earlier generation (several ended since): the job keeps only the last.
    assert seal.end_reason(ended, 2) is None
    assert seal.end_reason(job(3, "open"), 3) is None  # a row from before the field
    assert seal.end_reason(ended, None) is None  # a waiting node was never in one


def failed(version: int = 2, world: int = 2, count: int = 1) -> LoadFailure:
    return LoadFailure(version=version, world_size=world, rank=0, reason="E: x", count=count)


def pointer(version: int) -> CheckpointPointer:
    return CheckpointPointer(version=version, step=10, generation=1)


def test_load_failures_count_in_a_row_of_one_version_at_one_size() -> None:
    assert seal.load_streak(None, failed()) == failed(count=1)
    assert seal.load_streak(failed(count=1), failed()) == failed(count=2)
    assert seal.load_streak(failed(count=2), failed()) == failed(count=3)
    # Another version or another size starts a run; an end of another kind breaks it.
    assert seal.load_streak(failed(count=2), failed(version=3)) == failed(version=3, count=1)
    assert seal.load_streak(failed(count=2), failed(world=3)) == failed(world=3, count=1)
    assert seal.load_streak(failed(count=2), None) is None


def test_a_third_generation_that_would_fail_the_same_way_does_not_seal() -> None:
    twice = failed(count=2)
    blocked = seal.load_blocked(twice, 2, pointer(2))
    assert blocked is not None
    assert blocked.startswith("waiting: v2 failed to load at world 2 in 2 generations in a row")
    assert "(rank 0: E: x)" in blocked
    # A world of another size, another version, or a single failure: it seals.
    assert seal.load_blocked(twice, 3, pointer(2)) is None
    assert seal.load_blocked(twice, 1, pointer(2)) is None
    assert seal.load_blocked(twice, 2, pointer(1)) is None
    assert seal.load_blocked(twice, 2, None) is None
    assert seal.load_blocked(failed(count=1), 2, pointer(2)) is None
    assert seal.load_blocked(None, 2, pointer(2)) is None


def test_a_cut_watch_counts_at_once_when_another_member_saw_a_collective_fail() -> None:
    window = 0.25
    # No report: the cut waits for its window (a balancer may have dropped the connection).
    assert not seal.corroborated("b", 100.0, {}, window)
    # A peer's report, after the cut or up to a window before it: the same death.
    assert seal.corroborated("b", 100.0, {"a": 100.01}, window)
    assert seal.corroborated("b", 100.0, {"a": 99.8}, window)
    # Older than that, it was about something else.
    assert not seal.corroborated("b", 100.0, {"a": 99.7}, window)
    # The cut node's own report shows it alive.
    assert not seal.corroborated("b", 100.0, {"b": 100.01}, window)
    assert seal.corroborated("b", 100.0, {"b": 100.01, "c": 100.02}, window)


# --- world sizes: a job that takes only some ----------------------------------------


def sized(
    declared: tuple[int, ...] | None = None,
    learned: tuple[int, ...] | None = None,
    *,
    min_nodes: int = 1,
    max_nodes: int = 4,
    standbys: int = 0,
) -> Job:
    spec = JobSpec(
        min_nodes=min_nodes, max_nodes=max_nodes, world_sizes=declared, standbys=standbys
    )
    return Job("job", spec, 1, "sealed", 2, 0.0, 100.0, "etag", learned_sizes=learned)


def test_a_job_takes_the_sizes_it_declares_less_those_its_workers_ruled_out() -> None:
    assert seal.sizes(sized()) is None  # any, from min_nodes to max_nodes
    assert seal.sizes(sized((2, 4))) == (2, 4)
    assert seal.sizes(sized(learned=(1, 2, 4, 8))) == (1, 2, 4)  # within max_nodes
    assert seal.sizes(sized((2, 3, 4), learned=(1, 2, 4))) == (2, 4)
    assert seal.sizes(sized((3,), learned=(2,))) == ()  # none at all
    # A round seals the largest size its nodes make, never above max_nodes.
    job = sized((2, 4))
    assert [seal.world_for(job, n) for n in range(1, 7)] == [None, 2, 2, 4, 4, 4]
    assert [seal.world_for(sized(), n) for n in (1, 3, 5)] == [1, 3, 4]


def test_a_newcomer_waits_for_a_size_unless_it_and_those_waiting_make_a_larger_one() -> None:
    job, two = sized((2, 4)), running("a", "b")
    assert seal.waits_for_size(job, two, "c", waiting=0)  # 3: not a size the job takes
    assert not seal.waits_for_size(job, two, "d", waiting=1)  # with c: 4, it grows
    assert not seal.waits_for_size(job, two, "a", waiting=0)  # a member back: it restarted
    assert not seal.waits_for_size(sized(), two, "c", waiting=0)  # any size: it grows
    assert seal.grows(sized(), 2, 1) and seal.grows(job, 2, 2) and not seal.grows(job, 2, 1)
    # Beside the largest world the job takes, nodes wait as long as places remain.
    only = sized(learned=(2,), max_nodes=3)
    assert seal.waits_for_size(only, two, "c", waiting=0)
    with pytest.raises(JobFull, match="1 waiting for a world size it takes"):
        seal.waits_for_size(only, two, "d", waiting=1)
    assert seal.waits_for_size(
        replace(only, spec=only.spec.model_copy(update={"standbys": 1})), two, "d", 1
    )


def test_a_hot_join_ends_the_generation_only_for_a_size_the_job_takes() -> None:
    job, two = sized((2, 4)), running("a", "b")
    assert seal.ready_ends(job, two, "c", 2, waiting=1) is None  # 3 nodes: it waits
    assert seal.ready_ends(job, two, "d", 2, waiting=2) == "node d joined"  # 4 with c
    assert seal.ready_ends(sized(), two, "c", 2) == "node c joined"  # any size


def test_a_report_keeps_the_sizes_in_range_but_never_the_world_that_failed() -> None:
    job = sized(min_nodes=2, max_nodes=3)
    assert seal.learned(job, [1, 2, 4, 8, 16], 3) == (2,)
    # Nodes of different process counts: the arithmetic may name the failed world too.
    assert seal.learned(job, [1, 2, 3], 3) == (2,)
    assert seal.learned(job, [1, 4], 3) == ()
    learned = replace(job, learned_sizes=(2,))
    assert seal.size_refused(learned, 3, 1, "WorldSizeError: x") == (
        "rank 1 cannot train a world of 3 nodes: WorldSizeError: x; the job takes worlds of 2 nodes"
    )
    none = replace(job, learned_sizes=())
    assert seal.size_refused(none, 3, 0, "").endswith("the job takes no world from 2 to 3 nodes")


def test_a_round_of_no_size_the_job_takes_says_why_it_waits() -> None:
    job = sized((2, 4))
    assert seal.size_blocked(sized()) is None and seal.size_blocked(job) is None
    assert (
        seal.size_blocked(job, 1)
        == "waiting: 1 node(s) make no world size the job takes (2, 4 nodes)"
    )
    assert seal.size_blocked(job, 3) is None  # it seals 2
    never = seal.size_blocked(sized((3,), learned=(2,)))
    assert (
        never == "waiting: the job takes no world from 1 to 4 nodes (its spec: 3; its workers: 2)"
    )
    # Why the nodes parked beside a running generation wait.
    assert seal.parked_reason(job, 2, 1).startswith("standby: 2 members and 1 waiting make no")
    assert seal.parked_reason(job, 4, 1).startswith("standby: the generation has max_nodes=4")
    assert seal.parked_reason(job, 2, 2).startswith("hot join")
    assert seal.parked_reason(sized(), 2, 1).startswith("hot join")
