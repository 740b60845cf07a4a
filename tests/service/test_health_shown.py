"""What people see of progress, hangs and stragglers (issue 62, items 3 and 5): the words
the CLI and the page share, then the count of hangs on storage, then a coordinator at
work: ``rallypoint status``, ``rallypoint jobs hangs``, ``rallypoint jobs unblock``, the
page and the metrics while members beat with their processes' progress through the
real heartbeat route (tests/service/test_status_page.py drives the page in Chromium).
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rallypoint.client import (
    ElasticClient,
    HangReport,
    Health,
    JobSpec,
    JobStatus,
    MemberStatus,
    RankProgress,
    StacksReport,
)
from rallypoint.client.models import MAX_STACKS_BYTES
from rallypoint.service import _metrics
from rallypoint.service._rendezvous import HANGS_KEPT, Rendezvous

from .._rules import seal
from .._support import TOKEN, Stepping, cli, join_all
from ..conftest import Clock, Start

AUTH = {"Authorization": f"Bearer {TOKEN}"}
# What py-spy dump prints of a process stopped in its all-reduce (cut short).
STACKS = """Process 4242: python train.py
Python v3.12.3 (/usr/bin/python3.12)

Thread 4242 (idle): "MainThread"
    allreduce (torch/distributed/distributed_c10d.py:2806)
    step (train.py:41)
    <module> (train.py:60)
"""


def member(*progress: RankProgress, score: float | None = None, slow: bool = False) -> MemberStatus:
    return MemberStatus(
        node_id="n",
        rank=0,
        addr="h",
        heartbeat_age=0.1,
        state="alive",
        progress=list(progress),
        score=score,
        straggler=slow,
    )


# --- as people read it ------------------------------------------------------------------


def test_a_members_progress_and_the_hang_limit_read_as_words() -> None:
    assert member().shown() == ("-", "-", "-")
    one = RankProgress(rank=3, step=120, idle=0.04)
    assert member(one).shown() == ("120", "train", "0.0s")
    # A node of several processes: the range of their steps, their phases, the longest idle.
    saving = RankProgress(rank=4, step=118, phase="save", idle=2.26)
    assert member(one, saving).shown() == ("118-120", "save/train", "2.3s")
    assert Health(hang_limit=3.0, hang_limit_source="floor", phase_limit=600).limit() == (
        "3.0s (floor)"
    )
    assert Health(hang_limit=12.46, hang_limit_source="learned", phase_limit=600).limit() == (
        "12.5s (learned)"
    )
    assert Health(phase_limit=600).limit() == "not yet (warming)"
    assert Health(hang_limit_source="off", phase_limit=600).limit() == "off"


def test_a_hang_report_says_what_became_of_its_stacks() -> None:
    report = HangReport(
        generation=3, node_id="b", rank=1, phase="train", step=62, idle=3.14, limit=3.0, at=0.0
    )
    assert report.reason == (
        "rank 1 on node b hung: no progress for 3.1 s in train at step 62 (limit 3.0 s)"
    )
    assert report.stacks_state() == "not sent yet"
    failed = report.model_copy(update={"stacks_error": "py-spy is not installed"})
    assert failed.stacks_state() == "none: py-spy is not installed"
    # faulthandler after py-spy failed: the tool that took them, the failure kept apart.
    taken = failed.model_copy(update={"taken_by": "faulthandler", "stacks": "Thread 0x1 ..."})
    assert taken.stacks_state() == "faulthandler"


def test_the_metrics_tell_a_straggler_replaced_from_an_operators_quarantine() -> None:
    kind = _metrics._reason_kind
    assert kind("node c quarantined: straggler: rank 2's score 0.20 stayed under 0.75") == (
        "straggler"
    )
    assert kind("node c quarantined: ECC errors") == "quarantined"
    assert kind("rank 1 on node b hung: no progress for 3.1 s in train at step 62") == "hung"


# --- on storage -------------------------------------------------------------------------


@pytest.mark.parametrize("storage", ["local"], indirect=True)
def test_every_hang_is_counted_though_the_reports_keep_the_last_20(
    rdzv: Rendezvous, clock: Clock
) -> None:
    hangs = HANGS_KEPT + 2
    for i in range(hangs):
        # A new node hangs each time (none twice: no quarantine), each generation a step
        # further than the one before (no stall); its peer comes back each time.
        peer, stuck = "p", f"h{i}"
        gen, _ = seal(rdzv, [peer, stuck])
        stopped = [RankProgress(rank=1, step=100 * i, idle=5, interval=0.1)]
        waits = [RankProgress(rank=0, step=100 * i, idle=5, interval=0.1, waiting=True)]
        said = {peer: waits, stuck: stopped}
        rdzv.record_beats("job", [peer, stuck], gen, progress=said)
        job, _ = rdzv.tick("job")
        assert job.status == "open", f"generation {gen} did not end for the hang"
    status = rdzv.status("job")
    assert status.health is not None and status.health.hangs == hangs
    reports = rdzv.hang_reports("job")
    assert [r.generation for r in reports] == list(range(3, hangs + 1))
    # A report reads as its generation's end, word for word.
    assert status.history[-1].ended_reason == reports[-1].reason
    assert reports[-1].reason.startswith(f"rank 1 on node h{hangs - 1} hung: no progress for 5.0 s")


@pytest.mark.parametrize("storage", ["local", "azure"], indirect=True)
def test_the_longest_stacks_a_report_may_carry_are_kept_whole(rdzv: Rendezvous) -> None:
    """A report of the most characters each field takes, each character the most bytes
    one takes (an emoji: 4 in UTF-16, 12 as JSON's escapes), is kept whole."""
    gen, _ = seal(rdzv, ["p", "h"])
    stopped = [RankProgress(rank=1, step=100, idle=5, interval=0.1)]
    waits = [RankProgress(rank=0, step=100, idle=5, interval=0.1, waiting=True)]
    said = {"p": waits, "h": stopped}
    rdzv.record_beats("job", ["p", "h"], gen, progress=said)
    rdzv.tick("job")
    stacks = "\U0001f9ca" * MAX_STACKS_BYTES
    report = StacksReport(
        rank=1, pid=2**31, stacks=stacks, error="\U0001f9ca" * 1000, taken_by="\U0001f9ca" * 100
    )
    kept = rdzv.record_stacks("job", gen, "h", report)
    assert kept.stacks == stacks and rdzv.hang_report("job", gen).stacks == stacks


# --- a coordinator at work --------------------------------------------------------------


def samples(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    reply = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30)
    assert reply.status_code == 200
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(reply.text)
        for s in family.samples
    }


def until(read: ElasticClient, done: object, timeout: float = 40) -> JobStatus:
    """Polls the job's status until ``done(status)`` holds; that status."""
    end = time.monotonic() + timeout
    while True:
        status = read.membership()
        if done(status):  # type: ignore[operator]
            return status
        if time.monotonic() > end:
            raise TimeoutError(f"not within {timeout} s: {status.model_dump_json()}")
        time.sleep(0.2)


def section(out: str, name: str) -> list[list[str]]:
    """The rows of a table ``rallypoint status`` prints under ``name``, split on spaces."""
    lines = out.split(f"\n{name}\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return [line.split() for line in lines]


@pytest.mark.e2e  # the command runs as a process
@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_an_operator_sees_progress_a_straggler_and_a_hang(start: Start) -> None:
    url = start("--token", TOKEN).url
    flags = ["--url", url, "--token", TOKEN]
    nodes = [ElasticClient(url, "j", n, TOKEN) for n in ("a", "b", "c")]
    join_all(nodes, JobSpec(min_nodes=3, max_nodes=3, heartbeat_timeout=timedelta(seconds=10)))
    rank = {n.node_id: n.assignment.rank for n in nodes if n.assignment is not None}
    operator = ElasticClient(url, "j", "operator", TOKEN)
    # c's own share of each step takes 5 times a's and b's: c is the straggler. The
    # others wait for it at the all-reduce, which their own step time leaves out.
    with Stepping(nodes, own={"c": 0.5}) as stepping:
        started = time.monotonic()
        named = until(operator, lambda s: s.health.stragglers)
        # 3 windows of 5 s in a row, the first perhaps cut short.
        assert time.monotonic() - started < 20

        shown = cli("status", "j", *flags)
        assert shown.returncode == 0, shown.stderr
        health = next(line for line in shown.stdout.splitlines() if line.startswith("health:"))
        assert health == (
            "health: hang limit 3.0s (floor), phase limit 600s; "
            f"stragglers: c (rank {rank['c']}, score 0.20); hangs so far: 0"
        )
        header, *rows = section(shown.stdout, "members")
        assert header == [
            "RANK", "NODE", "ADDRESS", "HEARTBEAT", "STATE", "STEP", "PHASE", "IDLE", "SCORE"
        ]  # fmt: skip
        by_node = {r[1]: r for r in rows}
        assert all(int(r[5]) > 0 and r[6] == "train" for r in rows)
        assert by_node["c"][8:] == ["0.20", "straggler"]
        assert by_node["a"][8:] == by_node["b"][8:] == ["1.00"]
        stragglers = section(shown.stdout, "stragglers")
        assert stragglers[0] == ["NODE", "RANK", "SCORE", "WINDOWS", "SINCE"]
        # Named after 3 windows; a view is up to a second old, and a window (5 s) may
        # pass between it and the two commands on a loaded machine.
        assert stragglers[1][:3] == ["c", str(rank["c"]), "0.20"]
        assert int(stragglers[1][3]) in (3, 4)
        as_json = JobStatus.model_validate_json(cli("status", "j", "--json", *flags).stdout)
        assert as_json.health is not None
        assert [(s.node_id, s.windows in (3, 4)) for s in as_json.health.stragglers] == [
            ("c", True)
        ]
        assert {m.node_id: m.straggler for m in as_json.members} == {
            "a": False,
            "b": False,
            "c": True,
        }
        assert named.health is not None and named.health.hang_limit_source == "floor"

        found = samples(url)
        assert found[("rallypoint_job_stragglers", frozenset({("job", "j")}))] == 1
        assert found[("rallypoint_job_hang_limit_seconds", frozenset({("job", "j")}))] == 3.0
        assert found[("rallypoint_job_hangs_total", frozenset({("job", "j")}))] == 0
        page = httpx.get(f"{url}/jobs/j", headers=AUTH, timeout=30).text
        assert "<p id='health'>hang limit <b>3.0s (floor)</b>" in page
        assert "<tr class='alive straggler'>" in page
        assert "<span class='badge straggler'>straggler</span>" in page

        # b's process stops (as a SIGSTOP would): found past the 3 s limit.
        stepping.freeze("b")
        replies = stepping.ended()
    # Only b's agent is told to take its rank's stacks.
    assert {n: r.hung for n, r in replies.items()} == {"a": None, "b": (rank["b"],), "c": None}
    reason = replies["a"].reason
    assert reason is not None
    assert re.fullmatch(
        rf"rank {rank['b']} on node b hung: no progress for 3\.\d s in train at step \d+ "
        r"\(limit 3\.0 s\)",
        reason,
    ), reason

    listed = cli("jobs", "hangs", "j", *flags)
    assert listed.returncode == 0, listed.stderr
    header, row = (line.split() for line in listed.stdout.splitlines())
    assert header == ["GEN", "NODE", "RANK", "PHASE", "STEP", "IDLE", "LIMIT", "FOUND", "STACKS"]
    assert row[:4] == ["1", "b", str(rank["b"]), "train"] and row[6] == "3.0s"
    assert row[-3:] == ["not", "sent", "yet"]
    # b's agent sends them, with b's credential, once it has stopped the process.
    b = nodes[1]
    b.report_stacks(
        1,
        StacksReport(
            rank=rank["b"], pid=4242, stacks=STACKS, taken_by="py-spy 0.4.1 (not suspended)"
        ),
    )
    one = cli("jobs", "hangs", "j", "1", *flags)
    assert one.returncode == 0, one.stderr
    assert one.stdout.startswith(f"generation 1 ended: {reason}\nfound: ")
    assert f"process: 4242 (rank {rank['b']} on node b)\n" in one.stdout
    assert "stacks, taken by py-spy 0.4.1 (not suspended):\n\n" + STACKS in one.stdout
    report = HangReport.model_validate_json(cli("jobs", "hangs", "j", "1", "--json", *flags).stdout)
    assert (report.stacks, report.pid, report.reason) == (STACKS, 4242, reason)
    (summary,) = json.loads(cli("jobs", "hangs", "j", "--json", *flags).stdout)
    assert summary["stacks"] is None and summary["taken_by"] == "py-spy 0.4.1 (not suspended)"
    none = cli("jobs", "hangs", "j", "2", *flags)
    assert none.returncode == 1 and "no hang ended generation 2" in none.stderr
    bad = cli("jobs", "hangs", "j", "first", *flags)
    assert bad.returncode == 2 and "GENERATION must be a generation number" in bad.stderr

    shown = cli("status", "j", *flags).stdout
    assert "hangs so far: 1 (rallypoint jobs hangs j)" in shown
    assert reason in shown  # the generations table
    found = samples(url)
    assert found[("rallypoint_job_hangs_total", frozenset({("job", "j")}))] == 1
    ended = frozenset({("job", "j"), ("reason", "hung")})
    assert found[("rallypoint_job_generations_ended", ended)] == 1
    assert found[("rallypoint_job_stragglers", frozenset({("job", "j")}))] == 0

    page = httpx.get(f"{url}/jobs/j", headers=AUTH, timeout=30).text
    assert "<table id='hangs'>" in page and "<a href='/jobs/j/hangs/1'>1</a>" in page
    hang = httpx.get(f"{url}/jobs/j/hangs/1", headers=AUTH, timeout=30)
    assert hang.status_code == 200
    assert f"<p id='reason'>{reason}</p>" in hang.text
    assert "<pre id='stacks'>" in hang.text and "&lt;module&gt; (train.py:60)" in hang.text
    assert "<script" not in hang.text  # complete: it no longer refreshes
    assert httpx.get(f"{url}/jobs/j/hangs/1", timeout=30).status_code == 401  # sign in first
    missing = httpx.get(f"{url}/jobs/j/hangs/2", headers=AUTH, timeout=30)
    assert missing.status_code == 404 and "no hang ended generation 2" in missing.text


@pytest.mark.e2e  # the command runs as a process
@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_job_blocked_for_hangs_without_progress_restarts_once_unblocked(start: Start) -> None:
    url = start("--token", TOKEN).url
    flags = ["--url", url, "--token", TOKEN]
    spec = JobSpec(
        min_nodes=4,
        max_nodes=4,
        heartbeat_timeout=timedelta(seconds=10),
        hang_limit=timedelta(seconds=1),
    )
    nodes = [ElasticClient(url, "stuck", n, TOKEN) for n in ("a", "b", "c", "d")]
    # A different node hangs each time (a second would quarantine it), and each time at
    # the step the first reached: generations 2 to 4 make no progress.
    for generation, hung in enumerate("dabc", start=1):
        join_all(nodes, spec)
        assert {n.assignment.generation for n in nodes if n.assignment} == {generation}
        with Stepping(nodes) as stepping:
            stepping.freeze(hung)
            replies = stepping.ended()
        node = next(n for n in nodes if n.node_id == hung)
        assert node.assignment is not None and replies[hung].hung == (node.assignment.rank,)
        if hung == "a":  # its process could give no stacks
            node.report_stacks(
                generation,
                StacksReport(rank=node.assignment.rank, error="py-spy is not installed"),
            )
    operator = ElasticClient(url, "stuck", "operator", TOKEN)
    status = operator.membership()
    assert status.blocked is not None and status.blocked.startswith(
        "blocked: no progress in 3 generations in a row"
    )
    assert status.health is not None and (status.health.hangs, status.health.stalled) == (4, 3)
    shown = cli("status", "stuck", *flags).stdout
    assert "health: hang limit 1.0s (set), phase limit 600s; stragglers: none; " in shown
    assert "hangs so far: 4 (rallypoint jobs hangs stuck); generations without progress: 3\n" in (
        shown
    )
    assert f"\n{status.blocked}\n" in shown
    listed = cli("jobs", "hangs", "stuck", *flags).stdout.splitlines()
    assert [line.split()[:2] for line in listed[1:]] == [
        ["1", "d"],
        ["2", "a"],
        ["3", "b"],
        ["4", "c"],
    ]
    assert listed[2].endswith("none: py-spy is not installed")
    one = cli("jobs", "hangs", "stuck", "2", *flags).stdout
    assert "no stacks: the process could not give them: py-spy is not installed" in one
    metrics = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30).text
    assert 'rallypoint_job_blocked{job="stuck"} 1.0' in metrics
    assert 'rallypoint_job_hangs_total{job="stuck"} 4.0' in metrics

    with ThreadPoolExecutor(1) as pool:
        # The nodes come back; the round does not seal while the job is blocked.
        joined = pool.submit(join_all, nodes, spec)
        until(operator, lambda s: len(s.waiting) == 4, timeout=30)
        assert not joined.done()
        # Only the admin token may unblock.
        reader = operator.create_token("reader").token
        refused = cli("jobs", "unblock", "stuck", "--url", url, "--token", reader)
        assert refused.returncode == 1 and "may not act" in refused.stderr, refused.stderr
        done = cli("jobs", "unblock", "stuck", *flags)
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"job stuck unblocked; it was {status.blocked}\n"
        assignments = joined.result(timeout=30)
    assert {a.generation for a in assignments} == {5}
    again = cli("jobs", "unblock", "stuck", *flags)
    assert again.stdout == "job stuck was not blocked\n"
    assert "generations without progress" not in cli("status", "stuck", *flags).stdout
    watched = cli("jobs", "unblock", "stuck", "--watch", *flags)
    assert watched.returncode == 2 and "--watch does not go with unblock" in watched.stderr
