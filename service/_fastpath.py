"""Heartbeats, joins and waits answered before routing.

A thousand members beating once a second each is the coordinator's heaviest load, and
ten thousand nodes joining in one round its longest burst. FastAPI's routing and
dependency solving cost more than the beat itself (two thirds of the process's CPU in a
profile at 1,024 beats/s), and a third of a 10,000-node round's. This middleware
answers a well-formed, authorized heartbeat, join or wait with the route's own parts:
its path pattern (the route's ``matches``), its auth (:func:`~.deps.authorize`), its
body (:func:`~.routers.jobs.answer_heartbeat`, :func:`~.routers.jobs.answer_join`,
:func:`~.routers.jobs.answer_wait`) and its error replies
(:func:`~._http.service_error_response`).
Anything else (bad ids or JSON, no token, chunked bodies) goes to the application
unchanged, so errors keep their usual codes and bodies; ``tests/service/test_fastpath.py``
sends the same requests with and without it and gets the same answers.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol, cast

from pydantic import ConfigDict, ValidationError, create_model
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rallypoint.client.models import (
    CREDENTIAL_HEADER,
    HeartbeatReply,
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    RankProgress,
    WaitRequest,
    check_id,
)

from ._http import service_error_response
from .deps import MAX_CREDENTIAL, authorize
from .errors import RallypointServiceError
from .routers.jobs import answer_heartbeat, answer_join, answer_wait, heartbeat, join, router, wait

__all__ = ["HeartbeatFastPath"]


def _route(endpoint: object) -> Any:
    return next(r for r in router.routes if getattr(r, "endpoint", None) is endpoint)


_BEAT, _JOIN, _WAIT = _route(heartbeat), _route(join), _route(wait)
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
        route, params = _matched(scope)
        headers = Headers(scope=scope) if route is not None else Headers()
        if (
            route is None
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
            job_id = check_id(params["job_id"])
            node_id = check_id(params["node_id"]) if "node_id" in params else ""
            await authorize(state.tokens, headers, "POST", scope["path"], job_id)
            credential = headers.get(CREDENTIAL_HEADER)
            if route is _JOIN:
                asked: Any = JoinRequest.model_validate_json(body)
            else:
                # The route's Credential: a wait's and a beat's own requests are refused
                # there with its words, not here.
                if not credential or len(credential) > MAX_CREDENTIAL or not credential.isascii():
                    raise ValueError("no credential, too long, or not ASCII")
                asked = (
                    WaitRequest.model_validate_json(body)
                    if route is _WAIT
                    else _Beat.model_validate_json(body)
                )
        except (ValueError, ValidationError, RallypointServiceError):  # the route says why
            await self.app(scope, _replaying(messages, receive), send)
            return

        scope["route"] = route  # the metrics' label, as routing would set it
        response: Response
        try:
            if route is _BEAT:
                beat = cast(_Fields, asked)
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
            else:
                status = Response()  # takes a waiting reply's 202, as the route's own
                if route is _JOIN:
                    answer = await answer_join(
                        job_id, asked, state.rdzv, state.driver, receive, status
                    )
                else:
                    assert credential is not None
                    answer = await answer_wait(
                        job_id,
                        node_id,
                        asked,
                        credential,
                        state.rdzv,
                        state.driver,
                        receive,
                        status,
                    )
                response = (
                    answer if isinstance(answer, Response) else _joined(answer, status.status_code)
                )
        except RallypointServiceError as exc:
            response = service_error_response("POST", scope["path"], exc)
        await response(scope, receive, send)


def _matched(scope: Scope) -> tuple[Any, dict[str, Any]]:
    """The fast path's route a request is for, and its path parameters; (None, {}) for
    any other."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return None, {}
    path: str = scope["path"]
    # Each pattern is tried only on the paths it may match (a cheap test of the end).
    for route, end in ((_BEAT, "/heartbeat"), (_JOIN, "/join"), (_WAIT, "/wait")):
        if path.endswith(end):
            match, child = route.matches(scope)
            if match == Match.FULL:
                return route, child["path_params"]
    return None, {}


def _joined(reply: JoinReply, status: int) -> Response:
    """A JoinReply as the route sends it (FastAPI dumps a response model to JSON)."""
    return Response(reply.model_dump_json(), status_code=status, media_type="application/json")


def _replaying(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
