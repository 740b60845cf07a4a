"""Liveness and readiness: no token, for probes; both answer from memory at once.

Readiness means "this replica can serve": it has started, is not shutting down, and has
heard from storage within ``RALLYPOINT_STORAGE_GRACE`` (60 s). Storage is shared by every
replica, so an outage reaches all of them at once; were readiness to follow storage
itself, a blip would take every replica out of the load balancer, and nodes would lose
the heartbeats that the replicas can still answer from memory. Within the grace each
replica stays ready and says what storage does in the body; past it (storage down for
longer than the coordinator promises to ride out, or this replica alone cut off from
it) it reports 503 ``storage_unavailable``. A background task pings storage every
second (see :func:`probe`), so the answer is never older than that.
"""

from __future__ import annotations

import asyncio
import logging
import time

import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rallypoint.client import codes
from rallypoint.client.models import ErrorBody

from .._http import error_response
from ..errors import StorageError
from ..storage import Storage, within

__all__ = ["ping", "probe", "router"]

router = APIRouter(tags=["health"])
log = logging.getLogger("rallypoint.health")

#: Seconds between the background pings of storage, and the deadline of each.
PROBE_EVERY = 1.0


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=None,
    responses={
        503: {
            "model": ErrorBody,
            "description": "`storage_unavailable`: storage has not answered for the grace; "
            "`not_ready`: the replica is shutting down",
        }
    },
)
async def readyz(request: Request) -> dict[str, str | float] | JSONResponse:
    """This replica can serve (see the module docstring): answered from memory."""
    state = request.app.state
    storage: Storage | None = getattr(state, "storage", None)
    driver = getattr(state, "driver", None)
    if storage is None or driver is None or driver.closing:
        return error_response(503, codes.NOT_READY, "the coordinator is starting or shutting down")
    grace: float = state.settings.storage_grace
    down = storage.health.down_for()
    if down >= grace:
        return error_response(
            503,
            codes.STORAGE_UNAVAILABLE,
            f"storage has not answered for {down:.0f} s (grace {grace:.0f} s)",
        )
    return {
        "status": "ready",
        "storage": storage.describe(),
        "storage_state": "ok" if down == 0 else "unavailable",
        "storage_down_s": round(down, 1),
    }


def ping(storage: Storage) -> None:
    """Pings storage once, within :data:`PROBE_EVERY`, and records what that found in
    ``storage.health`` (blocking: run it in a worker thread).

    A failure is recorded only where storage was answering: the Azure adapters record
    each try themselves, and while storage is known down the breaker refuses all but one
    try a second. A refused ping is no try, and recording it as one moved the next trial
    a second on, at every ping: trials came every 2 s at best, and after a 30 s freeze of
    Azurite one replica found it again 10.4 s late.
    """
    try:
        with within(PROBE_EVERY):
            storage.ping()
    except StorageError as exc:
        if storage.health.down_for() == 0:
            log.warning("storage does not answer: %s", exc)
            storage.health.record(False)
        return
    storage.health.record(True)


async def probe(storage: Storage) -> None:
    """Pings storage every :data:`PROBE_EVERY` seconds (:func:`ping`) until cancelled."""
    while True:
        started = time.monotonic()
        await anyio.to_thread.run_sync(ping, storage)
        await asyncio.sleep(max(0.0, PROBE_EVERY - (time.monotonic() - started)))
