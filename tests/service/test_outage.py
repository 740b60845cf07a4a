"""Storage outages as rules: what a coordinator does while storage does not answer.

The rules, with an injected clock (no HTTP), and then the Azure adapters' budget against
a frozen Azurite (SIGSTOP: connections open, nothing answers), the way an overloaded or
partitioned account looks from the coordinator.
"""

from __future__ import annotations

import io
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from rallypoint.client import CREDENTIAL_HEADER, ElasticClient
from rallypoint.client.models import STALE_STATUS, JobSpec, JobStatus
from rallypoint.service._rendezvous import Rendezvous
from rallypoint.service.errors import StorageUnavailable
from rallypoint.service.storage import (
    AzureStorage,
    Entity,
    Health,
    Table,
    each_try_within,
    remaining,
    within,
)

from .._azurite import Azurite
from .._inprocess import InProcessCoordinator
from .._support import clients, join_all
from .._support import spec as timed_spec
from ..conftest import Clock

pytestmark = pytest.mark.timeout(120)


def spec(timeout: float = 3) -> JobSpec:
    return JobSpec(
        min_nodes=2,
        max_nodes=2,
        last_call=timedelta(0),
        heartbeat_timeout=timedelta(seconds=timeout),
    )


# --- the rendezvous: silence that an outage caused is not death ---------------------------


def test_members_silent_through_an_outage_get_a_full_timeout_after_it(
    rdzv: Rendezvous, clock: Clock
) -> None:
    for n in ("a", "b"):
        rdzv.register("job", n, "h", 1, spec(timeout=3))
    job, _ = rdzv.tick("job")
    assert (job.generation, job.status) == (1, "sealed")
    # Storage goes away for 10 s (3 heartbeat timeouts): no beat reaches it meanwhile.
    rdzv.storage_lost()
    clock.advance(10)
    job, wait = rdzv.tick("job")  # the first pass that reads storage again
    assert job.status == "sealed", "a member was declared dead for the outage's silence"
    assert wait == pytest.approx(3)
    # A member that stays silent after storage returned is dead one timeout later.
    clock.advance(2)
    rdzv.record_beats("job", ["a"], generation=1)
    job, _ = rdzv.tick("job")
    assert job.status == "sealed"
    clock.advance(1)
    job, _ = rdzv.tick("job")
    assert job.status == "open"
    reason = rdzv.status("job").history[0].ended_reason
    assert reason is not None and "node b missed heartbeats" in reason


def test_without_an_outage_the_same_silence_ends_the_generation(
    rdzv: Rendezvous, clock: Clock
) -> None:
    """The counterpart of the test above: the rule, not a slow clock, kept them."""
    for n in ("a", "b"):
        rdzv.register("job", n, "h", 1, spec(timeout=3))
    rdzv.tick("job")
    clock.advance(10)
    job, _ = rdzv.tick("job")
    assert job.status == "open"


def test_waiting_nodes_silent_through_an_outage_still_seal(rdzv: Rendezvous, clock: Clock) -> None:
    s = JobSpec(min_nodes=2, max_nodes=3, last_call=timedelta(seconds=1))
    for n in ("a", "b"):
        rdzv.register("job", n, "h", 1, s)
    rdzv.storage_lost()
    clock.advance(30)  # their beats (long-polls) could not be written
    job, _ = rdzv.tick("job")
    assert (job.generation, job.status) == (1, "sealed")


# --- the breaker and the deadline ----------------------------------------------------------


def test_the_breaker_lets_one_try_through_per_probe_interval_while_storage_is_down() -> None:
    clock = Clock()
    health = Health(probe_every=1.0, clock=clock)
    assert health.admit() and health.admit(), "storage answers: every try goes"
    health.record(False)
    assert health.down_for() == 0
    clock.advance(0.5)
    assert not health.admit(), "down, and the failed try was 0.5 s ago"
    assert health.down_for() == 0.5
    clock.advance(0.5)
    assert health.admit(), "a probe goes through after probe_every"
    assert not health.admit(), "one at a time"
    clock.advance(1)
    assert health.admit()
    health.record(True)
    assert health.down_for() == 0 and health.admit() and health.admit()


class _Account:
    """Storage as the readiness ping meets it through the Azure adapters: each try asks
    the breaker first, and one that goes records its own outcome."""

    def __init__(self, health: Health) -> None:
        self.health = health
        self.answers = False
        self.tries = 0

    def ping(self) -> None:
        if not self.health.admit():
            raise StorageUnavailable("refused: not retried until a probe gets through")
        self.tries += 1
        self.health.record(self.answers)
        if not self.answers:
            raise StorageUnavailable("timed out")


def test_a_ping_the_breaker_refused_does_not_put_off_the_next_trial() -> None:
    from rallypoint.service.routers.health import ping

    clock = Clock()
    account = _Account(Health(probe_every=1.0, clock=clock))
    ping(account)  # type: ignore[arg-type]  # only ping and health are used
    assert account.tries == 1 and account.health.down_for() == 0
    clock.advance(0.6)
    ping(account)  # type: ignore[arg-type]
    assert account.tries == 1, "0.6 s after a failed try: refused"
    clock.advance(0.4)
    account.answers = True
    ping(account)  # type: ignore[arg-type]
    assert account.tries == 2, "a second after the failed try, not after the refusal"
    assert account.health.down_for() == 0 and account.health.admit()


def test_deadlines_nest_to_the_earliest() -> None:
    assert remaining() is None
    with within(10):
        outer = remaining()
        assert outer is not None and 9 < outer <= 10
        with within(100):
            inner = remaining()
            assert inner is not None and inner <= outer
        with within(1):
            inner = remaining()
            assert inner is not None and inner <= 1
    assert remaining() is None


# --- against a frozen Azurite -----------------------------------------------------------------


@pytest.fixture(scope="module")
def own_azurite() -> Iterator[Azurite]:
    """An Azurite of this module's own: the tests freeze it."""
    azurite = Azurite()
    assert azurite.start(), f"Azurite did not start: {azurite.log.read_text()}"
    yield azurite
    azurite.stop()


@pytest.fixture
def azure(own_azurite: Azurite) -> Iterator[AzureStorage]:
    storage = AzureStorage(
        prefix="o" + uuid.uuid4().hex[:12], connection_string=own_azurite.connection_string
    )
    yield storage
    storage.close()


@pytest.fixture
def table(azure: AzureStorage) -> Table:
    """The ``azure`` storage's table of jobs, with one row: ``p``/``r``, ``x`` = 1."""
    jobs = azure.table("jobs")
    jobs.upsert(Entity("p", "r", {"x": 1}))
    return jobs


@pytest.mark.azurite
def test_work_that_grows_with_a_job_limits_each_try_not_the_whole(
    table: Table, own_azurite: Azurite
) -> None:
    # A tick of a large job: many reads, together longer than the limit (the pauses stand
    # for the reads of ten thousand rows); each read is quick, so none fails.
    with each_try_within(0.3):
        for _ in range(3):
            assert table.get("p", "r").data["x"] == 1
            time.sleep(0.2)
    # The same under a deadline for the whole fails: that is the difference.
    with within(0.3), pytest.raises(StorageUnavailable):
        for _ in range(3):
            table.get("p", "r")
            time.sleep(0.2)
    # A frozen account still shows within the limit of one try.
    with own_azurite.frozen():
        started = time.monotonic()
        with each_try_within(1.0), pytest.raises(StorageUnavailable):
            table.get("p", "r")
        assert time.monotonic() - started < 2.5


@pytest.mark.azurite
def test_a_call_under_a_deadline_fails_within_it_when_storage_is_frozen(
    azure: AzureStorage, table: Table, own_azurite: Azurite
) -> None:
    with own_azurite.frozen():
        started = time.monotonic()
        with within(1.0), pytest.raises(StorageUnavailable):
            table.get("p", "r")
        assert time.monotonic() - started < 2.5
        # Storage is known down now: another call fails at once, before any timeout.
        started = time.monotonic()
        with pytest.raises(StorageUnavailable):
            table.upsert(Entity("p", "r", {"x": 2}))
        assert time.monotonic() - started < 0.5
        assert azure.health.down_for() > 0
    # Back: the next try after the probe interval goes through and closes the breaker.
    deadline = time.monotonic() + 10
    while True:
        try:
            assert table.get("p", "r").data["x"] == 1, "the refused write wrote nothing"
            break
        except StorageUnavailable:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert azure.health.down_for() == 0


@pytest.mark.azurite
def test_a_heartbeat_counts_when_it_arrives_though_storage_holds_its_answer(
    own_azurite: Azurite,
) -> None:
    """Replicas judge a member's silence from the beats in storage, stamped with their
    arrival. A beat that reaches a replica while that replica waits on storage (here: its
    first read of the job, behind an Azurite frozen for 0.6 s, within the read's 1 s
    budget) counts from when it arrived, not from when storage let the replica answer
    it."""
    env = {
        "AZURE_STORAGE_CONNECTION_STRING": own_azurite.connection_string,
        "RALLYPOINT_STORAGE_PREFIX": "b" + uuid.uuid4().hex[:10],
    }
    one = InProcessCoordinator(["--storage", "azure"], env).start()
    two = InProcessCoordinator(["--storage", "azure"], env).start()
    try:
        a, b = clients(one.url, ["a", "b"])
        join_all([a, b], timed_spec(2, 2, timeout=60))  # sealed through one
        time.sleep(1.0)  # a beat sent now is a second younger than the joins' own
        beat = ElasticClient(two.url, "job", "a", credential=a.credential)
        beat.assignment = a.assignment  # the same node, through the other replica
        replies: list[str] = []
        with own_azurite.frozen():
            sent = time.time()
            heartbeat = threading.Thread(target=lambda: replies.append(beat.heartbeat().action))
            heartbeat.start()
            time.sleep(0.6)  # the replica waits for storage to read the job
        heartbeat.join(30)
        assert replies == ["continue"]
        watcher = ElasticClient(one.url, "job", "x")
        deadline = time.monotonic() + 10
        while True:
            ages = {m.node_id: m.heartbeat_age for m in watcher.membership().members}
            # No earlier than the coordinator's clock when it answered: the beat's
            # stamp is at most this.
            stamped = time.time() - (ages["a"] or 0.0)
            if stamped >= sent - 0.5:  # the beat through two is in storage
                break
            assert time.monotonic() < deadline, "the beat never reached storage"
            time.sleep(0.05)
        assert stamped < sent + 0.3, (
            f"stamped {stamped - sent:.2f} s after it was sent: when storage answered"
        )
    finally:
        two.stop()
        one.stop()


@pytest.mark.azurite
def test_a_replica_storage_does_not_answer_takes_no_beat(own_azurite: Azurite) -> None:
    """Replicas find storage again at different times, and one that found it judges a
    member's silence by the beats in storage. A beat taken by a replica still cut off
    would reach storage only once that one finds it too: after the member was declared
    dead. So a replica whose passes fail answers beats 503 (the member's retry goes
    through the balancer to another replica) though it stays ready within its grace."""
    env = {
        "AZURE_STORAGE_CONNECTION_STRING": own_azurite.connection_string,
        "RALLYPOINT_STORAGE_PREFIX": "c" + uuid.uuid4().hex[:10],
    }
    coordinator = InProcessCoordinator(["--storage", "azure"], env).start()
    try:
        base = f"{coordinator.url}/v1/jobs/job"
        # A 3 s timeout: each try of the replica's passes may take a third of it.
        spec = {"min_nodes": 1, "max_nodes": 1, "last_call": 0, "heartbeat_timeout": 3}
        join = {"node_id": "a", "addr": "h", "port": 1, "spec": spec, "wait": 30}
        joined = httpx.post(f"{base}/join", json=join, timeout=60).json()
        a = {CREDENTIAL_HEADER: joined["credential"]}
        generation = joined["assignment"]["generation"]
        beat = {"generation": generation}
        assert httpx.post(f"{base}/nodes/a/heartbeat", json=beat, headers=a).status_code == 200
        with own_azurite.frozen():
            deadline = time.monotonic() + 5
            while True:
                reply = httpx.post(f"{base}/nodes/a/heartbeat", json=beat, headers=a, timeout=10)
                if reply.status_code != 200:
                    break
                assert time.monotonic() < deadline, "beats still taken 5 s into the outage"
                time.sleep(0.1)
            assert (reply.status_code, reply.json()["code"]) == (503, "storage_unavailable")
            assert reply.headers["Retry-After"] == "1"
            # Still ready: the balancer keeps it, for the beats it can take again soon.
            ready = httpx.get(f"{coordinator.url}/readyz", timeout=10)
            assert (ready.status_code, ready.json()["storage_state"]) == (200, "unavailable")
        deadline = time.monotonic() + 20
        while httpx.post(f"{base}/nodes/a/heartbeat", json=beat, headers=a).status_code != 200:
            assert time.monotonic() < deadline, "beats not taken again after the outage"
            time.sleep(0.1)
    finally:
        coordinator.stop()


@pytest.mark.azurite
def test_the_status_answers_with_its_last_view_and_its_age_while_storage_is_frozen(
    own_azurite: Azurite,
) -> None:
    """A replica that read a job's status answers it through a storage outage: 200 with
    the last view it read, its ``age`` growing (the page and the CLI say it is old), also
    to a look after its reads stopped for want of viewers; a job it never read is 503.
    Once storage answers, the view is fresh again."""
    from rallypoint.cli._inspect import print_status

    env = {
        "AZURE_STORAGE_CONNECTION_STRING": own_azurite.connection_string,
        "RALLYPOINT_STORAGE_PREFIX": "s" + uuid.uuid4().hex[:10],
    }
    coordinator = InProcessCoordinator(["--storage", "azure"], env).start()
    url = f"{coordinator.url}/v1/jobs"

    def status(job: str = "job") -> httpx.Response:
        return httpx.get(f"{url}/{job}", timeout=30)

    try:
        join_all(clients(coordinator.url, ["a", "b"]), timed_spec(2, 2, timeout=60))
        before = status().json()
        assert before["status"] == "sealed" and before["age"] < 2.5
        assert httpx.get(f"{coordinator.url}/jobs/job", timeout=30).status_code == 200
        members = sorted(m["node_id"] for m in before["members"])
        with own_azurite.frozen():
            frozen_at = time.monotonic()
            ages, read_at = [], set()
            while time.monotonic() - frozen_at < STALE_STATUS + 1:
                reply = status()
                assert reply.status_code == 200, reply.text
                assert sorted(m["node_id"] for m in reply.json()["members"]) == members
                read_at.add(reply.json()["as_of"])
                ages.append(reply.json()["age"])
                time.sleep(0.2)
            assert len(read_at) == 1, "a view read while storage was frozen"
            assert ages == sorted(ages) and ages[-1] >= STALE_STATUS
            page = httpx.get(f"{coordinator.url}/jobs/job", timeout=30)
            assert page.status_code == 200 and "<p id='stale' class='error'>" in page.text
            out = io.StringIO()
            print_status(JobStatus.model_validate_json(reply.content), out)
            assert "the coordinator has not read storage since" in out.getvalue()
            # Nothing to show of a job it never read.
            never = status("other")
            assert (never.status_code, never.json()["code"]) == (503, "storage_unavailable")
            # Nobody looks for longer than the reads go on without viewers: the next look
            # tries a read first, and answers the last view when it fails.
            time.sleep(6)
            late = status()
            assert late.status_code == 200 and late.json()["age"] > ages[-1]
        deadline = time.monotonic() + 20
        while status().json()["age"] > 1.5:
            assert time.monotonic() < deadline, "the view was not read again after the outage"
            time.sleep(0.2)
    finally:
        coordinator.stop()


# --- what callers are told -------------------------------------------------------------------


@pytest.mark.azurite
def test_a_write_during_an_outage_is_503_with_retry_after(
    azure: AzureStorage, own_azurite: Azurite, tmp_path: Path
) -> None:
    from starlette.testclient import TestClient

    from rallypoint.service.app import create_app
    from rallypoint.service.settings import Settings

    app = create_app(Settings(storage=f"local:{tmp_path}"), storage=azure)
    with TestClient(app) as coordinator, own_azurite.frozen():
        reply = coordinator.post(
            "/v1/jobs/j/join",
            json={"node_id": "a", "addr": "h", "spec": {"min_nodes": 1, "max_nodes": 1}},
        )
    assert reply.status_code == 503 and reply.json()["code"] == "storage_unavailable"
    assert reply.headers["Retry-After"] == "1"


def test_the_client_retries_no_later_than_retry_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's backoff grows to 10 s; a coordinator that says when to come back
    (a second, while storage is down) is asked again by then."""
    import httpx

    from rallypoint.client import ElasticClient, RetryPolicy
    from rallypoint.client import _client as client_module

    replies = iter(
        [
            httpx.Response(
                503,
                headers={"Retry-After": "1"},
                json={"code": "storage_unavailable", "message": "down"},
            ),
            httpx.Response(200, json={"jobs": []}),
        ]
    )
    slept: list[float] = []
    monkeypatch.setattr(client_module.time, "sleep", slept.append)
    client = ElasticClient(
        "http://coordinator",
        "j",
        "a",
        retry=RetryPolicy(initial=timedelta(seconds=10)),
        http_transport=httpx.MockTransport(lambda request: next(replies)),
    )
    client._request("GET", "/v1/jobs")
    assert len(slept) == 1 and slept[0] <= 1.0
