"""Which versions a job keeps, and which are its best: the rules, in one place.

A version may carry metrics (rank 0 reports them with its files: an evaluation's
``eval_loss``), the rule the job keeps its best versions by (:class:`KeepBest`: a
metric, ``min`` or ``max``, and how many) and how many of its newest good versions the
job keeps (``keep_last``; else the coordinator's setting). Each function here is a
function of the version rows one query returned, with no storage and no clock, so that
``_checkpoints.py`` asks the same question everywhere it needs the answer:

- collecting (:meth:`Checkpoints.collect`): the newest :func:`keep_last` good versions
  stay, and the best (:func:`best`) whatever their age;
- reading: ``GET …/checkpoints/best``, and every version's ``best_place`` in a list
  (:func:`places`);
- the rules: the newest committed version says them (:func:`rule`, :func:`keep_last`),
  so a job that changes them on a restart keeps by the new ones from its next version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

from rallypoint.client.models import KeepBest

__all__ = ["Version", "best", "keep_last", "places", "rule"]


class Version(Protocol):
    """What these rules read of a version's row (``_checkpoints.Version`` is one)."""

    @property
    def version(self) -> int: ...
    @property
    def state(self) -> str: ...
    @property
    def good(self) -> bool: ...
    @property
    def metrics(self) -> Mapping[str, float]: ...
    @property
    def keep_best(self) -> KeepBest | None: ...
    @property
    def keep_last(self) -> int | None: ...


V = TypeVar("V", bound=Version)


def _newest(versions: Sequence[V]) -> V | None:
    """The newest committed version (by number): the one whose rules hold."""
    return max(
        (v for v in versions if v.state == "committed"), key=lambda v: v.version, default=None
    )


def rule(versions: Sequence[Version]) -> KeepBest | None:
    """The rule the newest committed version was saved under; None if it carries none
    (a job that stopped asking for a best keeps no best)."""
    newest = _newest(versions)
    return None if newest is None else newest.keep_best


def keep_last(versions: Sequence[Version], default: int) -> int:
    """How many of the newest good versions the job keeps: what its newest committed
    version was saved with (an HF Trainer's ``save_total_limit``), else ``default``
    (the coordinator's setting)."""
    newest = _newest(versions)
    if newest is None or newest.keep_last is None:
        return default
    return newest.keep_last


def best(versions: Sequence[V], keep: KeepBest | None = None) -> list[V]:
    """The job's best versions by ``keep`` (by default :func:`rule`), best first, at
    most ``keep.count``: good (committed, neither quarantined nor unrecoverable) versions
    that carry the metric. A tie goes to the older version: it reached the value first,
    as the frameworks' own "best checkpoint" records it."""
    keep = keep or rule(versions)
    if keep is None:
        return []
    sign = 1.0 if keep.mode == "min" else -1.0
    candidates = [v for v in versions if v.good and keep.metric in v.metrics]
    ordered = sorted(candidates, key=lambda v: (sign * v.metrics[keep.metric], v.version))
    return ordered[: keep.count]


def places(versions: Sequence[Version]) -> dict[int, int]:
    """Version number to its place among :func:`best` (1: the job's best)."""
    return {v.version: i for i, v in enumerate(best(versions), start=1)}
