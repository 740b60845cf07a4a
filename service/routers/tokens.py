"""Job-scoped tokens, for the operator (``/v1/tokens``, admin token only)."""

from __future__ import annotations

from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Path, Query, Request

from rallypoint.client import ID_SCHEMA_PATTERN, TokenCreated, TokenInfo, TokenRequest

from .._contract import errors
from .._tokens import Tokens
from ..deps import AdminOnly, Auth
from ..errors import UnknownToken

__all__ = ["router"]

router = APIRouter(prefix="/v1/tokens", tags=["tokens"], dependencies=[Auth, AdminOnly])

TokenId = Annotated[str, Path(pattern=r"^[0-9a-f]{12}$")]


def _tokens(request: Request) -> Tokens:
    tokens: Tokens = request.app.state.tokens
    return tokens


@router.post("", status_code=201)
async def create_token(body: TokenRequest, request: Request) -> TokenCreated:
    """Makes a token for one job with a role: ``trainer`` joins and acts for its nodes,
    ``reader`` reads it. The reply's ``token`` is shown this once."""
    tokens = _tokens(request)
    info, token = await anyio.to_thread.run_sync(
        tokens.create, body.job_id, body.role, body.expires_in, body.name
    )
    return TokenCreated(**info.model_dump(), token=token)


@router.get("")
async def list_tokens(
    request: Request, job_id: Annotated[str | None, Query(pattern=ID_SCHEMA_PATTERN)] = None
) -> list[TokenInfo]:
    """Scoped tokens (of one job, with ``job_id``), revoked ones included; never the
    tokens themselves."""
    return await anyio.to_thread.run_sync(_tokens(request).list, job_id)


@router.delete("/{token_id}", responses=errors(UnknownToken))
async def revoke_token(token_id: TokenId, request: Request) -> TokenInfo:
    """Revokes a token; every coordinator replica refuses it within a second."""
    return await anyio.to_thread.run_sync(_tokens(request).revoke, token_id)
