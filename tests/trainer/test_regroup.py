"""Regrouping in place without torchrun: processes that are each their own node
(``generations(client)`` heartbeats and joins again for them) keep their pids through a
SIGKILL of one of them and a newcomer, and every generation's process group is whole.

Under torchrun the same runs through the agent's board: see ``test_torchrun.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ..conftest import Start

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

# One node: joins, then trains (an all-reduce of ones: the sum is the world size) until
# the test writes the done file, generation after generation, in one process.
NODE = r"""
import json, os, sys, time
from datetime import timedelta
from rallypoint.client import ElasticClient, JobSpec
url, job, node, events, done = sys.argv[1:6]
client = ElasticClient(url, job, node)
# Nothing beats between the join and generations(), while torch imports (seconds, three
# processes on two cores): a 3 s timeout took a live node for dead there, and the next
# generation's group set-up then waited for the node the test killed in the meantime.
spec = JobSpec(min_nodes=2, max_nodes=3, last_call=timedelta(seconds=1),
               heartbeat_timeout=timedelta(seconds=10))
client.join("127.0.0.1", spec=spec)
import torch, torch.distributed as dist
from rallypoint.trainer import generations
for generation in generations(client):
    with generation:
        while not os.path.exists(done):
            total = torch.ones(1)
            dist.all_reduce(total)
            line = {"node": node, "pid": os.getpid(), "generation": generation.number,
                    "rank": generation.rank, "world": generation.world_size,
                    "sum": int(total.item()), "in_place": generation.regrouped}
            with open(events, "a") as f:
                f.write(json.dumps(line) + "\n")
            generation.check()
            time.sleep(0.05)
    if os.path.exists(done):
        break
client.leave("done", fenced=False)
"""


def lines(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
    except FileNotFoundError:
        return []


def wait_for_world(path: Path, world: int, generation: int, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if any(e["world"] == world and e["generation"] >= generation for e in lines(path)):
            return
        time.sleep(0.05)
    raise TimeoutError(f"no step at world size {world} in generation {generation}+")


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_nodes_without_an_agent_regroup_in_place(start: Start, tmp_path: Path) -> None:
    url = start().url
    events, done = tmp_path / "events.jsonl", tmp_path / "done"
    script = tmp_path / "node.py"
    script.write_text(NODE)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def add(node: str) -> None:
        args = [sys.executable, str(script), url, "plain", node, str(events), str(done)]
        log = (tmp_path / f"{node}.log").open("wb")
        procs[node] = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)

    try:
        for node in ("a", "b", "c"):
            add(node)
        wait_for_world(events, 3, 1)
        procs["c"].send_signal(signal.SIGKILL)
        wait_for_world(events, 2, 2)
        add("d")
        wait_for_world(events, 3, 3)
        done.touch()
        for node in ("a", "b", "d"):
            assert procs[node].wait(60) == 0, (tmp_path / f"{node}.log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            proc.kill()
    seen = lines(events)
    # Every step's all-reduce summed one per process of its generation: whole groups.
    assert all(e["sum"] == e["world"] for e in seen), seen
    worlds = {e["generation"]: e["world"] for e in seen}
    assert [worlds[g] for g in sorted(worlds)] == [3, 2, 3], worlds
    last = max(worlds)
    for node in ("a", "b"):  # the survivors: one process through every generation
        mine = [e for e in seen if e["node"] == node]
        assert len({e["pid"] for e in mine}) == 1, mine[:3]
        assert {e["generation"] for e in mine} == set(worlds)
        assert all(e["in_place"] for e in mine if e["generation"] > 1)
    assert {e["generation"] for e in seen if e["node"] == "d"} == {last}
