"""Request dependencies, as ``Annotated`` aliases the routers declare parameters with.

They are ``async def`` although none awaits: FastAPI runs a plain ``def`` dependency in
its thread pool, and six thread hops per heartbeat saturated a core at 1,000 beats/s.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from rallypoint.client._models import ID_JSON_SCHEMA, check_id

from ._checkpoints import Checkpoints
from ._contract import raises
from ._driver import Driver
from ._http import authorized
from ._rendezvous import Rendezvous
from ._store import KeyValue
from .errors import InvalidId, StorageUnavailable, Unauthorized
from .settings import Settings

__all__ = [
    "AdminOnly",
    "Auth",
    "CheckpointsDep",
    "DriverDep",
    "GenerationNumber",
    "JobId",
    "KeyValueDep",
    "NodeId",
    "RdzvDep",
    "SettingsDep",
]


@raises(StorageUnavailable)
async def _rdzv(request: Request) -> Rendezvous:
    rdzv: Rendezvous = request.app.state.rdzv
    return rdzv


@raises(StorageUnavailable)
async def _checkpoints(request: Request) -> Checkpoints:
    checkpoints: Checkpoints = request.app.state.checkpoints
    return checkpoints


@raises(StorageUnavailable)
async def _kv(request: Request) -> KeyValue:
    kv: KeyValue = request.app.state.kv
    return kv


@raises(StorageUnavailable)
async def _driver(request: Request) -> Driver:
    driver: Driver = request.app.state.driver
    return driver


async def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


@raises(Unauthorized)
async def _authorized(request: Request) -> None:
    if not authorized(request.app.state.settings.token, request.headers):
        raise Unauthorized("this coordinator needs 'Authorization: Bearer <token>'")


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


RdzvDep = Annotated[Rendezvous, Depends(_rdzv)]
CheckpointsDep = Annotated[Checkpoints, Depends(_checkpoints)]
KeyValueDep = Annotated[KeyValue, Depends(_kv)]
DriverDep = Annotated[Driver, Depends(_driver)]
SettingsDep = Annotated[Settings, Depends(_settings)]
JobId = Annotated[str, Depends(_job_id)]
NodeId = Annotated[str, Depends(_node_id)]
GenerationNumber = Annotated[int, Path(ge=1, le=9_999_999_999)]
#: Declared on the /v1 router: every route under it needs the token when one is set.
Auth = Depends(_authorized)
#: Declared on routes only the operator may call (the admin token).
AdminOnly = Depends(_authorized)
