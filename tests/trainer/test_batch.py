"""plan_batch: the global batch kept at every world size that can split it, as rules."""

from __future__ import annotations

import pytest

from rallypoint.trainer import BatchPlan, WorldSizeError, plan_batch, world_sizes

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("world", "micro", "plan"),
    [
        (3, 8, BatchPlan(24, 3, 8, 1)),  # the configured world: nothing changes
        (2, 8, BatchPlan(24, 2, 6, 2)),  # 12 a rank: 8 does not divide it, 6 x 2 does
        (4, 8, BatchPlan(24, 4, 6, 1)),
        (1, 8, BatchPlan(24, 1, 8, 3)),  # the micro batch kept, accumulation grows
        (6, 8, BatchPlan(24, 6, 4, 1)),
        (24, 8, BatchPlan(24, 24, 1, 1)),
        (2, 5, BatchPlan(24, 2, 4, 3)),  # never above the configured per-device batch
    ],
)
def test_the_global_batch_is_kept(world: int, micro: int, plan: BatchPlan) -> None:
    got = plan_batch(24, world, micro_batch=micro)
    assert got == plan
    assert got.micro_batch * got.accumulation * got.world_size == 24
    assert got.micro_batch <= micro


@pytest.mark.parametrize("world", [5, 7, 9, 25])
def test_a_world_that_cannot_split_it_is_refused_naming_those_that_can(world: int) -> None:
    with pytest.raises(WorldSizeError) as caught:
        plan_batch(24, world, micro_batch=8)
    assert caught.value.valid == [1, 2, 3, 4, 6, 8, 12, 24]
    assert caught.value.code == "world_size_unsupported"
    assert "1, 2, 3, 4, 6, 8, 12, 24" in str(caught.value)
    assert f"a world of {world} ranks" in str(caught.value)


def test_world_sizes_in_a_range() -> None:
    assert world_sizes(24, low=2, high=5) == [2, 3, 4]
    assert world_sizes(7) == [1, 7]
    assert world_sizes(12, low=13) == []


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "8"])
def test_arguments_are_checked(bad: object) -> None:
    with pytest.raises(ValueError, match="must be an int >= 1"):
        plan_batch(24, bad, micro_batch=8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be an int >= 1"):
        plan_batch(bad, 2, micro_batch=8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be an int >= 1"):
        plan_batch(24, 2, micro_batch=bad)  # type: ignore[arg-type]


def test_describe() -> None:
    assert plan_batch(24, 2, micro_batch=8).describe() == (
        "global batch 24 = 2 ranks x 6 per device x 2 accumulation steps"
    )
