"""``rallypoint jobs``, ``status`` and ``checkpoints`` against a real coordinator."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from rallypoint.client import CheckpointInfo, ElasticClient, JobStatus, JobSummary
from rallypoint.trainer import CheckpointManager

from .._coordinator import Coordinator
from .._support import COMMAND, TOKEN, cli, join_all, save_by_hand, spec

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("storage")
    coordinator = Coordinator(["--storage", f"local:{root}", "--token", TOKEN], {}).start()
    yield coordinator.url
    coordinator.stop()


def nodes(url: str, job: str, names: list[str]) -> list[ElasticClient]:
    members = [ElasticClient(url, job, n, TOKEN) for n in names]
    join_all(members, spec(len(names), len(names)))
    return members


def test_jobs_and_status_show_the_members(url: str) -> None:
    a, b = nodes(url, "table", ["node-a", "node-b"])
    flags = ["--url", url, "--token", TOKEN]
    jobs = cli("jobs", *flags)
    assert jobs.returncode == 0, jobs.stderr
    header, *rows = jobs.stdout.splitlines()
    assert header.split()[:4] == ["JOB", "NODES", "GENERATION", "STATUS"]
    assert any(row.split()[:5] == ["table", "2:2", "1", "sealed", "2"] for row in rows)

    # The environment serves as well as the flags.
    status = cli("status", "table", env={"RALLYPOINT_URL": url, "RALLYPOINT_TOKEN": TOKEN})
    assert status.returncode == 0, status.stderr
    out = status.stdout
    assert out.startswith("job table: generation 1 sealed, world size 2")
    assert "latest checkpoint: none" in out
    ranks = {a.node_id: a.assignment.rank, b.node_id: b.assignment.rank}  # type: ignore[union-attr]
    members = out.split("\nmembers\n")[1].split("\n\n")[0].splitlines()[1:]
    assert {(int(r.split()[0]), r.split()[1]) for r in members} == {
        (rank, node) for node, rank in ranks.items()
    }
    # Alive; nodes that report no progress have none to show (STEP PHASE IDLE SCORE).
    assert all(r.split()[4:] == ["alive", "-", "-", "-", "-"] for r in members)

    as_json = cli("status", "table", "--json", *flags)
    parsed = JobStatus.model_validate_json(as_json.stdout)
    assert {m.node_id: m.rank for m in parsed.members} == ranks
    listed = [
        JobSummary.model_validate(j) for j in json.loads(cli("jobs", "--json", *flags).stdout)
    ]
    assert "table" in {j.job_id for j in listed}


def test_checkpoints_lists_versions_their_durability_and_the_pointers(url: str) -> None:
    (node,) = nodes(url, "ckpts", ["solo"])
    manager = CheckpointManager(node, progress=False)
    for step in (5, 10):
        handle = manager.save({"w": torch.arange(4.0)}, step, blocking=True)
        assert handle is not None and handle.result().state == "committed"
    flags = ["--url", url, "--token", TOKEN]
    status = cli("status", "ckpts", *flags).stdout
    assert "latest checkpoint: v2 (step 10, generation 1)\n" in status
    assert "newest durable" not in status  # the latest is durable itself
    assert save_by_hand(node, 12, every=5).durability == "memory"
    node.begin_checkpoint(15)  # begun, never reported
    table = cli("checkpoints", "ckpts", *flags)
    assert table.returncode == 0, table.stderr
    header, *lines = table.stdout.splitlines()
    assert header.split()[:7] == [
        "VERSION",
        "STEP",
        "GEN",
        "STATE",
        "DURABILITY",
        "RANKS",
        "POINTER",
    ]
    rows = [r.split()[:7] for r in lines]
    assert rows == [
        ["1", "5", "1", "committed", "durable", "1/1", "-"],
        ["2", "10", "1", "committed", "durable", "1/1", "durable"],
        ["3", "12", "1", "committed", "memory", "1/1", "latest"],
        ["4", "15", "1", "pending", "pending", "0/1", "-"],
    ]
    versions = [
        CheckpointInfo.model_validate(v)
        for v in json.loads(cli("checkpoints", "ckpts", "--json", *flags).stdout)
    ]
    assert [(v.step, v.durability, v.latest, v.latest_durable) for v in versions] == [
        (5, "durable", False, False),
        (10, "durable", False, True),
        (12, "memory", True, False),
        (15, "pending", False, False),
    ]
    status = cli("status", "ckpts", *flags).stdout
    assert "latest checkpoint: v3 (step 12, generation 1, in memory)\n" in status
    assert "newest durable: v2 (step 10, generation 1)\n" in status
    jobs = cli("jobs", *flags).stdout
    assert any(r.split()[0] == "ckpts" and "v3 step 12 (memory)" in r for r in jobs.splitlines())


def test_watch_prints_each_change(url: str) -> None:
    _, b = nodes(url, "watched", ["w-a", "w-b"])
    flags = ["--url", url, "--token", TOKEN]
    watch = subprocess.Popen(
        [*COMMAND, "status", "watched", "--json", "--watch", "--interval", "0.2", *flags],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert watch.stdout is not None
        first = JobStatus.model_validate_json(watch.stdout.readline())
        assert (first.generation, len(first.members)) == (1, 2)
        b.leave("scaled in")
        # Heartbeat ages change every poll; read until the departure shows.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            latest = JobStatus.model_validate_json(watch.stdout.readline())
            if latest.history[0].ended_reason:
                break
        assert latest.history[0].ended_reason == "node w-b left: scaled in"
    finally:
        watch.terminate()
        watch.wait(10)


def test_errors_are_one_line_and_a_failing_status(url: str) -> None:
    unknown = cli("status", "nojob", "--url", url, "--token", TOKEN)
    assert unknown.returncode == 1 and "no job 'nojob'" in unknown.stderr
    denied = cli("jobs", "--url", url, "--token", "wrong")
    assert denied.returncode == 1 and "Bearer" in denied.stderr
    nowhere = cli("jobs")
    assert nowhere.returncode == 2 and "RALLYPOINT_URL" in nowhere.stderr
    started = time.monotonic()
    down = cli("jobs", "--url", "http://127.0.0.1:9")  # nothing listens on port 9
    assert down.returncode == 1 and "failed" in down.stderr
    assert time.monotonic() - started < 30


def test_status_reads_through_the_envelope(url: str) -> None:
    nodes(url, "enveloped", ["e-a"])
    out = cli("status", "enveloped", "--transport", "envelope", "--url", url, "--token", TOKEN)
    assert out.returncode == 0, out.stderr
    assert "job enveloped: generation 1 sealed, world size 1" in out.stdout


def test_status_shows_waiting_nodes(url: str) -> None:
    ElasticClient(url, "growing", "g-a", TOKEN).create_job(2, 2)
    reply = httpx.post(
        f"{url}/v1/jobs/growing/join",
        json={"node_id": "g-a", "addr": "10.0.0.7", "port": 1, "wait": 0},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert reply.status_code == 202
    out = cli("status", "growing", "--url", url, "--token", TOKEN).stdout
    assert "generation 0 open" in out
    waiting = out.split("\nwaiting\n")[1].splitlines()
    assert waiting[0].split() == ["NODE", "ADDRESS", "ROUND", "WAITING", "HEARTBEAT", "AS", "WHY"]
    assert waiting[1].split()[:3] == ["g-a", "10.0.0.7", "1"]
    assert "round 1 is open: it seals once min_nodes wait" in waiting[1]


def test_jobs_show_prints_one_job_and_its_timeline(url: str) -> None:
    nodes(url, "shown", ["s-a"])
    flags = ["--url", url, "--token", TOKEN]
    shown = cli("jobs", "show", "shown", *flags)
    assert shown.returncode == 0, shown.stderr
    # As status prints it (heartbeat ages differ from one call to the next).
    assert shown.stdout.startswith("job shown: generation 1 sealed, world size 1")
    assert "\nmembers\n" in shown.stdout and "\ngenerations\n" in shown.stdout
    timeline = cli("jobs", "show", "shown", "--timeline", *flags)
    assert timeline.returncode == 0, timeline.stderr
    *_, header, event = timeline.stdout.splitlines()
    assert header.split() == ["TIME", "SINCE", "EVENT"]
    assert event.split(None, 2)[1:] == [
        "+0.0s",
        "generation 1 sealed: world size 1, resumed from scratch",
    ]
    ElasticClient(url, "empty", "e", TOKEN).create_job(2, 2)
    empty = cli("jobs", "show", "empty", "--timeline", *flags)
    assert empty.stdout.endswith("\nno generation sealed and no checkpoint yet\n")
    for wrong in (["--timeline"], ["show"], ["list", "shown"]):
        refused = cli("jobs", *wrong, *flags)
        assert refused.returncode == 2 and "show JOB" in refused.stderr, wrong
