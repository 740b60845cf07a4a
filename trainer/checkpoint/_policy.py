"""How a job saves: one typed, validated policy that :class:`CheckpointManager` and
every framework adapter take (``policy=SavePolicy(...)``), instead of the same keyword
list repeated in each of their signatures."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from rallypoint.client.models import KeepBest

__all__ = ["SavePolicy"]


@dataclass(frozen=True)
class SavePolicy:
    """When versions reach blob storage, and how a save treats training.

    Attributes:
        persist_every: Under a Rallypoint agent (its memory tier), every save lands in
            this node's memory and a peer node's; every Nth version also goes to blob
            storage (1, the default: all of them). The first version always does.
        persist_after: ... and the first version this long after the last one that
            did, whatever N says (a timedelta; seconds are taken and kept as one).
            None: no limit.
        if_busy: What ``save`` does while the previous save is in flight: ``"wait"``
            for it (the default; training pauses) or ``"skip"`` this save (on every
            rank alike: if any rank is still saving, all skip).
        overlap: ``save()`` returns once the copy of the state is scheduled; the copy
            runs while training goes on and a fence waits for it (see
            :meth:`CheckpointManager.wait_staged`). False copies before returning.
        progress: Show progress of transfers that take more than a second.
        attempts: Tries per upload or download before giving up.
        verify_replicated: Check before every save that each plain (non-DTensor)
            tensor is the same on every rank; DCP writes it from one rank only.
        keep_best: Keep the job's best versions by a metric that saves carry
            (``save(metrics=...)``), whatever the retention of the newest: a
            :class:`~rallypoint.client.KeepBest`, or ``(metric, "min"|"max"[, count])``
            (kept as one). ``"best"`` then names the first of them wherever a version
            is named. None: no best is kept.
        keep_last: How many of the job's newest good versions the coordinator keeps
            (an HF Trainer's ``save_total_limit``); None: the coordinator's setting
            (``RALLYPOINT_CHECKPOINT_KEEP``). The latest and the best stay anyway.

    Raises:
        ValueError: A field is out of range (at construction).
    """

    persist_every: int = 1
    persist_after: timedelta | float | None = None
    if_busy: Literal["wait", "skip"] = "wait"
    overlap: bool = True
    progress: bool = True
    attempts: int = 3
    verify_replicated: bool = False
    keep_best: KeepBest | tuple[Any, ...] | None = None
    keep_last: int | None = None

    def __post_init__(self) -> None:
        keep: Any = self.keep_best
        if keep is not None and not isinstance(keep, KeepBest):
            if not isinstance(keep, tuple) or not 1 <= len(keep) <= 3:
                raise ValueError(
                    f"keep_best must be a KeepBest or (metric, mode[, count]), not {keep!r}"
                )
            fields = dict(zip(("metric", "mode", "count"), keep, strict=False))
            try:
                keep = KeepBest.model_validate(fields)
            except ValueError as exc:  # pydantic's, which says which field
                raise ValueError(f"keep_best {keep!r}: {exc}") from None
            object.__setattr__(self, "keep_best", keep)  # frozen: kept as a KeepBest
        after: Any = self.persist_after
        if after is not None and not isinstance(after, timedelta):
            if isinstance(after, bool) or not isinstance(after, (int, float)):
                raise ValueError(f"persist_after must be a timedelta or seconds, not {after!r}")
            after = timedelta(seconds=after)
            object.__setattr__(self, "persist_after", after)  # frozen: kept as a timedelta
        if after is not None and after <= timedelta(0):
            raise ValueError("persist_after must be a positive duration")
        if self.if_busy not in ("wait", "skip"):
            raise ValueError(f"if_busy must be 'wait' or 'skip', not {self.if_busy!r}")
        if isinstance(self.attempts, bool) or self.attempts < 1:
            raise ValueError("attempts must be at least 1")
        if self.keep_last is not None and (
            isinstance(self.keep_last, bool) or not 1 <= self.keep_last <= 1000
        ):
            raise ValueError(f"keep_last must be 1 to 1000 (or None), not {self.keep_last!r}")
        if isinstance(self.persist_every, bool) or self.persist_every < 1:
            raise ValueError("persist_every must be at least 1 (1: every version)")

    @property
    def persist_after_s(self) -> float | None:
        """:attr:`persist_after` in seconds."""
        after = self.persist_after
        if after is None:
            return None
        return after.total_seconds() if isinstance(after, timedelta) else float(after)

    @property
    def best(self) -> KeepBest | None:
        """:attr:`keep_best` as a :class:`~rallypoint.client.KeepBest`."""
        keep = self.keep_best
        assert keep is None or isinstance(keep, KeepBest)  # made one at construction
        return keep

    def replace(self, **changes: Any) -> SavePolicy:
        """A copy with ``changes`` (checked like a new one)."""
        return dataclasses.replace(self, **changes)
