"""A process that regroups in place calls ``dist.init_process_group`` once per
generation, and torch wraps ``sys.excepthook`` at each call: uncaught exceptions must
still carry one ``[rankN]:`` prefix, the current generation's. Real process groups
(gloo, world 1) in the test's process, one after another."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from rallypoint.cli.processes import free_port
from rallypoint.trainer import _regroup
from rallypoint.trainer._regroup import _one_excepthook


@pytest.fixture
def hooks() -> Iterator[None]:
    """The interpreter's own hook and no record of one, then the hook and record as they
    were. In-process tests that built a process group earlier in the same process leave
    torch's prefixing hook installed: under four xdist workers the first test below saw
    three prefixes, two of them not its own (two raw ``init_process_group`` calls before
    it reproduce that)."""
    assert not dist.is_initialized()
    original, recorded = sys.excepthook, _regroup._hooks
    sys.excepthook, _regroup._hooks = sys.__excepthook__, None
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.excepthook, _regroup._hooks = original, recorded


def generation() -> None:
    with _one_excepthook():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    dist.destroy_process_group()


def uncaught(capsys: pytest.CaptureFixture[str]) -> str:
    """What the installed hook prints for an uncaught ``ValueError``."""
    capsys.readouterr()
    try:
        raise ValueError("boom")
    except ValueError:
        sys.excepthook(*sys.exc_info())
    return capsys.readouterr().err


def test_three_generations_leave_one_rank_prefix(
    hooks: None, capsys: pytest.CaptureFixture[str]
) -> None:
    for _ in range(3):
        generation()
    err = uncaught(capsys)
    assert "[rank0]: ValueError: boom" in err
    assert "[rank0]: [rank0]:" not in err  # torch alone nests one prefix per generation


def test_a_hook_set_between_generations_is_kept(
    hooks: None, capsys: pytest.CaptureFixture[str]
) -> None:
    generation()
    seen: list[Any] = []
    previous = sys.excepthook

    def mine(*args: Any) -> None:
        seen.append(args[0])
        previous(*args)

    sys.excepthook = mine
    generation()
    err = uncaught(capsys)
    assert seen == [ValueError]
    assert "[rank0]: ValueError: boom" in err
