"""Liveness and readiness: no token, for probes."""

from __future__ import annotations

import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rallypoint.client._models import ErrorBody

from .._http import error_response
from ..errors import StorageError
from ..storage import Storage

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=None,
    responses={503: {"model": ErrorBody, "description": "Storage does not answer (its error)"}},
)
async def readyz(request: Request) -> dict[str, str] | JSONResponse:
    """Storage answers."""
    store: Storage = request.app.state.storage
    try:
        await anyio.to_thread.run_sync(store.ping)
    except StorageError as exc:
        return error_response(503, exc.code, exc.message)
    return {"status": "ready", "storage": store.describe()}
