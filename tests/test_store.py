"""CoordinatorStore: torch's Store semantics, kept by real coordinators on both backends."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import httpx
import pytest
import torch.distributed as dist

from rallypoint.client import ElasticClient
from rallypoint.trainer import CoordinatorStore

from .conftest import Start

# Every test here runs with the client calling each route, and through the envelope.
pytestmark = pytest.mark.usefixtures("transport")


def client(url: str, node: str = "n1") -> ElasticClient:
    c = ElasticClient(url, "kv", node)
    c.create_job(1, 4)
    return c


# (method, args): every method torch's agent and rendezvous call.
SCRIPT: list[tuple[str, tuple[Any, ...]]] = [
    ("set", ("a", b"1")),
    ("set", ("s", "text")),
    ("get", ("a",)),
    ("get", ("s",)),
    ("add", ("count", 5)),
    ("add", ("count", -2)),
    ("get", ("count",)),
    ("compare_set", ("a", b"1", b"2")),
    ("compare_set", ("a", b"stale", b"3")),
    ("compare_set", ("fresh", b"", b"v")),
    ("compare_set", ("absent", b"e", b"v")),
    ("get", ("a",)),
    ("check", (["a", "count"],)),
    ("check", (["a", "nope"],)),
    ("multi_set", (["k1", "k2"], [b"x", b"y"])),
    ("multi_get", (["k1", "k2", "a"],)),
    ("num_keys", ()),
    ("delete_key", ("a",)),
    ("delete_key", ("a",)),
    ("check", (["a"],)),
    ("num_keys", ()),
]


def play(store: Any) -> list[Any]:
    return [getattr(store, method)(*args) for method, args in SCRIPT]


def test_answers_every_call_as_torchs_own_store_does(start: Start) -> None:
    coordinator = start()
    ours = play(CoordinatorStore(client(coordinator.url), generation=1))
    assert ours == play(dist.HashStore())


def test_each_generation_has_its_own_keys(start: Start) -> None:
    c = client(start().url)
    CoordinatorStore(c, 1).set("k", b"one")
    second = CoordinatorStore(c, 2, timeout=timedelta(seconds=0.3))
    assert not second.check(["k"])
    with pytest.raises(dist.DistStoreError, match=r"\['k'\] of generation 2 missing"):
        second.get("k")
    second.set("k", b"two")
    assert CoordinatorStore(c, 1).get("k") == b"one"
    # Storing in generation 4 collects generation 2 and older, keeps 3.
    CoordinatorStore(c, 3).set("k", b"three")
    CoordinatorStore(c, 4).set("k", b"four")
    assert not CoordinatorStore(c, 1).check(["k"])
    assert not CoordinatorStore(c, 2).check(["k"])
    assert CoordinatorStore(c, 3).get("k") == b"three"


def test_a_wait_ends_when_another_coordinator_stores_the_key(start: Start) -> None:
    a, b = start(), start()
    reader = CoordinatorStore(client(a.url, "r"), 1, timeout=timedelta(seconds=60))
    writer = CoordinatorStore(client(b.url, "w"), 1)
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(reader.get("late")))
    thread.start()
    writer.set("late", b"here")
    thread.join(timeout=30)
    assert got == [b"here"]
    reader.wait(["late"])  # present: returns


def test_concurrent_adds_through_two_coordinators_count_exactly(start: Start) -> None:
    urls = [start().url, start().url]
    results: list[int] = []
    lock = threading.Lock()

    def adder(i: int) -> None:
        store = CoordinatorStore(client(urls[i % 2], f"n{i}"), 1)
        for _ in range(5):
            value = store.add("counter", 1)
            with lock:
                results.append(value)

    threads = [threading.Thread(target=adder, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(1, 31))  # each increment seen exactly once


def test_abort_ends_a_wait_at_once(start: Start) -> None:
    store = CoordinatorStore(
        client(start().url), 1, timeout=timedelta(seconds=120), abort=lambda: "generation ended"
    )
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="generation ended"):
        store.wait(["never"])
    assert time.monotonic() - started < 60  # not the 120 s timeout


def test_release_ends_a_wait_without_an_error_but_not_a_get(start: Start) -> None:
    store = CoordinatorStore(
        client(start().url), 1, timeout=timedelta(seconds=120), release=lambda: True
    )
    store.wait(["never"])  # an exit barrier of a node that left: nobody to wait for
    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError, match="missing"):
        store.get("never")  # a value nobody stored cannot be made up


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"op": "set", "keys": ["k"], "values": ["not base64!"]}, 400, "invalid_request"),
        ({"op": "set", "keys": ["k"], "values": []}, 422, "invalid_request"),
        ({"op": "add", "keys": ["a", "b"], "amount": 1}, 422, "invalid_request"),
        ({"op": "drop_table", "keys": ["k"]}, 422, "invalid_request"),
        ({"op": "get", "keys": ["k"], "wait": 3600}, 422, "invalid_request"),
    ],
)
def test_bad_store_requests_are_refused_and_change_nothing(
    start: Start, body: dict[str, Any], status: int, code: str
) -> None:
    coordinator = start()
    store = CoordinatorStore(client(coordinator.url), 1)
    store.set("k", b"kept")
    reply = httpx.post(f"{coordinator.url}/v1/jobs/kv/store/1", json=body)
    assert (reply.status_code, reply.json()["code"]) == (status, code), reply.text
    assert store.get("k") == b"kept"


def test_store_of_an_unknown_job_is_404(start: Start) -> None:
    coordinator = start()
    reply = httpx.post(
        f"{coordinator.url}/v1/jobs/nojob/store/1",
        json={"op": "set", "keys": ["k"], "values": [""]},
    )
    assert (reply.status_code, reply.json()["code"]) == (404, "unknown_job")
