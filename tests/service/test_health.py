"""The health rules as plain functions: no storage, no clock (see service/_health.py)."""

from __future__ import annotations

import math
from datetime import timedelta

from rallypoint.client.models import (
    HANG_FACTOR,
    HANG_FLOOR,
    STRAGGLER_WINDOW,
    STRAGGLER_WINDOWS,
    JobSpec,
    RankProgress,
)
from rallypoint.service import _health as health
from rallypoint.service._health import Heard
from rallypoint.service._rendezvous import _window_entity
from rallypoint.service.storage import check_entity

SPEC = JobSpec(min_nodes=2, max_nodes=3)


def rank(r: int, idle: float, **kw: object) -> RankProgress:
    fields: dict[str, object] = {"rank": r, "step": 100, "phase": "train", "idle": idle}
    return RankProgress.model_validate({**fields, **kw})


def beat(node: str, at: float, *progress: RankProgress, generation: int = 1) -> Heard:
    return Heard(node, at, generation, progress)


def heard(*beats: Heard) -> dict[str, Heard]:
    return {b.node_id: b for b in beats}


# --- the limit -------------------------------------------------------------------------


def test_the_limit_is_learned_from_the_slowest_rank_with_a_floor() -> None:
    fast = [beat("a", 0, rank(0, 0.1, interval=0.1)), beat("b", 0, rank(1, 0.1, interval=0.12))]
    assert health.hang_limit(SPEC, fast) == (HANG_FLOOR, "floor")
    slow = [*fast, beat("c", 0, rank(2, 0.1, interval=2.0))]
    assert health.hang_limit(SPEC, slow) == (HANG_FACTOR * 2.0, "learned")
    # No rank has steps enough for an interval: only phase_limit bounds them, unless the
    # job learned a limit before (a generation that just began).
    assert health.hang_limit(SPEC, [beat("a", 0, rank(0, 5))]) == (None, "warming")
    assert health.hang_limit(SPEC, [beat("a", 0, rank(0, 5))], last=4.5) == (4.5, "learned")


def test_a_limit_set_on_the_spec_wins_and_zero_turns_hangs_off() -> None:
    fixed = SPEC.model_copy(update={"hang_limit": timedelta(seconds=7)})
    beats = [beat("a", 0, rank(0, 0.1, interval=5.0))]
    assert health.hang_limit(fixed, beats) == (7.0, "set")
    off = SPEC.model_copy(update={"hang_limit": timedelta(0)})
    assert health.hang_limit(off, beats) == (None, "off")
    stuck = heard(beat("a", 100, rank(0, 99)), beat("b", 100, rank(1, 99)))
    assert health.hung(off, 1, ["a", "b"], stuck, None) == (None, math.inf)


# --- hangs ---------------------------------------------------------------------------


def test_a_rank_past_the_limit_is_hung_once_every_member_said_where_it_stands() -> None:
    # b's rank stopped at t=100; a's waits for it in the all-reduce since t=100.05.
    a = beat("a", 103.2, rank(0, 3.15, waiting=True))
    b = beat("b", 103.1, rank(1, 3.1))
    found, wait = health.hung(SPEC, 1, ["a", "b"], heard(a, b), 3.0)
    assert found is not None and (found.node_id, found.rank) == ("b", 1)
    assert wait == 0.0
    assert found.reason == (
        "rank 1 on node b hung: no progress for 3.1 s in train at step 100 (limit 3.0 s)"
    )
    # c has not beaten since b's rank passed the limit (at 103.0): the rule waits for it,
    # or for the heartbeat timeout that finds c itself lost.
    c = beat("c", 102.5, rank(2, 0.1))
    found, wait = health.hung(SPEC, 1, ["a", "b", "c"], heard(a, b, c), 3.0)
    assert found is None and 0 < wait < 1


def test_the_rank_that_does_not_wait_is_the_hung_one_though_its_peers_stopped_first() -> None:
    # b's rank was still in its backward when it stopped: its last gradient came after
    # a's and c's, which wait for it in the all-reduce.
    a = beat("a", 104, rank(0, 3.5, waiting=True))
    b = beat("b", 104, rank(1, 3.4))
    c = beat("c", 104, rank(2, 3.5, waiting=True))
    found, _ = health.hung(SPEC, 1, ["a", "b", "c"], heard(a, b, c), 3.0)
    assert found is not None and found.node_id == "b"


def test_inside_a_collective_a_stopped_process_is_told_from_its_sleeping_peers() -> None:
    a = beat("a", 104, rank(0, 3.5, waiting=True, process="sleeping"))
    b = beat("b", 104, rank(1, 3.4, waiting=True, process="stopped"))
    found, _ = health.hung(SPEC, 1, ["a", "b"], heard(a, b), 3.0)
    assert found is not None and found.node_id == "b"
    # A stopped process is named though a peer stopped stepping first and does not say
    # it waits (it waits in a collective the reporter does not see: a metric's sync).
    a = beat("a", 104, rank(0, 3.6, process="sleeping"))
    b = beat("b", 104, rank(1, 3.4, process="stopped"))
    found, _ = health.hung(SPEC, 1, ["a", "b"], heard(a, b), 3.0)
    assert found is not None and found.node_id == "b"
    a = beat("a", 104, rank(0, 3.5, waiting=True, process="sleeping"))
    # All wait and sleep (a collective itself that hangs): the first to stop is named.
    b = beat("b", 104, rank(1, 3.4, waiting=True, process="sleeping"))
    found, _ = health.hung(SPEC, 1, ["a", "b"], heard(a, b), 3.0)
    assert found is not None and found.node_id == "a"


def test_time_a_rank_waited_for_a_cpu_is_not_counted_and_holds_its_peers() -> None:
    # b's process ran for 1.6 s of its 5.9 s without progress: other work on its machine
    # kept its CPUs. Slow, not stuck; a and c, which wait for it, are not named either.
    a = beat("a", 106, rank(0, 5.8, waiting=True, process="sleeping", starved=0.0))
    b = beat("b", 106, rank(1, 5.9, process="running", starved=4.3))
    c = beat("c", 106, rank(2, 5.8, waiting=True, process="sleeping"))
    assert health.hung(SPEC, 1, ["a", "b", "c"], heard(a, b, c), 3.0) == (None, math.inf)
    assert not health.overdue(SPEC, b.progress, 3.0)
    # Past the limit in the time it could run: hung, its reason saying how long it
    # showed no progress.
    b = beat("b", 106, rank(1, 5.9, process="running", starved=2.5))
    found, _ = health.hung(SPEC, 1, ["a", "b", "c"], heard(a, b, c), 3.0)
    assert found is not None and found.node_id == "b" and found.idle == 5.9
    assert health.overdue(SPEC, b.progress, 3.0)


def test_long_phases_are_bounded_apart_and_start_up_only_once_the_job_steps() -> None:
    saving = heard(beat("a", 200, rank(0, 100, phase="save")), beat("b", 200, rank(1, 0.1)))
    assert health.hung(SPEC, 1, ["a", "b"], saving, 3.0) == (None, math.inf)
    evaluating = heard(beat("a", 900, rank(0, 601, phase="eval")), beat("b", 900, rank(1, 1)))
    found, _ = health.hung(SPEC, 1, ["a", "b"], evaluating, 3.0)
    assert found is not None and (found.phase, found.limit) == ("eval", 600.0)
    # A first step 20 times the others is start-up, bounded by phase_limit; so is a rank
    # that evaluates alone, and the ranks past the hang limit meanwhile wait for them.
    starting = heard(beat("a", 100, rank(0, 40, phase="start")), beat("b", 100, rank(1, 40)))
    assert health.hung(SPEC, 1, ["a", "b"], starting, 3.0)[0] is None
    alone = heard(beat("a", 100, rank(0, 12, phase="eval")), beat("b", 100, rank(1, 12)))
    assert health.hung(SPEC, 1, ["a", "b"], alone, 3.0)[0] is None
    # A job none of whose ranks ever trained is not judged in start-up at all: its
    # optimizer may be none the reporter hooks.
    never = heard(beat("a", 900, rank(0, 700, phase="start")))
    assert health.hung(SPEC, 1, ["a"], never, None, trained=False)[0] is None
    assert health.hung(SPEC, 1, ["a"], never, None, trained=True)[0] is not None


def test_a_rank_whose_peers_all_finished_is_on_its_way_out_not_hung() -> None:
    last = heard(beat("a", 100, rank(0, 30)), beat("b", 100), beat("c", 100))
    assert health.hung(SPEC, 1, ["a", "b", "c"], last, 3.0) == (None, math.inf)
    assert health.hung(SPEC, 1, ["a"], heard(beat("a", 100, rank(0, 30))), 3.0)[0] is not None


def test_a_node_that_hung_sits_out_the_next_round_where_the_others_can_seal() -> None:
    assert health.sits_out((4, "b", 2), 4, ["a", "b", "c"], 2) == "b"
    assert health.sits_out((4, "b", 2), 4, ["a", "b"], 2) is None  # they need it
    assert health.sits_out((3, "b", 2), 4, ["a", "b", "c"], 2) is None  # an older hang
    assert health.sits_out(None, 4, ["a", "b", "c"], 2) is None


def test_only_the_running_generation_s_beats_count() -> None:
    old = heard(beat("a", 100, rank(0, 50), generation=1))
    assert health.hung(SPEC, 2, ["a"], old, 3.0) == (None, math.inf)


def test_a_beat_past_the_bound_asks_for_a_tick_now() -> None:
    assert health.overdue(SPEC, [rank(0, 3.5)], 3.0)
    assert not health.overdue(SPEC, [rank(0, 2.5)], 3.0)
    assert not health.overdue(SPEC, [rank(0, 30, phase="save")], 3.0)
    assert health.overdue(SPEC, [rank(0, 601, phase="load")], None)


def test_a_node_that_hangs_twice_within_the_window_is_quarantined() -> None:
    recent = health.hangs({}, "b", 1000.0, 3600.0)
    assert not health.hung_too_often(recent["b"])
    recent = health.hangs({**recent, "a": (10.0,)}, "b", 2000.0, 1500.0)
    assert health.hung_too_often(recent["b"])
    assert recent == {"b": (1000.0, 2000.0)}  # a's hang fell out of the window
    assert not health.hung_too_often(health.hangs(recent, "b", 9000.0, 1500.0)["b"])


# --- stragglers -----------------------------------------------------------------------


def test_scores_are_the_fastest_own_time_over_each_and_waiting_is_not_slow() -> None:
    beats = heard(
        beat("a", 0, rank(0, 0.1, own=0.10)),
        beat("b", 0, rank(1, 0.1, own=0.50)),  # throttled: its own steps take 5x
        beat("c", 0, rank(2, 0.1, own=0.11), rank(3, 0.1)),  # rank 3: no own time
    )
    scores = health.scores(1, ["a", "b", "c"], beats)
    assert scores == {("a", 0): 1.0, ("b", 1): 0.2, ("c", 2): 0.1 / 0.11}
    assert health.scores(1, ["a"], beats) == {}  # one rank: nothing to compare


def test_a_rank_under_the_threshold_for_n_windows_in_a_row_is_a_straggler() -> None:
    window = health.Window()
    for i in range(STRAGGLER_WINDOWS):
        assert health.stragglers(window) == []
        window = health.next_window(
            window, i, 1, {("a", 0): 1.0, ("b", 1): 0.2}, 0.75, STRAGGLER_WINDOW * i
        )
    (named,) = health.stragglers(window)
    assert (named.node_id, named.rank, named.score, named.windows) == ("b", 1, 0.2, 3)
    assert named.since == STRAGGLER_WINDOW * (STRAGGLER_WINDOWS - 1)
    # A window with no scores (a save) neither grows nor ends the streak ...
    kept = health.next_window(window, 9, 1, {}, 0.75, 100.0)
    assert health.stragglers(kept)[0].windows == STRAGGLER_WINDOWS
    # ... one over the threshold ends it, and a new generation starts every streak.
    assert health.stragglers(health.next_window(window, 9, 1, {("b", 1): 0.9}, 0.75, 9)) == []
    assert health.stragglers(health.next_window(window, 9, 2, {("b", 1): 0.2}, 0.75, 9)) == []


def test_the_record_watches_the_slowest_ranks_under_the_threshold_alone() -> None:
    # 1,024 nodes of 8 ranks, one fast rank: every other rank is under the threshold.
    rated = {
        (f"node-{n:04d}", r): 0.5 + (n * 8 + r) / 20_000 for n in range(1024) for r in range(8)
    }
    rated[("node-0000", 0)] = 1.0
    window = health.next_window(health.Window(), 0, 1, rated, 0.75, 0.0)
    slowest = sorted(rated, key=rated.__getitem__)[: health.MAX_WATCHED]
    assert list(window.streaks) == slowest and set(window.scores) == set(slowest)
    # A rank over the threshold is not kept, and the watched ones keep their scores.
    two = health.next_window(health.Window(), 0, 1, {("a", 0): 1.0, ("b", 1): 0.2}, 0.75, 0.0)
    assert (two.scores, two.streaks) == ({("b", 1): 0.2}, {("b", 1): 1})
    # The record is one table row: it fits Azure's limits at the longest ids.
    longest = {("n" * 61 + f"{i:03d}", 10**6): 0.123456789 for i in range(1000)}
    full = health.next_window(health.Window(), 0, 1, {**longest, ("x", 0): 1.0}, 0.75, 0.0)
    for _ in range(STRAGGLER_WINDOWS):
        full = health.next_window(full, full.index + 1, 1, {**longest, ("x", 0): 1.0}, 0.75, 1e9)
    assert len(full.since) == health.MAX_WATCHED
    entity = _window_entity("j" * 63, full)
    check_entity(entity.partition_key, entity.row_key, entity.data)


def test_replace_needs_a_standby_and_drop_a_faster_smaller_world() -> None:
    (s,) = health.stragglers(
        health.Window(0, 1, {("c", 2): 0.2}, {("c", 2): STRAGGLER_WINDOWS}, {("c", 2): 0.0})
    )
    owns = {"a": 0.1, "b": 0.1, "c": 0.5}
    replace = SPEC.model_copy(update={"straggler": "replace"})
    assert health.straggler_action(replace, s, 3, 1, owns) == "replace"
    assert health.straggler_action(replace, s, 3, 0, owns) is None
    drop = SPEC.model_copy(update={"straggler": "drop"})
    assert health.straggler_action(drop, s, 3, 0, owns) == "drop"  # 0.1 * 3/2 < 0.5
    assert health.straggler_action(drop, s, 3, 0, {**owns, "c": 0.14}) is None  # not faster
    assert health.straggler_action(drop, s, 2, 0, {"a": 0.1, "c": 0.5}) is None  # min_nodes
    assert health.straggler_action(drop, s, 3, 0, owns, allowed=[1, 3]) is None
    assert health.straggler_action(SPEC, s, 3, 1, owns) is None  # report only


# --- no loop ----------------------------------------------------------------------------


def test_generations_that_end_for_a_fault_without_progress_are_counted() -> None:
    assert health.stalled(0, 50, 60, committed=False, fault=True) == (0, 60)  # progress
    assert health.stalled(1, 50, 40, committed=True, fault=True) == (0, 50)  # a version
    assert health.stalled(1, 50, 50, committed=False, fault=True) == (2, 50)
    assert health.stalled(1, 50, 10, committed=False, fault=False) == (1, 50)  # a join
    assert health.stalled(1, 50, None, committed=False, fault=True) == (1, 50)  # unknown
    assert health.stall_blocked(2, ["x", "y"]) is None
    blocked = health.stall_blocked(3, ["a", "b", "c"])
    assert blocked is not None and blocked.startswith("blocked: no progress in 3 generations")
    assert blocked.endswith("the last ended: a; b; c")


def test_a_tick_reads_progress_when_a_beat_asks_a_hang_waits_or_it_is_due() -> None:
    every = health.PROGRESS_EVERY
    assert not health.reads_progress(False, 10.0, 10.5, "learned", rechecking=False)
    assert health.reads_progress(True, 10.0, 10.5, "learned", rechecking=False)  # overdue
    assert health.reads_progress(False, 10.0, 10.5, "learned", rechecking=True)  # hang waits
    assert health.reads_progress(False, 10.0, 10.5, "warming", rechecking=False)  # no limit
    assert health.reads_progress(False, None, 10.5, "floor", rechecking=False)  # first tick
    assert health.reads_progress(False, 10.0, 10.0 + every, "set", rechecking=False)  # due
    assert not health.reads_progress(False, 10.0, 10.0 + every - 0.01, "off", rechecking=False)
