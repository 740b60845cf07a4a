"""How long an example's step waits beyond its work: ``--step-time``, until the file
``--step-time-file`` names holds a number (``Cluster.wait`` writes it, so that a test's
job finishes quickly once the test only waits for its end)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rallypoint.trainer.examples import _launch
from rallypoint.trainer.examples._launch import arguments, pause


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    waits: list[float] = []
    monkeypatch.setattr(_launch.time, "sleep", waits.append)
    return waits


def parsed(*argv: str) -> argparse.Namespace:
    return arguments("test").parse_args(list(argv))


def test_a_step_waits_its_step_time_until_the_file_says_otherwise(
    tmp_path: Path, slept: list[float]
) -> None:
    knob = tmp_path / "job.step-time"
    args = parsed("--step-time", "0.05", "--step-time-file", str(knob))
    pause(args)  # no file yet
    knob.write_text("0.01")
    pause(args)
    knob.write_text("0")
    pause(args)  # no wait at all
    knob.write_text("")  # half written, as a reader could see it: the flag's
    pause(args)
    pause(parsed())  # neither: no wait
    assert slept == [0.05, 0.01, 0.05]
