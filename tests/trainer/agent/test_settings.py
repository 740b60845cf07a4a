"""The rendezvous settings torchrun's ``--rdzv-conf`` gives the backend: their defaults
as the docs' table states them (docs/TRAINING.md), read from torch's own parameters."""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from rallypoint.trainer.agent import RendezvousSettings


def settings(**conf: Any) -> RendezvousSettings:
    params = RendezvousParameters(
        backend="rallypoint",
        endpoint="127.0.0.1:8080",
        run_id="job",
        min_nodes=1,
        max_nodes=4,
        **conf,
    )
    return RendezvousSettings.from_parameters(params)


def test_a_join_is_hot_and_a_standby_cold_by_default() -> None:
    chosen = settings()
    assert chosen.hot_join is True
    assert chosen.hot_standby is False


@pytest.mark.parametrize(("value", "hot"), [("0", False), ("1", True), (0, False)])
def test_hot_join_is_the_nodes_own_setting(value: object, hot: bool) -> None:
    assert settings(hot_join=value).hot_join is hot


def test_a_hot_join_that_is_not_a_number_is_refused() -> None:
    with pytest.raises(ValueError, match="hot_join"):
        settings(hot_join="yes")


def test_world_sizes_are_node_counts_separated_by_slashes() -> None:
    """torch splits ``--rdzv-conf`` on commas, so the list takes ``/``."""
    assert settings().spec.world_sizes is None  # any from MIN to MAX
    assert settings(world_sizes="2/4").spec.world_sizes == (2, 4)
    with pytest.raises(ValueError, match="node counts separated by '/'"):
        settings(world_sizes="2;4")
    with pytest.raises(ValueError, match="ascending, each once"):
        settings(world_sizes="4/2")
    with pytest.raises(ValueError, match="from min_nodes 1 to max_nodes 4"):
        settings(world_sizes="2/8")
