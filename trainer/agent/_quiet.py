"""How a worker ends when its generation ended under it: one line, not a traceback.

When a node dies, the collectives of the survivors' workers fail at once (gloo's
``Connection reset by peer``, NCCL's ``DistBackendError``), usually before their agents
have heard from the coordinator that the generation ended. That failure is how every
generation ends that loses a node, and its traceback (through torchrun's
``ProcessRaisedException`` under ``rallypoint run``) was the first thing a new user saw
after a node loss: harmless, and alarming. So a worker of the rallypoint agent that fails
while its generation ends waits, without a word, for its agent to stop it, as the agent
stops its workers for any membership change (which counts against no
``--max-restarts``), and the agent says one line for the node. Any other error keeps its
traceback.

The rules, as pure functions of what the board says (:func:`ended`) and of the error
(:func:`waits_for_board`):

- The generation ended when the board (:mod:`._board`, which the agent writes as soon as
  its heartbeat says so) names this worker's generation ended, or a later one.
- An error that a lost peer causes (a ``RuntimeError``, which torch.distributed's errors
  are, gloo's included; a ``ConnectionError``; a ``TimeoutError``) waits up to
  ``RALLYPOINT_QUIET_WAIT`` seconds (5 by default: above the heartbeat's reconnect window
  and timeout) for the board to say so: the collective fails first. Any other error is
  asked once and not waited for, so a bug in the training script shows at once.
- ``RALLYPOINT_QUIET=0`` turns it off: every error keeps its traceback.

One error is told to the coordinator as it goes, quiet or not: a ``WorldSizeError`` (a
world that cannot split the job's global batch) that nothing caught and reported
(:func:`report_uncaught`), so that the coordinator seals only the sizes that can.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import NoReturn

from rallypoint.client import GENERATION_ENV

from .._worlds import report_world_sizes
from ..errors import WorldSizeError
from ._board import REGROUP_ENV, Board, Posted

__all__ = [
    "QUIET_ENV",
    "QUIET_WAIT_ENV",
    "ended",
    "generation_end",
    "install_excepthook",
    "report_uncaught",
    "stop_quietly",
    "waits_for_board",
]

#: ``0`` keeps every traceback.
QUIET_ENV = "RALLYPOINT_QUIET"
#: Seconds a communication error waits for the board to say the generation ended.
QUIET_WAIT_ENV = "RALLYPOINT_QUIET_WAIT"
_DEFAULT_WAIT = 5.0
#: How long a worker whose generation ended waits for its agent to stop it before it
#: exits by itself (the agent stops it within its monitor interval when all is well).
_HOLD = 30.0


def ended(posted: Posted | None, generation: int) -> str | None:
    """Why ``generation`` ended, if the board says it did; None if not (yet).

    Args:
        posted: What the board says.
        generation: The worker's generation.
    """
    if posted is None or posted.generation < generation:
        return None
    if posted.generation > generation:
        return posted.reason or f"generation {posted.generation} followed"
    return (posted.reason or "ended") if posted.ended else None


def waits_for_board(exc: BaseException) -> bool:
    """Whether ``exc`` may be how a lost peer shows (see the module's docstring)."""
    return isinstance(exc, (RuntimeError, ConnectionError, TimeoutError))


def generation_end(
    exc: BaseException,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str | None:
    """Why this worker's generation ended, if ``exc`` came of its end; None for an error
    that keeps its traceback (and outside the rallypoint agent, or with ``RALLYPOINT_QUIET=0``).

    Args:
        exc: The error the training script raised.
        clock: Seconds, for the wait.
        sleep: Waits between two reads of the board.
    """
    folder = os.environ.get(REGROUP_ENV)
    generation = os.environ.get(GENERATION_ENV)
    if (
        not folder
        or not generation
        or os.environ.get(QUIET_ENV, "1") == "0"
        or not isinstance(exc, Exception)
        or not Path(folder).is_dir()
    ):
        return None
    try:
        number = int(generation)
        wait = float(os.environ.get(QUIET_WAIT_ENV, _DEFAULT_WAIT))
    except ValueError:
        return None
    board = Board(Path(folder))
    deadline = clock() + (wait if waits_for_board(exc) else 0.0)
    while True:
        reason = ended(board.read(), number)
        if reason is not None or clock() >= deadline:
            return reason
        sleep(0.02)


def report_uncaught(exc: BaseException) -> None:
    """Reports an uncaught ``WorldSizeError`` of a worker under the rallypoint agent to
    the coordinator (:func:`~rallypoint.trainer.report_world_sizes`), unless it was
    already: the generation ends, and the next one seals a size the job takes."""
    if isinstance(exc, WorldSizeError) and os.environ.get(REGROUP_ENV):
        report_world_sizes(exc)


def stop_quietly(reason: str) -> NoReturn:
    """Waits, without a word, for the agent to stop this worker: the agent says the one
    line (``generation N ended: REASON; restarting workers``) for all of its workers.

    Args:
        reason: Why the generation ended (for a worker that ends by itself).
    """
    # The agent stops its workers (SIGTERM) to start the next generation's. Should it
    # not (it is gone too), the worker ends by itself: as failed, with one line.
    time.sleep(_HOLD)
    generation = os.environ.get(GENERATION_ENV, "?")
    print(f"rallypoint: generation {generation} ended: {reason}", file=sys.stderr, flush=True)
    os._exit(1)


_installed = threading.Lock()
_previous: list[Callable[[type[BaseException], BaseException, TracebackType | None], object]] = []


def install_excepthook() -> None:
    """Makes this worker's uncaught errors quiet when its generation ended (see the
    module's docstring): a worker that torchrun started as a script, under the rallypoint
    agent. Idempotent; nothing outside the agent."""
    if not os.environ.get(REGROUP_ENV):
        return
    with _installed:
        if _previous:
            return
        _previous.append(sys.excepthook)
        sys.excepthook = _excepthook


def _excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    report_uncaught(exc)
    reason = generation_end(exc)
    if reason is None:
        _previous[0](kind, exc, tb)
        return
    stop_quietly(reason)
