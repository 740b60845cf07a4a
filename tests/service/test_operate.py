"""Operating a coordinator: Prometheus metrics, JSON logs, and a graceful SIGTERM."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from rallypoint.client import (
    CREDENTIAL_HEADER,
    ElasticClient,
    HeartbeatReply,
    Manifest,
    StaleGeneration,
)
from rallypoint.trainer import CheckpointManager, download

from .._coordinator import Coordinator
from .._support import join_all, save_by_hand, spec

pytestmark = pytest.mark.e2e

TOKEN = "ops-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MANIFEST = "manifest.json"


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    c = Coordinator(
        ["--storage", f"local:{tmp_path}", "--token", TOKEN, "--log-format", "json"],
        {"RALLYPOINT_ACCESS_LOG": "true"},
    ).start()
    yield c
    c.stop()


def samples(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    reply = httpx.get(f"{url}/metrics", headers=AUTH)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(reply.text)
        for s in family.samples
    }


def value(
    found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def test_metrics_follow_the_job(coordinator: Coordinator) -> None:
    url = coordinator.url
    assert httpx.get(f"{url}/metrics").status_code == 401
    a, b = (ElasticClient(url, "m", n, TOKEN) for n in ("a", "b"))
    join_all([a, b], spec(2, 2))
    for _ in range(3):
        a.heartbeat()
    b.heartbeat()
    solo = ElasticClient(url, "one", "s", TOKEN)
    join_all([solo], spec(1, 1))
    saver = CheckpointManager(solo, progress=False)
    for step in (1, 2):
        handle = saver.save({"w": torch.arange(1000.0)}, step, blocking=True)
        assert handle is not None and handle.result().state == "committed"
    assert save_by_hand(solo, 3, every=5).durability == "memory"
    written = 0
    for info in solo.checkpoints():
        manifest = Manifest.model_validate_json(
            download(solo.checkpoint(info.version).urls[MANIFEST])
        )
        written += sum(f.size for shard in manifest.shards for f in shard.files)
    solo.begin_checkpoint(4)  # begun, never reported
    # The manager reports its restore; a node without a memory tier reads from storage.
    restored = saver.load(2)
    assert restored.bytes_from["storage"] > 0
    solo.report_restore(3, {"memory": 100, "peer": 20}, rank=0)
    for _ in range(2):
        httpx.get(f"{url}/scanner/probe/{time.time()}")

    found = samples(url)
    assert value(found, "rallypoint_job_generation", job="m") == 1
    assert value(found, "rallypoint_job_world_size", job="m") == 2
    assert value(found, "rallypoint_job_members", job="m", state="alive") == 2
    assert value(found, "rallypoint_heartbeats_total", job="m") == 4
    beats = "/v1/jobs/{job_id}/nodes/{node_id}/heartbeat"
    assert (
        value(found, "rallypoint_http_requests_total", method="POST", route=beats, status="200")
        == 4
    )
    assert (
        value(found, "rallypoint_http_request_duration_seconds_count", method="POST", route=beats)
        == 4
    )
    assert (
        value(
            found, "rallypoint_http_requests_total", method="GET", route="unmatched", status="404"
        )
        == 2
    )
    assert value(found, "rallypoint_checkpoint_commits_total", job="one") == 3
    assert value(found, "rallypoint_job_checkpoint_step", job="one") == 3
    assert value(found, "rallypoint_job_durable_checkpoint_step", job="one") == 2
    assert value(found, "rallypoint_checkpoint_committed_bytes_total", job="one") == written
    restores = {
        source: value(found, "rallypoint_checkpoint_restore_bytes_total", job="one", source=source)
        for source in ("memory", "peer", "storage")
    }
    assert restores == {"memory": 100, "peer": 20, "storage": restored.bytes_from["storage"]}
    versions = {
        durability: value(found, "rallypoint_checkpoint_versions", job="one", durability=durability)
        for durability in ("pending", "memory", "durable")
    }
    assert versions == {"pending": 1, "memory": 1, "durable": 2}
    assert value(found, "rallypoint_checkpoint_versions", job="m", durability="durable") == 0

    b.leave("scaled in")
    found = samples(url)
    assert value(found, "rallypoint_job_generations_ended", job="m", reason="left") == 1

    # A restore in a generation that ended still restores; its report is refused (a
    # zombie's numbers), and the manager does not fail for it.
    solo.leave("done")
    with pytest.raises(StaleGeneration):
        solo.report_restore(2, {"storage": 1}, rank=0)
    assert saver.load(2).bytes_from == restored.bytes_from
    found = samples(url)
    counted = value(found, "rallypoint_checkpoint_restore_bytes_total", job="one", source="storage")
    assert counted == restored.bytes_from["storage"]
    saver.close()


def test_logs_are_json_lines(coordinator: Coordinator) -> None:
    httpx.get(f"{coordinator.url}/v1/jobs/nojob", headers=AUTH)
    lines = [line for line in coordinator.log.read_text().splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]  # every line is one object
    assert all({"time", "level", "logger", "message"} <= e.keys() for e in entries)
    access = [e for e in entries if e["logger"] == "uvicorn.access"]
    assert any(
        (e["method"], e["path"], e["status"]) == ("GET", "/v1/jobs/nojob", 404) for e in access
    )
    assert any(e["logger"] == "uvicorn.error" and "startup" in e["message"] for e in entries)


def test_sigterm_answers_held_requests_at_once(coordinator: Coordinator) -> None:
    url = coordinator.url
    a = ElasticClient(url, "held", "a", TOKEN)
    join_all([a], spec(1, 1, timeout=60))
    ElasticClient(url, "pair", "p", TOKEN).create_job(2, 2)
    replies: dict[str, tuple[int, float]] = {}

    def hold(name: str, path: str, body: dict[str, object]) -> None:
        headers = {**AUTH, CREDENTIAL_HEADER: a.credential or ""}  # the watch acts as a
        reply = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)
        replies[name] = (reply.status_code, time.monotonic())
        if name == "watch":
            assert HeartbeatReply.model_validate_json(reply.content).action == "continue"

    held = [
        ("watch", "/v1/jobs/held/nodes/a/heartbeat", {"generation": 1, "wait": 30}),
        ("join", "/v1/jobs/pair/join", {"node_id": "p", "addr": "h", "port": 1, "wait": 30}),
    ]
    threads = [threading.Thread(target=hold, args=h) for h in held]
    for t in threads:
        t.start()
    # Both are held once the coordinator counted the beat and registered the joiner.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = samples(url)
        beat = value(found, "rallypoint_heartbeats_total", job="held")
        if beat == 1 and value(found, "rallypoint_job_waiting_nodes", job="pair") == 1:
            break
    assert coordinator.proc is not None
    signalled = time.monotonic()
    coordinator.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    # uvicorn re-raises the signal once it shut down cleanly, as the default action would.
    assert coordinator.proc.wait(15) == -signal.SIGTERM
    assert replies["watch"][0] == 200 and replies["join"][0] == 202  # "still waiting: poll"
    # Answered within the shutdown, not after their 30 s holds.
    assert max(at for _, at in replies.values()) - signalled < 5
    log = coordinator.log.read_text()
    assert "Cancel" not in log  # no request was cut at the graceful-shutdown timeout
