"""Moments as people read them: in UTC, to the second, the same in the CLI, the status
pages and the timeline.

It lives at the root of the package, which the CLI and the service both import, rather
than in either side's private modules.
"""

from __future__ import annotations

from datetime import datetime, timezone

__all__ = ["utc"]


def utc(epoch: float | None, fmt: str = "%Y-%m-%d %H:%M:%S", *, zone: bool = True) -> str:
    """A moment in UTC.

    Args:
        epoch: Seconds since 1970-01-01 UTC; None for one that has not come.
        fmt: A ``strftime`` format.
        zone: Whether `` UTC`` follows (tables that say it in their header need not).

    Returns:
        ``epoch`` by ``fmt``, or ``-`` for None.

    Example::

        >>> utc(0)
        '1970-01-01 00:00:00 UTC'
    """
    if epoch is None:
        return "-"
    text = datetime.fromtimestamp(epoch, timezone.utc).strftime(fmt)
    return f"{text} UTC" if zone else text
