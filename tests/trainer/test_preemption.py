"""PreemptionWatcher against a stand-in for Azure's Scheduled Events (IMDS) on loopback,
and real signals."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from rallypoint.cli.fake_imds import FakeImds
from rallypoint.cli.processes import free_port
from rallypoint.client import ElasticClient
from rallypoint.trainer import RESTART_EXIT_CODE, PreemptionWatcher

from ..conftest import Spawn


@pytest.fixture
def imds() -> Iterator[FakeImds]:
    with FakeImds() as fake:
        yield fake


def wait_until(condition: object, timeout: float = 10) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_the_fake_serves_azures_documented_shape(imds: FakeImds) -> None:
    url = imds.url + "/metadata/scheduledevents?api-version=2020-07-01"
    assert httpx.get(url).status_code == 400  # no Metadata header: refused, as Azure does
    event_id = imds.schedule("vm1")
    doc = httpx.get(url, headers={"Metadata": "true"}).json()
    (event,) = doc["Events"]
    assert event["EventId"] == event_id and event["EventType"] == "Preempt"
    assert event["Resources"] == ["vm1"] and event["EventStatus"] == "Scheduled"
    assert isinstance(doc["DocumentIncarnation"], int) and "GMT" in event["NotBefore"]


def test_notices_only_events_naming_this_vm_and_acknowledges_them(imds: FakeImds) -> None:
    watcher = PreemptionWatcher(
        imds_url=imds.url, vm_name="vm1", poll=True, signals=(), poll_interval=_ms(20)
    )
    with watcher:
        imds.schedule("vm2")  # another VM's eviction
        imds.schedule("vm1", kind="Freeze")  # not a departure
        polls = imds.polls
        assert wait_until(lambda: imds.polls >= polls + 3)
        assert watcher.notice is None and not watcher.should_stop()
        event_id = imds.schedule("vm1", kind="Terminate")
        assert wait_until(lambda: watcher.notice is not None)
        assert watcher.notice is not None
        assert (watcher.notice.kind, watcher.notice.event_id) == ("Terminate", event_id)
        assert watcher.should_stop()  # no process group: this process's own answer
        watcher.acknowledge()
    assert imds.acknowledged == [event_id]


def test_an_unreachable_metadata_service_is_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rallypoint.trainer")
    with PreemptionWatcher(
        imds_url=f"http://127.0.0.1:{free_port()}",
        vm_name="vm",
        poll=True,
        signals=(),
        poll_interval=_ms(20),
    ) as watcher:
        # The poll thread says so once, at its first failed poll, and polls on.
        assert wait_until(lambda: "Scheduled Events unreachable" in caplog.text), "never polled"
        assert any(t.name == "rallypoint-imds" and t.is_alive() for t in threading.enumerate())
        assert watcher.notice is None and not watcher.should_stop()
    assert all(r.levelno < logging.WARNING for r in caplog.records)


def test_sigterm_is_a_notice_and_the_old_handler_comes_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionWatcher(poll=False) as watcher:
        os.kill(os.getpid(), signal.SIGTERM)
        assert wait_until(lambda: watcher.notice is not None)
        assert watcher.notice is not None and watcher.notice.kind == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == before


FINISH = textwrap.dedent(
    """
    import os, signal, sys, time
    from rallypoint.client import ElasticClient
    from rallypoint.trainer import PreemptionWatcher
    client = ElasticClient(sys.argv[1], "fin", sys.argv[2])
    client.join()
    watcher = PreemptionWatcher(client, imds_url=sys.argv[3], vm_name=sys.argv[2],
                                poll_interval=__import__("datetime").timedelta(seconds=0.02))
    watcher.start()
    print("ready", flush=True)
    while not watcher.should_stop():
        time.sleep(0.02)
    watcher.finish()
    """
)


def test_finish_leaves_for_the_notified_node_and_restarts_the_others(
    spawn: Spawn, imds: FakeImds
) -> None:
    coordinator = spawn()
    ElasticClient(coordinator.url, "fin", "x").create_job(2, 2)
    procs = {
        node: subprocess.Popen(
            [sys.executable, "-c", FINISH, coordinator.url, node, imds.url],
            stdout=subprocess.PIPE,
            text=True,
        )
        for node in ("gone", "stays")
    }
    for proc in procs.values():
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    event_id = imds.schedule("gone")
    assert procs["gone"].wait(30) == 0
    assert imds.acknowledged == [event_id]
    status = ElasticClient(coordinator.url, "fin", "x").membership()
    assert status.history[-1].ended_reason == "node gone left: preempted (Preempt)"
    # The other process shares no process group with it, so it trains on; a SIGTERM now
    # finds its generation over and exits at once with the restart code.
    procs["stays"].send_signal(signal.SIGTERM)
    assert procs["stays"].wait(30) == RESTART_EXIT_CODE


def _ms(n: int) -> object:
    from datetime import timedelta

    return timedelta(milliseconds=n)
