"""How a moment reads wherever people read one (the CLI, the status page, the timeline):
UTC to the second, whatever the machine's time zone, and ``-`` for one not yet come; a
span of time in its largest two units, without spaces; and the marks on a version built
from them, one text for the CLI's listing and the page."""

from __future__ import annotations

import time

import pytest

from rallypoint.client.models import CheckpointInfo
from rallypoint.times import span, utc

# 2026-11-28 03:29:19.5 UTC
MOMENT = 1795836559.5


def test_a_moment_reads_in_utc_whatever_the_local_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    try:
        assert utc(MOMENT) == "2026-11-28 03:29:19 UTC"
        assert utc(MOMENT, zone=False) == "2026-11-28 03:29:19"
        assert utc(MOMENT, "%H:%M:%S", zone=False) == "03:29:19"
        assert utc(None) == utc(None, zone=False) == "-"
    finally:
        monkeypatch.undo()
        time.tzset()


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0.0s"),
        (4.25, "4.2s"),
        (599.94, "599.9s"),
        (600, "10m00s"),
        (3599, "59m59s"),
        (35999, "599m59s"),
        (36000, "10h00m"),
        (90061, "25h01m"),
    ],
)
def test_a_span_reads_in_its_largest_two_units(seconds: float, text: str) -> None:
    assert span(seconds) == text


def test_a_versions_marks_say_when_and_why() -> None:
    plain = CheckpointInfo(
        version=3, step=30, generation=1, world_size=2, state="committed", created_at=MOMENT
    )
    assert plain.marks() == []
    marked = plain.model_copy(
        update={
            "quarantined": True,
            "quarantined_at": MOMENT,
            "quarantine_reason": "loss spike",
            "unrecoverable": True,
            "unrecoverable_at": MOMENT + 60,
            "unrecoverable_reason": "rank 1: no copy of 1.distcp",
        }
    )
    assert marked.marks() == [
        "quarantined 2026-11-28 03:29:19 UTC: loss spike",
        "unrecoverable since 2026-11-28 03:30:19 UTC: rank 1: no copy of 1.distcp",
    ]
    # Quarantined without a reason: nothing after the moment.
    unexplained = plain.model_copy(update={"quarantined": True, "quarantined_at": MOMENT})
    assert unexplained.marks() == ["quarantined 2026-11-28 03:29:19 UTC"]
