"""Every ``/v1`` operation through one POST route, for gateways that route one path.

An AzureML managed online endpoint forwards only its scoring path to the container; the
client's ``transport="envelope"`` posts each operation here instead, and the coordinator
runs it through the whole application (auth, body limits, error bodies) as if it had been
called directly.
"""

from __future__ import annotations

import json
from urllib.parse import unquote

from fastapi import APIRouter, Request, Response
from starlette.types import Message

from rallypoint.client.models import ENVELOPE_PATH, Envelope

from ..deps import Auth

__all__ = ["router"]

router = APIRouter(tags=["envelope"], dependencies=[Auth])

# What an operation's scope inherits from the envelope's: the connection, not the route.
_INHERITED = ("type", "asgi", "http_version", "server", "client", "scheme", "root_path", "state")
# Request headers that describe the envelope's body, not the operation's.
_BODY_HEADERS = {b"content-length", b"content-type", b"transfer-encoding"}
# Reply headers passed back (the length is the envelope reply's own).
_KEPT_REPLY = {b"content-type", b"www-authenticate", b"retry-after"}


@router.post(
    ENVELOPE_PATH,
    # Any status and body: the operation's (its own errors too, as the error body).
    responses={
        200: {"description": "The operation's own reply, with its own status code"},
        "default": {"description": "The operation's own reply, with its own status code"},
    },
)
async def envelope(body: Envelope, request: Request) -> Response:
    """Runs the ``/v1`` operation the envelope names and returns its reply as is."""
    raw, _, query = body.path.partition("?")
    path = unquote(raw)
    content = b"" if body.body is None else json.dumps(body.body).encode()
    headers = [(k, v) for k, v in request.scope["headers"] if k not in _BODY_HEADERS]
    headers.append((b"content-length", str(len(content)).encode()))
    if content:
        headers.append((b"content-type", b"application/json"))
    scope = {k: request.scope[k] for k in _INHERITED if k in request.scope}
    scope.update(
        method=body.method,
        path=path,
        raw_path=raw.encode(),
        query_string=query.encode(),
        headers=headers,
    )
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": content, "more_body": False}
        # After the body, the envelope's own connection: a long-poll held inside still
        # sees its caller disconnect.
        return await request.receive()

    status = 500
    reply_headers: dict[str, str] = {}
    chunks: list[bytes] = []

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            for key, value in message.get("headers", []):
                if key.lower() in _KEPT_REPLY:
                    reply_headers[key.decode("latin-1")] = value.decode("latin-1")
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await request.app(scope, receive, send)
    return Response(b"".join(chunks), status_code=status, headers=reply_headers)
