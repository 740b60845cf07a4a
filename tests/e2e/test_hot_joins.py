"""Hot joins end to end: real torchrun agents with the backend's defaults (``hot_join``
is on), the DDP example regrouping in place with two worker processes a node, a real
coordinator.

A newcomer to a running generation with room parks instead of ending it, starts its
workers at once, and only when every one of them waits in ``ElasticClient.join()``, its
model built, does the generation end for it: the members train on meanwhile and never
wait for its process start. ``judge`` checks that every rank of every generation loaded
the checkpoint the coordinator named for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rallypoint.cli.processes import Coordinator

from .._support import judged, small_cluster, status, status_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NPROC = 2


def test_a_hot_join_ends_the_generation_only_once_its_workers_wait(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    cluster = small_cluster(
        coordinator,
        "warm",
        tmp_path,
        nnodes="1:3",
        nproc=NPROC,
        in_place=True,
        steps=300,
    )
    try:
        cluster.start("a", "b")
        cluster.wait_for(lambda e: e["event"] == "step" and e["world_size"] == 2 * NPROC, 180)
        cluster.add("c")
        # It parks: generation 1 runs on while its workers start.
        status_until(coordinator, "warm", lambda body: any(w["standby"] for w in body["waiting"]))
        assert status(coordinator, "warm")["generation"] == 1
        first = cluster.wait_for(
            lambda e: e["event"] == "step" and e["world_size"] == 3 * NPROC, 180
        )
        codes = cluster.wait(timeout=240)
    finally:
        cluster.stop()
    history = judged(coordinator, cluster, 300)
    assert [(g["world_size"], g["ended_reason"]) for g in history[:1]] == [(2, "node c joined")]
    assert [g["world_size"] for g in history] == [2, 3]
    events = cluster.events()
    waiting = [e for e in events if e["event"] == "standing_by"]
    assert sorted(e["node"] for e in waiting) == ["c"] * NPROC
    # The generation ended only once both of c's workers waited, their models built.
    assert history[0]["ended_at"] > max(e["t"] for e in waiting), (history[0], waiting)
    # Members trained on while c's workers started: steps between c's join and the end.
    trained = [e for e in events if e["event"] == "step" and e["generation"] == 1]
    assert any(e["t"] > min(w["t"] for w in waiting) for e in trained)

    # The processes that waited are the ones that train at rank 4 and 5; the members'
    # processes regrouped in place.
    def pids(generation: int) -> dict[int, int]:
        return {
            e["rank"]: e["pid"]
            for e in events
            if e["event"] == "resumed" and e["generation"] == generation
        }

    resumed = pids(2)
    assert {resumed[4], resumed[5]} == {e["pid"] for e in waiting}
    assert {resumed[r] for r in range(2 * NPROC)} == set(pids(1).values())
    assert first["generation"] == 2
    assert codes == {"a": 0, "b": 0, "c": 0}


#: The first time a worker starts parked, builds its process group before ``join()``, as
#: a script written for torchrun alone does; then runs the example. The placeholder
#: master must refuse it: at port 0 it trained alone, in a world of one.
GROUP_FIRST = """
import os, runpy, sys
from pathlib import Path

mark = Path(os.environ["CRASH_MARK"])
if os.environ.get("RALLYPOINT_STANDBY_ROUND") and not mark.exists():
    mark.touch()
    import torch.distributed as dist
    dist.init_process_group("gloo")
    print("GROUP BUILT", dist.get_world_size(), flush=True)
    sys.exit(3)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_hot_join_whose_script_builds_its_group_before_join_goes_in_cold(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    """A script that does not call ``join()`` first cannot build a group in the parked
    node's placeholder world: its worker fails at once. The node's join would otherwise
    wait, parked, for an end nothing else brings: the agent says it is ready, and starts
    its workers again, cold, for the generation it goes into."""
    cluster = small_cluster(
        coordinator,
        "crash",
        tmp_path,
        nnodes="1:3",
        in_place=True,
        # c joins after a and b's first step, and goes in cold after its worker's crash:
        # at 200 steps a run of cheap steps once ended before that (c then exits 0 as a
        # standby whose job finished). 400: 20 s of steps at the least.
        steps=400,
    )
    wrapper = tmp_path / "group_first.py"
    wrapper.write_text(GROUP_FIRST)
    cluster.script = [str(wrapper), *cluster.script]
    mark = tmp_path / "crashed"
    try:
        cluster.start("a", "b", env={"CRASH_MARK": str(mark)})
        cluster.wait_for(lambda e: e["event"] == "step" and e["world_size"] == 2, 180)
        joiner = cluster.add("c", env={"CRASH_MARK": str(mark)})
        cluster.wait_for(lambda e: e["event"] == "step" and e["world_size"] == 3, 180)
        codes = cluster.wait(timeout=240)
    finally:
        cluster.stop()
    assert mark.exists()
    log = joiner.log.read_text(errors="replace")
    assert "GROUP BUILT" not in log
    assert "port must have value from 0 to 65535 but was 65536" in log
    assert "exited while it parked for round 2" in log
    history = judged(coordinator, cluster, 400)
    # One end: the node went in with its workers started cold, as a cold join does.
    assert [g["world_size"] for g in history] == [2, 3]
    assert history[0]["ended_reason"] == "node c joined"
    assert codes == {"a": 0, "b": 0, "c": 0}
