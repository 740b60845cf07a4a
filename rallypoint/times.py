"""Moments and spans of time as people read them: moments in UTC, to the second, spans
in the largest two units; the same in the CLI, the status pages and the timeline.

It lives at the root of the package, which the CLI and the service both import, rather
than in either side's private modules.
"""

from __future__ import annotations

from datetime import datetime, timezone

__all__ = ["span", "utc"]


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


def span(seconds: float) -> str:
    """A span of time, without spaces (it fits a table's column).

    Tenths of a second below 10 minutes, then minutes and seconds below 10 hours, then
    hours and minutes.

    Example::

        >>> [span(s) for s in (4.25, 303, 7500)]
        ['4.2s', '5m03s', '2h05m']
    """
    if seconds < 600:
        return f"{seconds:.1f}s"
    if seconds < 36000:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
