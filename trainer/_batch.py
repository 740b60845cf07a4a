"""The global batch as the optimization's contract, at any world size.

A job's global batch is ``micro_batch x accumulation x world_size`` samples per optimizer
step. When the world changes (a node preempted, a node back), keeping the per-device batch
changes the global batch, and with it the steps per epoch, ``max_steps``'s meaning, the
learning-rate schedule's horizon and the loss curve. :func:`plan_batch` keeps the global
batch instead: it keeps the per-device batch and changes the accumulation steps where that
splits the global batch exactly, and otherwise takes the largest smaller per-device batch
that does (never a larger one: the per-device batch is what fits in device memory).

A world size splits the global batch when it divides it: each rank's share,
``global_batch // world_size``, is then a whole number of samples, and some per-device
batch (at worst 1) times a whole number of accumulation steps makes it. Any other world
size is refused with :class:`~rallypoint.trainer.errors.WorldSizeError`, which names the
sizes that work (:func:`world_sizes`): the data position and the schedule stay exact only
at those.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import WorldSizeError

__all__ = ["BatchPlan", "plan_batch", "world_sizes"]


@dataclass(frozen=True)
class BatchPlan:
    """How one world size makes the global batch.

    Attributes:
        global_batch: Samples per optimizer step, all ranks together.
        world_size: Data-parallel ranks.
        micro_batch: Samples per rank per forward/backward pass.
        accumulation: Forward/backward passes per optimizer step.
    """

    global_batch: int
    world_size: int
    micro_batch: int
    accumulation: int

    def describe(self) -> str:
        """One line for a log: ``global batch 24 = 3 ranks x 4 per device x 2 steps``."""
        return (
            f"global batch {self.global_batch} = {self.world_size} ranks x "
            f"{self.micro_batch} per device x {self.accumulation} accumulation steps"
        )


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def world_sizes(global_batch: int, *, low: int = 1, high: int | None = None) -> list[int]:
    """The world sizes in ``[low, high]`` that split ``global_batch`` exactly.

    Args:
        global_batch: Samples per optimizer step.
        low: The smallest world size of interest (a job's ``min_nodes`` x processes).
        high: The largest (``None``: ``global_batch``, the largest that can split it).

    Returns:
        The divisors of ``global_batch`` in the range, ascending.
    """
    _positive("global_batch", global_batch)
    top = global_batch if high is None else min(high, global_batch)
    return [w for w in range(max(1, low), top + 1) if global_batch % w == 0]


def plan_batch(global_batch: int, world_size: int, *, micro_batch: int) -> BatchPlan:
    """The per-device batch and accumulation steps that keep ``global_batch`` at
    ``world_size``.

    Keeps ``micro_batch`` when it divides this rank's share; otherwise takes the largest
    per-device batch below it that does, so accumulation grows instead of memory.

    Args:
        global_batch: Samples per optimizer step to keep.
        world_size: The data-parallel ranks of this generation.
        micro_batch: The largest per-device batch to use (what the job was configured
            with).

    Returns:
        The plan.

    Raises:
        ValueError: An argument is not an int >= 1.
        WorldSizeError: ``world_size`` does not divide ``global_batch``; the message
            names the world sizes that do.
    """
    _positive("global_batch", global_batch)
    _positive("world_size", world_size)
    _positive("micro_batch", micro_batch)
    if global_batch % world_size:
        sizes = world_sizes(global_batch)
        raise WorldSizeError(
            f"a world of {world_size} ranks cannot split the global batch of "
            f"{global_batch} samples; world sizes that can: {_listed(sizes)}",
            world_size=world_size,
            global_batch=global_batch,
            valid=sizes,
        )
    share = global_batch // world_size
    micro = next(m for m in range(min(micro_batch, share), 0, -1) if share % m == 0)
    return BatchPlan(global_batch, world_size, micro, share // micro)


def _listed(sizes: list[int], limit: int = 12) -> str:
    shown = ", ".join(map(str, sizes[:limit]))
    return shown + (f", ... ({len(sizes)} in all)" if len(sizes) > limit else "")
