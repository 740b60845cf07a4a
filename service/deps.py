"""Request dependencies, as ``Annotated`` aliases the routers declare parameters with.

They are ``async def`` although none awaits: FastAPI runs a plain ``def`` dependency in
its thread pool, and six thread hops per heartbeat saturated a core at 1,000 beats/s.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any

from fastapi import Depends, Header, Path, Request

from rallypoint.client.models import CREDENTIAL_HEADER, ENVELOPE_PATH, ID_JSON_SCHEMA, check_id

from . import _credentials as credentials
from ._checkpoints import Checkpoints
from ._contract import raises
from ._driver import Driver
from ._rendezvous import Rendezvous
from ._store import KeyValue
from ._tokens import Need, Principal, Tokens, presented
from ._views import Views
from .errors import Forbidden, InvalidCredential, InvalidId, StorageUnavailable, Unauthorized

__all__ = [
    "MAX_CREDENTIAL",
    "AdminOnly",
    "Auth",
    "CheckpointsDep",
    "Credential",
    "DriverDep",
    "GenerationNumber",
    "JobId",
    "KeyValueDep",
    "NodeId",
    "PrincipalDep",
    "RdzvDep",
    "ViewsDep",
    "authorize",
]


def _app_state(name: str) -> Callable[[Request], Awaitable[Any]]:
    """A dependency that answers the app's ``state.NAME``, a part the app factory made.

    Every route that takes such a part reads storage through it, so each documents the
    503 ``storage_unavailable`` once, here.
    """

    @raises(StorageUnavailable)
    async def part(request: Request) -> Any:
        return getattr(request.app.state, name)

    return part


# Routes without a job in their path that any valid token may call: the job list (it
# shows a scoped token its own job) and the envelope (its operation is checked as if
# called directly). Every other such route is the operator's.
_UNSCOPED = {("GET", "/v1/jobs"), ("POST", ENVELOPE_PATH)}


def _needs_admin(method: str, path: str) -> Forbidden:
    return Forbidden(f"{method} {path} needs the admin token")


async def authorize(
    tokens: Tokens, headers: Mapping[str, str], method: str, path: str, job_id: str | None
) -> Principal:
    """Who a request's token makes the caller, and whether that covers the route: a
    scoped token reads its own job (GET) and, as ``trainer``, acts in it; routes without
    a job are the operator's, but for the job list and the envelope. (The routes' auth
    dependency and the heartbeat fast path both ask this.)

    Raises:
        Unauthorized: No token, or not a valid one.
        Forbidden: The token does not cover the route.
    """
    principal = await tokens.principal(presented(headers))
    if principal is None:
        raise Unauthorized(
            "this coordinator needs 'Authorization: Bearer <token>' (a valid, unexpired, "
            "unrevoked one)"
        )
    if job_id is None:
        if (method, path) in _UNSCOPED or principal.may("admin", None):
            return principal
        raise _needs_admin(method, path)
    need: Need = "read" if method in ("GET", "HEAD") else "act"
    if not principal.may(need, job_id):
        raise Forbidden(
            f"a {principal.role} token for job {principal.job_id!r} may not "
            f"{'read' if need == 'read' else 'act in'} job {job_id!r}"
        )
    return principal


@raises(Unauthorized, Forbidden, StorageUnavailable)
async def _authorized(request: Request) -> Principal:
    principal = await authorize(
        request.app.state.tokens,
        request.headers,
        request.method,
        request.scope["path"],
        request.path_params.get("job_id"),
    )
    request.state.principal = principal
    return principal


@raises(Forbidden)
async def _admin(request: Request) -> None:
    principal: Principal | None = getattr(request.state, "principal", None)
    if principal is None or not principal.may("admin", None):
        raise _needs_admin(request.method, request.scope["path"])


async def _principal(request: Request) -> Principal:
    principal: Principal = request.state.principal
    return principal


def _checked(kind: str, value: str) -> str:
    try:
        return check_id(value)
    except ValueError as exc:
        raise InvalidId(f"{kind} id {exc}") from None


# The id pattern is in the schema, and checked here: a bad id is 400 invalid_id.
_IdPath = Annotated[str, Path(json_schema_extra=ID_JSON_SCHEMA)]


@raises(InvalidId)
async def _job_id(job_id: _IdPath) -> str:
    return _checked("job", job_id)


@raises(InvalidId)
async def _node_id(node_id: _IdPath) -> str:
    return _checked("node", node_id)


RdzvDep = Annotated[Rendezvous, Depends(_app_state("rdzv"))]
CheckpointsDep = Annotated[Checkpoints, Depends(_app_state("checkpoints"))]
KeyValueDep = Annotated[KeyValue, Depends(_app_state("kv"))]
DriverDep = Annotated[Driver, Depends(_app_state("driver"))]
ViewsDep = Annotated[Views, Depends(_app_state("views"))]
JobId = Annotated[str, Depends(_job_id)]
NodeId = Annotated[str, Depends(_node_id)]
GenerationNumber = Annotated[int, Path(ge=1, le=9_999_999_999)]
#: Longer than any credential the coordinator issues (43 characters).
MAX_CREDENTIAL = credentials.MAX_LENGTH


@raises(InvalidCredential)
async def _credential(
    credential: Annotated[
        str | None,
        Header(
            alias=CREDENTIAL_HEADER,
            # Documented, and checked below: a value that is no credential is refused as
            # one (403), not as a malformed request (422).
            json_schema_extra={"maxLength": MAX_CREDENTIAL},
            description="The node's credential, from its join",
        ),
    ] = None,
) -> str:
    # Refused before anything else is judged (a stale generation, say), so a caller
    # without a credential learns nothing about the job.
    if not credential:
        raise InvalidCredential(
            f"a request that acts for a node needs its credential ({CREDENTIAL_HEADER}, "
            "from its join)"
        )
    if len(credential) > MAX_CREDENTIAL or not credential.isascii():
        raise InvalidCredential(
            f"{CREDENTIAL_HEADER} is no credential this coordinator issues (they are "
            f"ASCII, at most {MAX_CREDENTIAL} characters)"
        )
    return credential


#: The node credential a request that acts for a node carries: present here; whether it
#: is the node's, the domain checks.
Credential = Annotated[str, Depends(_credential)]
#: Declared on the /v1 routers: every route needs a token (when the coordinator has one)
#: that covers its job; routes without a job need the admin token.
Auth = Depends(_authorized)
#: Declared on routes only the operator may call (the admin token), after :data:`Auth`.
AdminOnly = Depends(_admin)
#: The caller, as :data:`Auth` found it.
PrincipalDep = Annotated[Principal, Depends(_principal)]
