"""Quiet survivors, as rules: when a worker's error is its generation's end (one line,
said by the agent) and when it is an error that keeps its traceback. No process, no
clock: the board is a real folder, time is a counter. The one error told to the
coordinator (an uncaught ``WorldSizeError``) goes to one in this process."""

from __future__ import annotations

from pathlib import Path

import pytest

from rallypoint.client import CREDENTIAL_ENV, GENERATION_ENV, JOB_ENV, NODE_ENV, URL_ENV
from rallypoint.trainer import WorldSizeError, plan_batch
from rallypoint.trainer.agent import QUIET_ENV, REGROUP_ENV, Board, Posted, generation_end
from rallypoint.trainer.agent._quiet import ended, report_uncaught, waits_for_board

from ..._support import clients, join_all, spec
from ...conftest import Start


class Ticks:
    """A clock that moves only when the code under test sleeps; ``at`` runs something at
    a given time (the agent posting on the board)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept = 0.0
        self.due: list[tuple[float, object]] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds
        for when, action in list(self.due):
            if self.now >= when:
                self.due.remove((when, action))
                action()  # type: ignore[operator]


@pytest.fixture
def board(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Board:
    monkeypatch.setenv(REGROUP_ENV, str(tmp_path))
    monkeypatch.setenv(GENERATION_ENV, "7")
    monkeypatch.delenv(QUIET_ENV, raising=False)
    return Board(tmp_path)


def test_a_generation_ends_when_the_board_says_so_or_names_a_later_one() -> None:
    assert ended(None, 7) is None
    assert ended(Posted(7, ended=False), 7) is None
    assert ended(Posted(6, ended=True, reason="old"), 7) is None
    assert ended(Posted(7, ended=True, reason="node n2 lost"), 7) == "node n2 lost"
    assert ended(Posted(7, ended=True), 7) == "ended"
    assert ended(Posted(8, ended=False), 7) == "generation 8 followed"


def test_what_a_lost_peer_raises_waits_for_the_board_and_nothing_else_does() -> None:
    # gloo's errors are RuntimeErrors; torch.distributed's DistError family too.
    import torch.distributed as dist

    assert waits_for_board(RuntimeError("Connection reset by peer"))
    assert waits_for_board(dist.DistBackendError("NCCL"))
    assert waits_for_board(ConnectionResetError())
    assert waits_for_board(TimeoutError())
    assert not waits_for_board(ValueError("a bug in the script"))
    assert not waits_for_board(KeyError("model"))


def test_a_collective_that_fails_before_the_agent_knows_waits_for_the_board(
    board: Board,
) -> None:
    ticks = Ticks()
    # The agent hears of the end 1.3 s after the collective failed.
    ticks.due.append((1.3, lambda: board.post(Posted(7, ended=True, reason="node n2 lost"))))
    reason = generation_end(RuntimeError("Connection reset"), clock=ticks, sleep=ticks.sleep)
    assert reason == "node n2 lost"
    assert 1.3 <= ticks.now < 1.4


def test_a_communication_error_the_board_never_explains_keeps_its_traceback(
    board: Board,
) -> None:
    board.post(Posted(7, ended=False))
    ticks = Ticks()
    assert generation_end(RuntimeError("shape mismatch"), clock=ticks, sleep=ticks.sleep) is None
    assert ticks.now == pytest.approx(5.0, abs=0.05)  # RALLYPOINT_QUIET_WAIT's default


def test_any_other_error_is_asked_once_and_never_waits(board: Board) -> None:
    ticks = Ticks()
    assert generation_end(ValueError("bug"), clock=ticks, sleep=ticks.sleep) is None
    assert ticks.slept == 0
    board.post(Posted(7, ended=True, reason="node n2 lost"))
    # Even a bug, raised once the generation ended, is the end's (the agent restarts).
    assert generation_end(ValueError("bug"), clock=ticks, sleep=ticks.sleep) == "node n2 lost"


def test_turned_off_or_outside_the_agent_every_error_keeps_its_traceback(
    board: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    board.post(Posted(7, ended=True, reason="node n2 lost"))
    monkeypatch.setenv(QUIET_ENV, "0")
    assert generation_end(RuntimeError("reset")) is None
    monkeypatch.delenv(QUIET_ENV)
    assert generation_end(RuntimeError("reset")) == "node n2 lost"
    assert generation_end(KeyboardInterrupt()) is None  # not an error: never quiet
    monkeypatch.delenv(REGROUP_ENV)
    assert generation_end(RuntimeError("reset")) is None


def test_the_wait_is_a_setting(board: Board, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RALLYPOINT_QUIET_WAIT", "0.5")
    ticks = Ticks()
    assert generation_end(RuntimeError("reset"), clock=ticks, sleep=ticks.sleep) is None
    assert ticks.now == pytest.approx(0.5, abs=0.05)


def test_an_uncaught_world_size_error_is_reported_for_the_node(
    start: Start, board: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker under the agent that never caught its ``WorldSizeError`` (a hand-written
    loop): its excepthook reports the sizes that can, once, for its node and generation
    (from the agent's environment); other errors, or a worker outside the agent, report
    nothing."""
    url = start().url
    nodes = clients(url, ["a", "b", "c"], job="quiet")
    join_all(nodes, spec(3, 3))
    c = nodes[2]
    assert c.assignment is not None and c.credential is not None
    for name, value in {
        URL_ENV: url,
        JOB_ENV: "quiet",
        NODE_ENV: "c",
        GENERATION_ENV: str(c.assignment.generation),
        CREDENTIAL_ENV: c.credential,
        "RANK": "5",
        "LOCAL_WORLD_SIZE": "2",
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(WorldSizeError) as caught:
        plan_batch(16, 6, micro_batch=8)  # 3 nodes of 2: 2, 4, 8 or 16 ranks can
    report_uncaught(RuntimeError("not this one"))
    monkeypatch.delenv(REGROUP_ENV)
    report_uncaught(caught.value)  # outside the agent: nothing
    assert not caught.value.reported and c.membership().status == "sealed"
    monkeypatch.setenv(REGROUP_ENV, str(board.folder))
    report_uncaught(caught.value)
    info = c.membership()
    assert caught.value.reported and info.status == "open" and info.world_sizes == []
    assert info.history[-1].ended_reason is not None
    assert info.history[-1].ended_reason.startswith("rank 5 cannot train a world of 3 nodes")
