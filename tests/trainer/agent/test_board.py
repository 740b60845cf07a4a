"""The board between an agent and its workers: what one posts, the other reads, and
when the agent may keep its workers (every local rank registered, each process alive)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rallypoint.client import Assignment
from rallypoint.trainer.agent import Board, Posted


def assignment(generation: int) -> Assignment:
    return Assignment(
        job_id="j",
        node_id="a",
        generation=generation,
        rank=1,
        world_size=3,
        master_addr="127.0.0.1",
        master_port=29500,
    )


def test_a_worker_reads_what_the_agent_posted_last(tmp_path: Path) -> None:
    agent, worker = Board(tmp_path), Board(tmp_path)
    assert worker.read() is None
    agent.post(Posted(2, ended=False, assignment=assignment(2)))
    first = worker.read()
    assert first is not None and first.assignment == assignment(2) and not first.ended
    assert worker.read() is first  # unchanged: one stat, nothing parsed
    agent.post(Posted(2, ended=True, reason="node c dropped its heartbeat connection"))
    ended = worker.read()
    assert ended is not None and ended.ended and ended.assignment is None
    assert ended.reason == "node c dropped its heartbeat connection"


@pytest.mark.e2e  # it starts processes (to watch them die)
def test_workers_stay_only_if_every_local_rank_is_a_live_process(tmp_path: Path) -> None:
    board = Board(tmp_path)
    assert not board.workers_in_place() and not board.registered()
    board.register(0, 2)
    assert board.registered()
    assert not board.workers_in_place()  # local rank 1 has not said it stays
    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / "workers" / "1").write_text(f'{{"pid": {gone.pid}, "of": 2}}')
    assert not board.workers_in_place()  # it died: the agent restarts the node's workers
    zombie = subprocess.Popen(["true"])
    (tmp_path / "workers" / "1").write_text(f'{{"pid": {zombie.pid}, "of": 2}}')
    try:
        # Dead but not reaped yet (as torchrun's agent reaps at its next look).
        while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            pass
        assert not board.workers_in_place()
    finally:
        zombie.wait()
    board.register(1, 2)
    assert board.workers_in_place()
    board.forget_workers()
    assert not board.registered()
