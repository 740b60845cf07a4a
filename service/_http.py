"""HTTP plumbing: the error body every failure gets, and a body-size limit."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import fastapi.routing
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rallypoint.client import codes
from rallypoint.client.models import ENVELOPE_PATH

from .errors import RallypointServiceError

__all__ = [
    "MAX_BODY_BYTES",
    "BodyLimit",
    "allowed_methods",
    "body_limit",
    "effective_routes",
    "error_response",
    "install_handlers",
    "service_error_response",
]

log = logging.getLogger("rallypoint.http")

#: No request of the API carries more; a larger body is refused before it is parsed.
MAX_BODY_BYTES = 64 * 1024
#: Shard reports carry a rank's checkpoint metadata (its non-tensor state), a hung
#: rank's stacks report up to :data:`~rallypoint.client.models.MAX_STACKS_BYTES`
#: characters of them.
MAX_REPORT_BYTES = 1024 * 1024
# A hung rank's stacks, PUT by its node's agent.
_STACKS = re.compile(r"/generations/[^/]+/nodes/[^/]+/stacks$")

# FastAPI's one 400 is a body it could not decode (not UTF-8): not JSON either.
_HTTP_CODES = {
    400: codes.MALFORMED_JSON,
    401: codes.UNAUTHORIZED,
    404: codes.NOT_FOUND,
    405: codes.METHOD_NOT_ALLOWED,
    413: codes.BODY_TOO_LARGE,
}

_MALFORMED = "the request body is not valid JSON"


def error_response(
    status: int,
    code: str,
    message: str,
    detail: Any = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """The ``{"code", "message"[, "detail"]}`` reply every error gets (``code`` from
    :data:`rallypoint.client.codes.CODES`)."""
    body: dict[str, Any] = {"code": code, "message": message}
    if detail is not None:
        body["detail"] = detail
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    if code == codes.STORAGE_UNAVAILABLE:
        # While storage is down, a replica lets one storage call through a second (see
        # storage/_budget.py): a retry sooner learns nothing, one much later waits for
        # nothing once storage is back.
        headers = {**(headers or {}), "Retry-After": "1"}
    return JSONResponse(body, status_code=status, headers=headers)


def service_error_response(method: str, path: str, exc: RallypointServiceError) -> JSONResponse:
    """The reply to a domain error, wherever it is raised (routes, the heartbeat fast
    path); a 5xx is logged, unless its kind is not (``logged``)."""
    if exc.status >= 500 and exc.logged:
        log.warning("%s %s: %s", method, path, exc.message)
    return error_response(exc.status, exc.code, exc.message)


def body_limit(path: str, limit: int = MAX_BODY_BYTES, report_limit: int = MAX_REPORT_BYTES) -> int:
    """The most bytes a request body to ``path`` may have (a request's path or a route's
    template): ``report_limit`` for shard reports, stacks and store operations, which
    carry many files, values or lines, and the envelope, which may carry any of them
    (the operation inside meets its own limit); ``limit`` for every other route."""
    large = path.endswith("/shards") or "/store/" in path or path == ENVELOPE_PATH
    return report_limit if large or _STACKS.search(path) else limit


def effective_routes(app: FastAPI) -> Iterator[Any]:
    """Every route of ``app`` as it serves requests: full path (``path_format``,
    ``path_regex``), ``methods``, and for API routes ``dependant``, ``responses``...

    FastAPI from 0.13x keeps included routers whole (``app.routes`` holds them, not
    their routes); its ``iter_route_contexts`` flattens them as its OpenAPI does.
    """
    flatten: Callable[[Any], Iterator[Any]] | None = getattr(
        fastapi.routing, "iter_route_contexts", None
    )
    return flatten(app.routes) if flatten is not None else iter(app.routes)


def allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """The methods the routes of ``app`` take at the request's path.

    Starlette's 405 names only the first route matching the path, where FastAPI makes
    one route per method (GET and PUT of a job are two): this asks them all.
    """
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    methods: set[str] = set()
    for route in effective_routes(app):
        regex = getattr(route, "path_regex", None)
        if regex is not None and regex.match(path):
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


def install_handlers(app: FastAPI) -> None:
    """Makes every error a JSON ``{"code", "message"}`` body with the right status."""

    @app.exception_handler(RallypointServiceError)
    async def domain_error(request: Request, exc: RallypointServiceError) -> JSONResponse:
        return service_error_response(request.method, request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return error_response(400, codes.MALFORMED_JSON, _MALFORMED)
        detail = [
            {"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", ""))}
            for e in errors
        ]
        first = detail[0] if detail else {"loc": [], "msg": "invalid"}
        where = ".".join(first["loc"][1:] if len(first["loc"]) > 1 else first["loc"])
        return error_response(422, codes.INVALID_REQUEST, f"{where}: {first['msg']}", detail)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        status = exc.status_code
        fallback = codes.BAD_REQUEST if status < 500 else codes.INTERNAL_ERROR
        code = _HTTP_CODES.get(status, fallback)
        if status == 405:
            allow = allowed_methods(request.app, request.scope)
            message = f"{request.method} is not allowed here; this path takes {', '.join(allow)}"
            return error_response(405, code, message, headers={"Allow": ", ".join(allow)})
        message = _MALFORMED if code == codes.MALFORMED_JSON else str(exc.detail)
        return error_response(status, code, message, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, codes.INTERNAL_ERROR, "the coordinator failed; see its log")


class BodyLimit:
    """Refuses bodies over their route's :func:`body_limit` with 413, whether announced
    or streamed."""

    def __init__(
        self, app: ASGIApp, limit: int = MAX_BODY_BYTES, report_limit: int = MAX_REPORT_BYTES
    ) -> None:
        self.app = app
        self.limit = limit
        self.report_limit = report_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = body_limit(scope["path"], self.limit, self.report_limit)
        message = f"request bodies are limited to {limit} bytes"
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await self._refuse(send, message)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            received = await receive()
            seen += len(received.get("body", b""))
            if seen > limit:
                # Raised inside the app, so its handler answers with the usual body.
                raise HTTPException(413, message)
            return received

        await self.app(scope, counted, send)

    async def _refuse(self, send: Send, message: str) -> None:
        body = json.dumps({"code": codes.BODY_TOO_LARGE, "message": message}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
            }
        )
        await send({"type": "http.response.body", "body": body})
