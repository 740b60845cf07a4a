"""``GET /metrics``: Prometheus text format (the token guards it when one is set)."""

from __future__ import annotations

import anyio.to_thread
from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..deps import Auth

__all__ = ["router"]

router = APIRouter(tags=["metrics"], dependencies=[Auth])


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    """Requests, latency, heartbeats, checkpoint commits and bytes, restored bytes by
    source, and every job's generation, world size, members by state, waiting nodes and
    checkpoint versions by durability."""
    # Job gauges read storage: off the event loop, like every other storage call.
    body = await anyio.to_thread.run_sync(generate_latest, request.app.state.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
