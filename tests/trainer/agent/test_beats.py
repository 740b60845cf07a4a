"""The agent's heartbeats (``_Beats``, as torchrun's plugin runs them) against a real
coordinator: once its generation ends, a node beats on until its agent joins again, so
the next round waits for a node whose workers are slow to stop (service/_seal.py,
``restarting``) instead of sealing without it."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from rallypoint.client import Assignment, ElasticClient
from rallypoint.trainer.agent._rendezvous import _Beats

from ..._support import clients, join_all, spec
from ...conftest import Start


def joining(node: ElasticClient, into: dict[str, Assignment]) -> threading.Thread:
    def join() -> None:
        into[node.node_id] = node.join("127.0.0.1", 30200, timeout=timedelta(seconds=20))

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    return thread


def test_an_agent_beats_on_after_its_generation_ends_and_the_round_waits_for_it(
    start: Start,
) -> None:
    url = start().url
    a, b, c = clients(url, ["a", "b", "c"])
    first = join_all([a, b], spec(2, 3, last_call=0, timeout=1))
    agent = _Beats(b, timedelta(seconds=0.25))
    second: dict[str, Assignment] = {}
    threads = [joining(c, second)]  # ends generation 1
    deadline = time.monotonic() + 10
    while agent.ended is None:
        assert time.monotonic() < deadline, "b's agent was not told its generation ended"
        time.sleep(0.02)
    threads.append(joining(a, second))
    # b's workers take over twice the heartbeat timeout to stop: the round waits.
    end = time.monotonic() + 2.5
    while time.monotonic() < end:
        assert second == {}, "the round sealed without b"
        time.sleep(0.05)
    agent.stop()
    threads.append(joining(b, second))
    for thread in threads:
        thread.join(30)
    assert sorted(second) == ["a", "b", "c"]
    assert {x.generation for x in second.values()} == {first[0].generation + 1}
    assert {x.world_size for x in second.values()} == {3}
