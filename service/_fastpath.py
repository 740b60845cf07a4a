"""Heartbeats answered before routing.

A thousand members beating once a second each is the coordinator's heaviest load, and
FastAPI's routing and dependency solving cost more than the beat itself (two thirds of
the process's CPU in a profile at 1,024 beats/s). This middleware answers a well-formed,
authorized heartbeat with the route's own parts: its path pattern (the route's
``matches``), its auth (:func:`~.deps.authorize`), its body
(:func:`~.routers.jobs.answer_heartbeat`) and its error replies
(:func:`~._http.service_error_response`).
Anything else (bad ids or JSON, no token, chunked bodies) goes to the application
unchanged, so errors keep their usual codes and bodies; ``tests/service/test_fastpath.py`` sends
the same beats with and without it and gets the same answers.
"""

from __future__ import annotations

import functools
from typing import Protocol, cast

from pydantic import ConfigDict, ValidationError, create_model
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rallypoint.client.models import (
    CREDENTIAL_HEADER,
    HeartbeatReply,
    HeartbeatRequest,
    RankProgress,
    check_id,
)

from ._http import service_error_response
from .deps import MAX_CREDENTIAL, authorize
from .errors import RallypointServiceError
from .routers.jobs import answer_heartbeat, heartbeat, router

__all__ = ["HeartbeatFastPath"]

_ROUTE = next(r for r in router.routes if getattr(r, "endpoint", None) is heartbeat)
# The beat as taken here: HeartbeatRequest's fields, strict, which pydantic's core checks
# without the model's own check of JSON kinds (that one builds a Python dict first: more
# than the parse itself at a thousand beats a second). What strict refuses and the model
# may take (a generation of 2.0) goes to the route, as any other body.
_Beat = create_model(  # type: ignore[call-overload]
    "_Beat",
    __config__=ConfigDict(extra="forbid", strict=True, frozen=True),
    **{name: (f.annotation, f) for name, f in HeartbeatRequest.model_fields.items()},
)


class _Fields(Protocol):
    generation: int | None
    wait: float
    progress: list[RankProgress] | None


@functools.lru_cache(maxsize=256)
def _body(reply: HeartbeatReply) -> bytes:
    # Without ``reason`` where there is none: the bytes every beat got before it existed.
    return reply.model_dump_json(exclude_none=True).encode()


class HeartbeatFastPath:
    """ASGI middleware; see the module docstring. Sits inside the metrics and the body
    limit, so beats are counted and timed, and bodies are bounded, as any request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        matched = (
            _ROUTE.matches(scope)
            if scope["type"] == "http" and scope["method"] == "POST"
            else (Match.NONE, {})
        )
        full = matched[0] == Match.FULL
        headers = Headers(scope=scope) if full else Headers()
        if (
            not full
            or "content-length" not in headers  # BodyLimit checked the length
            or not headers.get("content-type", "").startswith("application/json")
        ):
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        messages: list[Message] = []
        body = b""
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            params = matched[1]["path_params"]
            job_id, node_id = check_id(params["job_id"]), check_id(params["node_id"])
            await authorize(state.tokens, headers, "POST", scope["path"], job_id)
            beat = cast(_Fields, _Beat.model_validate_json(body))
            credential = headers.get(CREDENTIAL_HEADER)
            if not credential or len(credential) > MAX_CREDENTIAL:
                raise ValueError("no credential, or too long")
        except (ValueError, ValidationError, RallypointServiceError):  # the route says why
            await self.app(scope, _replaying(messages, receive), send)
            return

        scope["route"] = _ROUTE  # the metrics' label, as routing would set it
        response: Response
        try:
            reply = await answer_heartbeat(
                job_id,
                node_id,
                beat.generation,
                beat.wait,
                credential,
                state,
                receive,
                beat.progress,
            )
            response = Response(_body(reply), media_type="application/json")
        except RallypointServiceError as exc:
            response = service_error_response("POST", scope["path"], exc)
        await response(scope, receive, send)


def _replaying(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
