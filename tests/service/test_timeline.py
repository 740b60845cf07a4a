"""The timeline as rules: what ended each generation, what the model holds, and what the
drawing shows, as plain functions (no storage, no clock: service/_timeline.py); then the
history the coordinator keeps for it, on SQLite and on Azurite."""

from __future__ import annotations

import itertools
import xml.etree.ElementTree as ET
from dataclasses import replace
from datetime import timedelta

import pytest

from rallypoint.client.models import (
    TIMELINE_GENERATIONS,
    CheckpointInfo,
    CheckpointPointer,
    GenerationInfo,
    JobSpec,
    JobSummary,
    RestoreFailure,
    Timeline,
    TimelineVersion,
)
from rallypoint.service import _seal as seal
from rallypoint.service import _timeline as tl
from rallypoint.service._checkpoints import LOG_SLOTS, Checkpoints, Version, _log_entity
from rallypoint.service._rendezvous import Generation, Job, Member, Rendezvous
from rallypoint.service.storage import BlobStore

from .._rules import save
from .._rules import seal as seal_round
from ..conftest import Clock

T0 = 1_700_000_000.0
SPEC = JobSpec(min_nodes=1, max_nodes=3, heartbeat_timeout=timedelta(seconds=10))
SVG = "{http://www.w3.org/2000/svg}"


def job(**pointers: CheckpointPointer) -> JobSummary:
    return JobSummary(
        job_id="j",
        spec=SPEC,
        generation=4,
        status="sealed",
        world_size=2,
        created_at=T0,
        **pointers,  # type: ignore[arg-type]
    )


def gen(n: int, world: int, sealed: float, ended: float | None, why: str | None) -> GenerationInfo:
    return GenerationInfo(
        generation=n,
        world_size=world,
        sealed_at=T0 + sealed,
        ended_at=None if ended is None else T0 + ended,
        ended_reason=why,
    )


def kept(number: int, at: float, tier: str = "durable", **marks: object) -> CheckpointInfo:
    return CheckpointInfo(
        version=number,
        step=number * 10,
        generation=1,
        world_size=3,
        state="pending" if tier == "pending" else "committed",
        created_at=T0 + at - 0.5,
        committed_at=None if tier == "pending" else T0 + at,
        durability=tier,  # type: ignore[arg-type]
        **marks,  # type: ignore[arg-type]
    )


def gone(number: int, at: float, tier: str = "durable") -> TimelineVersion:
    return TimelineVersion(
        version=number,
        step=number * 10,
        generation=1,
        created_at=T0 + at - 0.5,
        committed_at=T0 + at,
        durability=tier,  # type: ignore[arg-type]
        collected=True,
        collected_at=T0 + at + 5,
    )


def drawn(t: Timeline) -> ET.Element:
    """The standalone drawing, parsed: it must be well-formed XML."""
    return ET.fromstring(tl.svg(t, standalone=True))


def groups(root: ET.Element, cls: str) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if cls in (g.get("class") or "").split()]


def title(element: ET.Element) -> str:
    found = element.find(f"{SVG}title")
    return "" if found is None or found.text is None else found.text


# --- causes -----------------------------------------------------------------------------


def test_every_way_the_rules_end_a_generation_has_its_cause() -> None:
    spec_job = Job("j", SPEC, 1, "sealed", 2, 0.0, 100.0, "etag")
    members = (Member("a", 0, "h", 1), Member("b", 1, "h", 1))
    running = Generation(1, members, 100.0, None, None, None, "")
    assert tl.cause(seal.join_ends(spec_job, running, "a")) == "rejoined"
    assert tl.cause(seal.join_ends(spec_job, running, "c")) == "joined"
    cut, _, _ = seal.silent(spec_job, running, {"a": 99.0, "b": 99.0}, {"b"}, 0.0, 100.0)
    late, _, _ = seal.silent(spec_job, running, {"a": 99.0, "b": 80.0}, set(), 0.0, 100.0)
    assert (tl.cause(cut), tl.cause(late)) == ("lost", "lost")


def test_a_kill_that_a_survivors_rejoin_reported_first_still_reads_as_the_node_lost() -> None:
    # Rendezvous._name_first_cause rewrites the record so.
    assert tl.cause("node b dropped its heartbeat connection (then: member a re-joined)") == "lost"


def test_a_reason_nobody_classified_is_other_and_a_running_generation_has_none() -> None:
    assert tl.cause("the operator said so") == "other"
    assert tl.cause("") == "other"
    assert tl.cause(None) is None
    t = tl.timeline(job(), [gen(1, 2, 1, 5, None), gen(2, 2, 6, None, None)], [], [], T0 + 9)
    assert [g.cause for g in t.generations] == ["other", None]


# --- the model --------------------------------------------------------------------------


def test_kept_versions_win_over_their_log_record_and_the_pointers_are_the_jobs() -> None:
    latest = CheckpointPointer(version=3, step=30, generation=1, durable=False)
    durable = CheckpointPointer(version=2, step=20, generation=1)
    # v2 is being collected while kept also lists it; kept says latest for v3 from a
    # read a moment before the job's (which moved the pointer to v3 too).
    t = tl.timeline(
        job(checkpoint=latest, durable=durable),
        [],
        [kept(2, 4), kept(3, 6, "memory"), kept(4, 8, "pending", latest=True)],
        [gone(1, 2), gone(2, 4)],
        T0 + 9,
    )
    assert [(v.version, v.collected, v.latest, v.latest_durable) for v in t.versions] == [
        (1, True, False, False),
        (2, False, False, True),
        (3, False, True, False),
        (4, False, False, False),
    ]


def test_the_timeline_holds_the_last_generations_only() -> None:
    many = [gen(n, 1, n, n + 0.5, "node a left: x") for n in range(1, TIMELINE_GENERATIONS + 6)]
    t = tl.timeline(job(), reversed(many), [], [], T0 + 10_000)
    assert [g.generation for g in t.generations] == list(range(6, TIMELINE_GENERATIONS + 6))
    # The drawing starts at the first generation shown, not at the job's creation.
    bars = groups(drawn(t), "generation")
    assert len(bars) == TIMELINE_GENERATIONS
    assert float(bars[0].find(f"{SVG}rect").get("x")) == pytest.approx(tl._LEFT)  # type: ignore[union-attr,arg-type]


# --- the drawing ------------------------------------------------------------------------

HISTORY = [
    gen(1, 3, 1, 6, "node b dropped its heartbeat connection"),
    gen(2, 2, 7, 10, "node b joined"),
    gen(3, 3, 11, 16, "node c left: preempted (Preempt)"),
    gen(4, 2, 17, None, None),
]


def full() -> Timeline:
    latest = CheckpointPointer(version=6, step=60, generation=4, durable=False)
    durable = CheckpointPointer(version=4, step=40, generation=3)
    return tl.timeline(
        job(checkpoint=latest, durable=durable),
        HISTORY,
        [
            kept(4, 12),
            kept(5, 14, "memory", quarantined=True, quarantined_at=T0 + 15),
            kept(6, 18, "memory"),
            kept(7, 19, "pending"),
        ],
        [gone(1, 2), gone(2, 4, "memory"), gone(3, 8, "memory")],
        T0 + 20,
    )


def test_each_generation_is_a_bar_as_high_as_its_world_size() -> None:
    root = drawn(full())
    bars = groups(root, "generation")
    assert [(b.get("data-generation"), b.get("data-world-size")) for b in bars] == [
        ("1", "3"),
        ("2", "2"),
        ("3", "3"),
        ("4", "2"),
    ]
    assert [b.get("data-cause") for b in bars] == ["lost", "joined", "preempted", None]
    assert [b.get("class") for b in bars][-1] == "generation running"
    rects = [b.find(f"{SVG}rect") for b in bars]
    heights = [float(r.get("height", "")) for r in rects if r is not None]
    assert heights[0] == heights[2] == pytest.approx(heights[1] * 3 / 2, abs=0.1)
    # Left to right in time; the running one reaches now, the right edge.
    xs = [float(r.get("x", "")) for r in rects if r is not None]
    assert xs == sorted(xs)
    last = rects[-1]
    assert last is not None
    assert float(last.get("x", "")) + float(last.get("width", "")) == pytest.approx(
        tl.WIDTH - tl._RIGHT
    )
    # Hover text: world size, and why it ended.
    assert "world size 3" in title(bars[0])
    assert "node b dropped its heartbeat connection" in title(bars[0])
    assert "running" in title(bars[3])
    assert len(root.findall(f".//{SVG}path[@class='world-size']")) == 1


def test_each_restart_is_marked_with_its_cause() -> None:
    marks = groups(drawn(full()), "restart")
    assert [(m.get("data-generation"), m.get("data-cause")) for m in marks] == [
        ("1", "lost"),
        ("2", "joined"),
        ("3", "preempted"),
    ]
    colours = {m.find(f"{SVG}path").get("fill") for m in marks}  # type: ignore[union-attr]
    assert colours == {tl.CAUSE_COLOURS[c] for c in ("lost", "joined", "preempted")}
    assert title(marks[2]).endswith("node c left: preempted (Preempt)")


#: A reason of each kind the coordinator records, by the cause it reads as.
EVERY_CAUSE = {
    "lost": "node a missed heartbeats for 10.0 s",
    "hung": "rank 1 on node b hung: no progress for 3.1 s in train at step 62 (limit 3.0 s)",
    "straggler": "node c quarantined: straggler: rank 2's score 0.20 stayed under 0.75 for 3 "
    "windows (replace)",
    "preempted": "node c left: preempted (Preempt)",
    "left": "node d left: finished",
    "removed": "node e removed",
    "joined": "node f joined",
    "rejoined": "member g re-joined",
    "quarantined": "checkpoint v3 quarantined: loss spiked",
    "unrecoverable": "checkpoint v4 unrecoverable: checksum mismatch",
    "load_failed": "rank 0 could not load v5: size mismatch",
    "world_size": "rank 0 cannot train a world of 3 nodes: global batch 16",
    "other": "the operator said so",
}


def legend(root: ET.Element) -> list[tuple[float, str]]:
    """The legend's entries: where each one's text sits (y, in the drawing's units) and
    what it says."""
    (drawn_legend,) = groups(root, "legend")
    entries = []
    for item in drawn_legend.findall(f"{SVG}g"):
        shift = float((item.get("transform") or "").split(",")[1].rstrip(")"))
        text = item.find(f"{SVG}text")
        assert text is not None
        entries.append((shift + float(text.get("y", "")), text.text or ""))
    return entries


def test_a_hang_and_a_straggler_replaced_are_restarts_of_their_own() -> None:
    history = [
        gen(1, 3, 1, 6, EVERY_CAUSE["hung"]),
        gen(2, 3, 7, 10, EVERY_CAUSE["straggler"]),
        gen(3, 3, 11, None, None),
    ]
    root = drawn(tl.timeline(job(), history, [], [], T0 + 12))
    marks = groups(root, "restart")
    assert [m.get("data-cause") for m in marks] == ["hung", "straggler"]
    assert title(marks[0]).startswith("restart (rank hung) at ")
    assert title(marks[1]).endswith(EVERY_CAUSE["straggler"])
    words = [text for _, text in legend(root)]
    assert words[1:3] == ["rank hung", "straggler replaced"]


def test_the_legend_shows_every_cause_drawn_and_the_drawing_grows_to_hold_it() -> None:
    assert {tl.cause(reason) for reason in EVERY_CAUSE.values()} == set(tl.CAUSE_COLOURS)
    assert {c: tl.cause(r) for c, r in EVERY_CAUSE.items()} == {c: c for c in EVERY_CAUSE}
    history = [gen(i, 2, i, i + 0.5, why) for i, why in enumerate(EVERY_CAUSE.values(), 1)]
    root = drawn(tl.timeline(job(), history, [], [], T0 + 20))
    entries = legend(root)
    assert len([text for _, text in entries if text in tl._WORDS.values()]) == len(EVERY_CAUSE)
    height = float(root.get("height", ""))
    assert float(root.get("viewBox", "").split()[3]) == height > tl.HEIGHT
    assert max(y for y, _ in entries) < height  # the last row is not cut off
    # A job with few causes keeps the drawing's height.
    few = drawn(tl.timeline(job(), HISTORY, [], [], T0 + 20))
    assert float(few.get("height", "")) == tl.HEIGHT


def test_each_checkpoint_is_marked_by_tier_and_the_pointers_name_theirs() -> None:
    root = drawn(full())
    marks = groups(root, "checkpoint")
    assert [(m.get("data-version"), m.get("data-tier")) for m in marks] == [
        ("1", "durable"),
        ("2", "memory"),
        ("3", "memory"),
        ("4", "durable"),
        ("5", "memory"),
        ("6", "memory"),
        ("7", "pending"),
    ]
    by_version = {m.get("data-version"): m for m in marks}
    assert [v for v, m in by_version.items() if "collected" in m.get("class", "")] == [
        "1",
        "2",
        "3",
    ]
    assert by_version["4"].find(f"{SVG}rect") is not None  # durable: a square
    assert by_version["6"].find(f"{SVG}circle") is not None  # memory: a dot
    quarantined = groups(root, "quarantined")
    assert [m.get("data-version") for m in quarantined] == ["5"]
    assert quarantined[0].find(f"{SVG}path[@class='bad']") is not None
    assert "quarantined" in title(quarantined[0])
    assert [(p.get("class"), p.get("data-version")) for p in groups(root, "pointer")] == [
        ("pointer latest", "6"),
        ("pointer durable", "4"),
    ]


def test_versions_saved_moments_apart_stay_apart_in_order() -> None:
    latest = CheckpointPointer(version=3, step=30, generation=1)
    t = tl.timeline(
        job(checkpoint=latest, durable=latest), [], [kept(1, 5), kept(2, 5), kept(3, 5)], [], T0 + 9
    )
    root = drawn(t)
    xs = [float(r.get("x", "")) for g in groups(root, "checkpoint") for r in g.iter(f"{SVG}rect")]
    assert len(xs) == 3 and all(b - a >= tl._MARK_GAP - 0.1 for a, b in itertools.pairwise(xs))
    # The pointers sit over the mark they name, wherever it was moved to.
    flags = [p.find(f"{SVG}path") for p in groups(root, "pointer")]
    tips = [
        float((f.get("d") or "").rsplit("L", 1)[1].split(",")[0]) for f in flags if f is not None
    ]
    assert tips == pytest.approx([xs[2] + 4.5 - 5.5, xs[2] + 4.5 + 5.5], abs=0.1)


def test_an_unrecoverable_version_is_crossed_out_too() -> None:
    t = tl.timeline(
        job(), [], [kept(1, 2, unrecoverable=True, unrecoverable_at=T0 + 3)], [], T0 + 5
    )
    (mark,) = groups(drawn(t), "unrecoverable")
    assert mark.find(f"{SVG}path[@class='bad']") is not None
    assert "unrecoverable since" in title(mark)


def test_what_nodes_sent_stays_text_and_nothing_is_fetched() -> None:
    hostile = "node x left: <script>alert(1)</script> & \"quoted\" 'too'"
    t = tl.timeline(job(), [gen(1, 1, 1, 2, hostile)], [], [], T0 + 3)
    text = tl.svg(t, standalone=True)
    root = ET.fromstring(text)  # still well-formed
    assert root.find(f".//{SVG}script") is None
    assert hostile in title(groups(root, "restart")[0])
    # No reference out of the drawing: no links, images, fonts or style sheets.
    assert not any(a.endswith("href") or a == "src" for e in root.iter() for a in e.attrib)
    assert "url(" not in text and "@import" not in text


def test_an_empty_job_draws_its_axes_and_says_so() -> None:
    root = drawn(tl.timeline(job(), [], [], [], T0 + 0.2))
    assert groups(root, "generation") == [] and groups(root, "checkpoint") == []
    assert any(e.text == "no generation sealed yet" for e in root.iter(f"{SVG}text"))
    assert groups(root, "tick")  # a job a fraction of a second old still gets an axis


def test_the_axis_has_a_few_round_clock_times() -> None:
    def ticks(span: float) -> list[str]:
        t = tl.timeline(job(), [gen(1, 1, 0, None, None)], [], [], T0 + span)
        return [g.findtext(f"{SVG}text") or "" for g in groups(drawn(t), "tick")]

    assert 3 <= len(ticks(20)) <= 8 and all(len(t) == 8 for t in ticks(20))  # HH:MM:SS
    week = ticks(7 * 86400)
    assert 3 <= len(week) <= 8 and all(len(t) == 11 for t in week)  # MM-DD HH:MM


# --- what the coordinator keeps ---------------------------------------------------------


def test_the_coordinator_records_every_cause_the_timeline_reads(
    rdzv: Rendezvous, ckpts: Checkpoints, blobs: BlobStore, clock: Clock
) -> None:
    g, creds = seal_round(rdzv, ["a", "b", "c"])
    rdzv.leave("job", "c", g, "preempted (Preempt)", creds["c"])  # PreemptionWatcher's
    g, creds = seal_round(rdzv, ["a", "b"])
    rdzv.register("job", "d", "h", 1)  # a newcomer
    g, creds = seal_round(rdzv, ["a", "b", "d"])
    rdzv.register("job", "a", "h", 1)  # a member's process restarted
    g, creds = seal_round(rdzv, ["a", "b", "d"])
    rdzv.leave("job", "d", g, "agent shut down", creds["d"])
    g, creds = seal_round(rdzv, ["a", "b"])
    assert rdzv.expire("job", "b", clock())  # its heartbeat connection was cut
    rdzv.tick("job")
    g, creds = seal_round(rdzv, ["a", "b"])
    clock.advance(10)  # silent past the timeout (3 s)
    rdzv.tick("job")
    g, creds = seal_round(rdzv, ["a", "b"])
    v = save(ckpts, blobs, ["a", "b"], g, 10, creds)
    ckpts.quarantine("job", v, "bad data", restart=True)
    g, creds = seal_round(rdzv, ["a", "b"])
    v = save(ckpts, blobs, ["a", "b"], g, 20, creds)
    failure = RestoreFailure(node_id="a", generation=g, rank=0, reason="checksum")
    ckpts.unreadable("job", v, failure, creds["a"])
    seal_round(rdzv, ["a", "b"])

    history = rdzv.history("job")
    assert [tl.cause(h.ended_reason) for h in history] == [
        "preempted",
        "joined",
        "rejoined",
        "left",
        "lost",
        "lost",
        "quarantined",
        "unrecoverable",
        None,
    ]
    assert [h.world_size for h in history] == [3, 2, 3, 3, 2, 2, 2, 2, 2]
    # Read from a generation on: one query, bounded by it.
    assert [h.generation for h in rdzv.history("job", since=8)] == [8, 9]
    assert rdzv.history("nojob") == []


def test_collected_versions_are_remembered_as_they_were(
    rdzv: Rendezvous, ckpts: Checkpoints, blobs: BlobStore
) -> None:
    g, creds = seal_round(rdzv, ["a"])
    for step in range(1, 7):
        save(ckpts, blobs, ["a"], g, step, creds)
    assert [v.version for v in ckpts.versions("job")] == [4, 5, 6]  # keep=3
    log = ckpts.collected("job")
    assert [(v.version, v.step, v.durability, v.collected) for v in log] == [
        (1, 1, "durable", True),
        (2, 2, "durable", True),
        (3, 3, "durable", True),
    ]
    assert all(v.committed_at is not None and v.collected_at is not None for v in log)


def test_the_log_has_a_slot_per_version_number_modulo_its_size() -> None:
    v = Version("j", 7, 1, 70, 2, "committed", T0, T0 + 1)
    again = replace(v, version=7 + LOG_SLOTS)
    assert _log_entity(v, T0).row_key == _log_entity(again, T0).row_key
    assert _log_entity(v, T0).row_key != _log_entity(replace(v, version=8), T0).row_key
