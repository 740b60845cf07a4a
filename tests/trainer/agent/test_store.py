"""CoordinatorStore: torch's Store semantics, kept by real coordinators on both backends."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import httpx
import pytest
import torch.distributed as dist
from torch.distributed.elastic.utils.store import barrier

from rallypoint.client import CREDENTIAL_HEADER, ElasticClient, JobSpec
from rallypoint.trainer import CoordinatorStore

from ...conftest import Start

# Every test here runs with the client calling each route, and through the envelope.
pytestmark = pytest.mark.usefixtures("transport")


def members(urls: list[str], nodes: list[str]) -> list[ElasticClient]:
    """Clients of ``nodes`` (through ``urls`` in turn), joined into generation 1 of the
    job: a generation's store is its members' (each acts with its join's credential)."""
    clients = [ElasticClient(urls[i % len(urls)], "kv", n) for i, n in enumerate(nodes)]
    spec = JobSpec(min_nodes=len(nodes), max_nodes=len(nodes), last_call=timedelta(0))
    with ThreadPoolExecutor(len(clients)) as pool:
        generations = {a.generation for a in pool.map(lambda c: c.join(spec=spec), clients)}
    assert generations == {1}
    return clients


def client(url: str, node: str = "n1") -> ElasticClient:
    """The one member of generation 1."""
    return members([url], [node])[0]


def rejoin(c: ElasticClient) -> tuple[int, ElasticClient]:
    """Ends ``c``'s generation (a member that joins again) and seals the next; returns
    it and a client of ``c``'s node as a member of the generation that ended, with that
    join's credential (what may still read the ended generation's keys)."""
    before = ElasticClient(c.url, c.job_id, c.node_id, credential=c.credential)
    return c.join().generation, before


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
    url = start().url
    c = client(url)
    CoordinatorStore(c, 1).set("k", b"one")
    generation, first = rejoin(c)
    assert generation == 2
    second = CoordinatorStore(c, 2, timeout=timedelta(seconds=0.3))
    assert not second.check(["k"])
    with pytest.raises(dist.DistStoreError, match=r"\['k'\] of generation 2 missing"):
        second.get("k")
    second.set("k", b"two")
    assert CoordinatorStore(first, 1).get("k") == b"one"
    # Storing in generation 4 collects generation 2 and older, keeps 3.
    generation, second_member = rejoin(c)
    assert generation == 3
    CoordinatorStore(c, 3).set("k", b"three")
    generation, third = rejoin(c)
    assert generation == 4
    CoordinatorStore(c, 4).set("k", b"four")
    assert not CoordinatorStore(first, 1).check(["k"])
    assert not CoordinatorStore(second_member, 2).check(["k"])
    assert CoordinatorStore(third, 3).get("k") == b"three"


def test_a_wait_ends_when_another_coordinator_stores_the_key(start: Start) -> None:
    r, w = members([start().url, start().url], ["r", "w"])
    reader = CoordinatorStore(r, 1, timeout=timedelta(seconds=60))
    writer = CoordinatorStore(w, 1)
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(reader.get("late")))
    thread.start()
    writer.set("late", b"here")
    thread.join(timeout=30)
    assert got == [b"here"]
    reader.wait(["late"])  # present: returns


def test_concurrent_adds_through_two_coordinators_count_exactly(start: Start) -> None:
    clients = members([start().url, start().url], [f"n{i}" for i in range(6)])
    results: list[int] = []
    lock = threading.Lock()

    def adder(i: int) -> None:
        store = CoordinatorStore(clients[i], 1)
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


def test_a_node_that_left_passes_its_exit_barrier_in_the_ended_generation(start: Start) -> None:
    """torch's agent checks in at an exit barrier in its generation's store. A node that
    left ended that generation, whose keys take no more writes: its barrier passes
    without an error (torch's traceback costs seconds of CPU on a shared host), once
    the plugin knows it left; a node that did not leave is told its generation ended."""
    a, b = members([start().url], ["a", "b"])
    b.leave("preempted")  # generation 1 ends
    answers = iter([False, False])  # the plugin learns of the departure a moment later
    left = CoordinatorStore(b, 1, release=lambda: next(answers, True))
    barrier(left, world_size=2, key_prefix="exit/", barrier_timeout=60)
    stayed = CoordinatorStore(a, 1, abort=lambda: "generation 1 ended", release=lambda: False)
    with pytest.raises(dist.DistStoreError, match="not running"):
        barrier(stayed, world_size=2, key_prefix="exit/", barrier_timeout=60)
    assert CoordinatorStore(a, 1).num_keys() == 0  # neither check-in was stored


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"op": "set", "keys": ["k"], "values": ["not base64!"]}, 400, "invalid_request"),
        ({"op": "set", "keys": ["k"], "values": []}, 422, "invalid_request"),
        ({"op": "add", "keys": ["a", "b"], "amount": 1}, 422, "invalid_request"),
        ({"op": "add", "keys": ["k2"], "amount": 2**63}, 422, "invalid_request"),
        ({"op": "add", "keys": ["k2"], "amount": -(2**63) - 1}, 422, "invalid_request"),
        ({"op": "drop_table", "keys": ["k"]}, 422, "invalid_request"),
        ({"op": "get", "keys": ["k"], "wait": 3600}, 422, "invalid_request"),
    ],
)
def test_bad_store_requests_are_refused_and_change_nothing(
    start: Start, body: dict[str, Any], status: int, code: str
) -> None:
    coordinator = start()
    c = client(coordinator.url)
    store = CoordinatorStore(c, 1)
    store.set("k", b"kept")
    reply = httpx.post(
        f"{coordinator.url}/v1/jobs/kv/store/1",
        json={**body, "node_id": c.node_id},
        headers={CREDENTIAL_HEADER: c.credential or ""},
    )
    assert (reply.status_code, reply.json()["code"]) == (status, code), reply.text
    assert store.get("k") == b"kept"


def test_store_of_an_unknown_job_is_404(start: Start) -> None:
    coordinator = start()
    reply = httpx.post(
        f"{coordinator.url}/v1/jobs/nojob/store/1",
        json={"op": "set", "keys": ["k"], "values": [""], "node_id": "n1"},
        headers={CREDENTIAL_HEADER: "made-up"},
    )
    assert (reply.status_code, reply.json()["code"]) == (404, "unknown_job")


def test_counters_stay_within_int64(start: Start) -> None:
    """torch's stores count in 64 bits: a sum that leaves int64 is refused, and the
    counter keeps its value."""
    store = CoordinatorStore(client(start().url), 1)
    top, bottom = 2**63 - 1, -(2**63)
    assert store.add("up", top) == top
    with pytest.raises(dist.DistStoreError, match="leaves int64"):
        store.add("up", 1)
    assert store.get("up") == str(top).encode()
    assert store.add("down", bottom) == bottom
    with pytest.raises(dist.DistStoreError, match="leaves int64"):
        store.add("down", -1)
    assert store.add("down", 0) == bottom


def test_a_hot_standbys_store_keeps_its_keys_here_until_it_follows_its_generation(
    start: Start,
) -> None:
    """A hot standby's agent hands torchrun a store of generation 0 before the node is
    promoted: torchrun assigns its workers' ranks there as the one agent of a one-node
    world, with torch's semantics and nothing stored in the coordinator. Promoted into a
    generation of two agents, the store follows it, and torchrun's exit barrier (world 1)
    passes with the other agent's (world 2)."""
    a, b = members([start().url], ["a", "b"])
    standby = CoordinatorStore(b, generation=0)
    assert play(standby) == play(dist.HashStore())
    assert CoordinatorStore(a, 1).num_keys() == 0
    standby.follow(1, 1 - 2)
    exit_barrier = "torchelastic/agent/terminal_state"  # torchrun's own key
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(barrier, CoordinatorStore(a, 1), 2, exit_barrier, 60)
        barrier(standby, world_size=1, key_prefix=exit_barrier, barrier_timeout=60)
        other.result(timeout=60)
    assert standby.finished
    assert CoordinatorStore(a, 1).get(f"{exit_barrier}/num_members") == b"2"
