"""How long storage may take, and what this process last heard from it.

Two things keep a storage outage from turning into a stuck coordinator:

- **Deadlines.** :func:`within` sets, for the calls made inside it (in this thread, or in
  the worker threads that ``anyio.to_thread`` starts from it: they copy the context), the
  time by which they must be done. The Azure adapters clamp each try's connect and read
  timeouts to what is left and make no try once it is spent, so a frozen account costs a
  request its deadline, not the SDK's minutes of retries. A heartbeat's storage reads run
  within a third of the job's heartbeat timeout. Work that grows with the job (the
  driver's passes: every member's beat, every waiting node's row) limits each try to that
  instead (:func:`each_try_within`). Other calls have the adapters' per-try timeouts and
  retry budget.
- **A breaker.** :class:`Health` records every try's outcome. Once a try found storage
  unreachable, other calls fail at once with ``storage_unavailable`` (the caller retries:
  503) rather than each waiting out its own timeout, while one trial at a time, at most
  every ``probe_every`` seconds, finds out when storage is back.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar

__all__ = ["Health", "each_try_within", "remaining", "try_limit", "within"]

_DEADLINE: ContextVar[float | None] = ContextVar("rallypoint_storage_deadline", default=None)
_TRY: ContextVar[float | None] = ContextVar("rallypoint_storage_try_limit", default=None)


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Storage calls inside must be done in ``seconds`` (or by an enclosing deadline,
    whichever comes first)."""
    deadline = time.monotonic() + seconds
    outer = _DEADLINE.get()
    token = _DEADLINE.set(deadline if outer is None else min(outer, deadline))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def remaining() -> float | None:
    """Seconds left to the current deadline (negative once passed); None without one."""
    deadline = _DEADLINE.get()
    return None if deadline is None else deadline - time.monotonic()


@contextlib.contextmanager
def each_try_within(seconds: float) -> Iterator[None]:
    """Each try of the storage calls inside must be done in ``seconds``, however many
    calls there are: for work that grows with a job (a tick reads every waiting node's
    row, ten thousand of them) and must still notice a frozen account within
    ``seconds``, when its first try times out and the breaker fails the rest at once."""
    token = _TRY.set(seconds)
    try:
        yield
    finally:
        _TRY.reset(token)


def try_limit() -> float | None:
    """Seconds a try may take under :func:`each_try_within`; None outside it."""
    return _TRY.get()


class Health:
    """What this process last heard from storage (thread-safe).

    Args:
        probe_every: While storage is down, seconds between the tries let through.
        clock: Monotonic seconds; injectable for tests.
    """

    def __init__(
        self, probe_every: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.probe_every = probe_every
        self._clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._trial_at = -float("inf")

    def admit(self) -> bool:
        """Whether a try may go to storage now: always while it answers; while it does
        not, one try per ``probe_every``."""
        with self._lock:
            if self._down_since is None:
                return True
            now = self._clock()
            if now - self._trial_at < self.probe_every:
                return False
            self._trial_at = now
            return True

    def record(self, answered: bool) -> None:
        """A try's outcome: storage answered (whatever it said), or it did not."""
        with self._lock:
            if answered:
                self._down_since = None
            else:
                now = self._clock()
                self._trial_at = now
                if self._down_since is None:
                    self._down_since = now

    def down_for(self) -> float:
        """Seconds since storage stopped answering; 0 while it answers."""
        with self._lock:
            return 0.0 if self._down_since is None else self._clock() - self._down_since
