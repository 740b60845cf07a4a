"""Which park starts a node's workers at once: the rule as a pure function of what the
job says (no coordinator, no clock). A hot join's park must (its generation ends for it
only once they wait); a standby's, beside a full generation, only with ``hot_standby``."""

from __future__ import annotations

from typing import Literal

import pytest

from rallypoint.client import JobSpec
from rallypoint.client.models import JobSummary
from rallypoint.trainer.agent._rendezvous import _beside_a_full_generation


def job(world: int, status: Literal["open", "sealed"] = "sealed") -> JobSummary:
    return JobSummary(
        job_id="j",
        spec=JobSpec(min_nodes=2, max_nodes=4),
        generation=3,
        status=status,
        world_size=world,
        created_at=0.0,
    )


@pytest.mark.parametrize(("world", "standby"), [(2, False), (3, False), (4, True)])
def test_a_park_beside_a_running_generation_is_a_standbys_only_when_it_is_full(
    world: int, standby: bool
) -> None:
    assert _beside_a_full_generation(job(world)) is standby


def test_a_park_while_a_round_forms_is_no_standbys() -> None:
    # The generation ended since the join: the node goes into the round that forms.
    assert _beside_a_full_generation(job(4, status="open")) is False
