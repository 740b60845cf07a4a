"""A race the storage contract tests run: writers released at once, one of them to win."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["one_winner"]


def one_winner(write: Callable[[int], object], loses: type[Exception], writers: int = 8) -> int:
    """Calls ``write(i)`` from ``writers`` threads released together by a barrier, and
    checks that exactly one succeeded, every other raising ``loses``; the winner's ``i``."""
    barrier = threading.Barrier(writers)

    def attempt(i: int) -> bool:
        barrier.wait()
        try:
            write(i)
            return True
        except loses:
            return False

    with ThreadPoolExecutor(writers) as pool:
        wins = list(pool.map(attempt, range(writers)))
    assert wins.count(True) == 1
    return wins.index(True)
