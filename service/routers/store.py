"""The key-value store of a job's generations (``/v1/jobs/{job_id}/store/{generation}``).

torchrun's agents assign worker ranks and wait at the exit barrier through it (see
``rallypoint.trainer.CoordinatorStore``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import time

import anyio.to_thread
from fastapi import APIRouter, Request

from rallypoint.client.models import MAX_STORE_VALUE_BYTES, StoreReply, StoreRequest

from .._contract import errors
from ..deps import Auth, Credential, DriverDep, GenerationNumber, JobId, KeyValueDep, RdzvDep
from ..errors import (
    InvalidCredential,
    InvalidRequest,
    StaleGeneration,
    UnknownJob,
    UnknownNode,
)

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs/{job_id}/store", tags=["store"], dependencies=[Auth])

#: How often a waiting ``get`` or ``check`` reads storage again.
_POLL = 0.02


def _decode(text: str) -> bytes:
    try:
        value = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("store values must be base64") from None
    if len(value) > MAX_STORE_VALUE_BYTES:
        raise InvalidRequest(f"store values are limited to {MAX_STORE_VALUE_BYTES} bytes")
    return value


def _encode(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode()


@router.post(
    "/{generation}",
    responses=errors(InvalidRequest, UnknownJob, StaleGeneration, InvalidCredential),
)
async def store(
    job_id: JobId,
    generation: GenerationNumber,
    body: StoreRequest,
    rdzv: RdzvDep,
    kv: KeyValueDep,
    driver: DriverDep,
    request: Request,
    credential: Credential,
) -> StoreReply:
    """One operation on the generation's keys, for a member (``node_id`` and its
    credential); ``get`` and ``check`` wait up to ``wait`` seconds for every key to exist.

    Writes go only to the running generation: an ended one's keys are what its members
    left (readable by them), a future one's cannot be planted.
    """
    if body.node_id is None:
        raise InvalidCredential(
            "store requests act for a node: send node_id and its credential "
            "(X-Rallypoint-Credential)"
        )
    job = await anyio.to_thread.run_sync(rdzv.get_job, job_id)  # before any write
    reads = body.op in ("get", "check", "num_keys")
    try:
        await anyio.to_thread.run_sync(
            lambda: rdzv.member(job, body.node_id or "", generation, credential, ended=reads)
        )
    except UnknownNode:
        # Only the generation's members use its store: anyone else is refused as such.
        raise InvalidCredential(
            f"node {body.node_id!r} is not a member of generation {generation}: "
            "only its members use its store"
        ) from None
    keys = body.keys
    if body.op == "set":
        items = dict(zip(keys, map(_decode, body.values or []), strict=True))
        await anyio.to_thread.run_sync(kv.set, job_id, generation, items)
        return StoreReply()
    if body.op == "add":
        total = await anyio.to_thread.run_sync(
            kv.add, job_id, generation, keys[0], body.amount or 0
        )
        return StoreReply(count=total)
    if body.op == "compare_set":
        expected, desired = _decode(body.expected or ""), _decode(body.desired or "")
        value = await anyio.to_thread.run_sync(
            kv.compare_set, job_id, generation, keys[0], expected, desired
        )
        return StoreReply(value=_encode(value))
    if body.op == "delete":
        found = await anyio.to_thread.run_sync(kv.delete, job_id, generation, keys[0])
        return StoreReply(found=found)
    if body.op == "num_keys":
        return StoreReply(count=await anyio.to_thread.run_sync(kv.count, job_id, generation))
    # get and check: poll storage until every key exists or the wait is over.
    deadline = time.monotonic() + body.wait
    while True:
        values = await anyio.to_thread.run_sync(kv.get, job_id, generation, keys)
        done = all(v is not None for v in values)
        over = time.monotonic() >= deadline or driver.closing
        if done or over or await request.is_disconnected():
            if body.op == "check":
                return StoreReply(found=done)
            return StoreReply(values=[_encode(v) for v in values])
        await asyncio.sleep(_POLL)
