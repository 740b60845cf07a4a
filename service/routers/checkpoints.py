"""Checkpoint versions of a job (``/v1/jobs/{job_id}/checkpoints``).

The coordinator hands out signed URLs and keeps the books; the bytes go straight
between trainers and storage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import anyio.to_thread
from fastapi import APIRouter, Body, Path

from rallypoint.client.models import (
    BeginCheckpoint,
    CheckpointBegun,
    CheckpointInfo,
    LoadFailure,
    PeerKey,
    QuarantineRequest,
    ReportShard,
    RestoreFailure,
    RestoreReport,
)

from .._contract import errors
from ..deps import AdminOnly, Auth, CheckpointsDep, Credential, DriverDep, JobId, ViewsDep
from ..errors import (
    CheckpointConflict,
    IncompleteUpload,
    InvalidRequest,
    StaleGeneration,
    UnknownCheckpoint,
    UnknownJob,
    UnknownNode,
)

__all__ = ["router"]

router = APIRouter(
    prefix="/v1/jobs/{job_id}/checkpoints", tags=["checkpoints"], dependencies=[Auth]
)

VersionNumber = Annotated[int, Path(ge=1, le=9_999_999_999)]

_F = TypeVar("_F", bound=Callable[..., Any])

# What a report of a member about one version can answer: it is fenced like every
# report of a member (its node, its generation) and names a version that must exist.
_MEMBER_REPORT_ERRORS = errors(
    UnknownJob, UnknownNode, UnknownCheckpoint, StaleGeneration, CheckpointConflict
)


@router.post(
    "",
    responses=errors(InvalidRequest, UnknownJob, UnknownNode, StaleGeneration, CheckpointConflict),
)
async def begin(
    job_id: JobId, body: BeginCheckpoint, checkpoints: CheckpointsDep, credential: Credential
) -> CheckpointBegun:
    """Begins (or finds) the version of ``step`` in the caller's generation, with write
    URLs for the caller's files. Every rank of a generation gets the same version."""
    return await anyio.to_thread.run_sync(checkpoints.begin, job_id, body, credential)


@router.post(
    "/{version}/shards",
    responses=errors(
        InvalidRequest,
        UnknownJob,
        UnknownNode,
        UnknownCheckpoint,
        StaleGeneration,
        CheckpointConflict,
        IncompleteUpload,
    ),
)
async def report(
    job_id: JobId,
    version: VersionNumber,
    body: ReportShard,
    checkpoints: CheckpointsDep,
    views: ViewsDep,
    credential: Credential,
) -> CheckpointInfo:
    """Reports the caller's uploaded files; the last rank's report commits the version,
    which becomes the latest if its generation still runs and its step is newer."""
    info = await anyio.to_thread.run_sync(checkpoints.report, job_id, version, body, credential)
    if info.state == "committed":
        views.touched(job_id)  # the job's status shows the pointer it may have moved
    return info


@router.post(
    "/{version}/restores",
    status_code=204,
    responses=_MEMBER_REPORT_ERRORS,
)
async def restored(
    job_id: JobId,
    version: VersionNumber,
    body: RestoreReport,
    checkpoints: CheckpointsDep,
    credential: Credential,
) -> None:
    """Counts what a rank's restore of the version read from this node's memory, a
    peer's and blob storage (``/metrics``); fenced like every report of a member."""
    await anyio.to_thread.run_sync(checkpoints.restored, job_id, version, body, credential)


@router.post(
    "/{version}/failures",
    responses=_MEMBER_REPORT_ERRORS,
)
async def unreadable(
    job_id: JobId,
    version: VersionNumber,
    body: RestoreFailure,
    checkpoints: CheckpointsDep,
    credential: Credential,
    driver: DriverDep,
) -> CheckpointInfo:
    """A rank of the running generation could not load the version from any copy: it
    is marked unrecoverable, with the reason, and never named again; the generation
    ends, and the next one resumes from the newest version still recoverable. Fenced
    like every report of a member."""
    return await driver.changed_by(
        job_id, lambda: checkpoints.unreadable(job_id, version, body, credential)
    )


@router.post(
    "/{version}/load-failures",
    responses=_MEMBER_REPORT_ERRORS,
)
async def load_failed(
    job_id: JobId,
    version: VersionNumber,
    body: RestoreFailure,
    checkpoints: CheckpointsDep,
    credential: Credential,
    driver: DriverDep,
) -> LoadFailure:
    """A rank of the running generation read the version it was named but could not
    load it (a ZeRO partition count that does not match, a model that does not fit, an
    error in the user's load code): the generation ends with the error's first line, and
    the version stays good. After two such generations in a row at one world size, a
    round of that size waits for a world of another size instead of failing a third
    time (``blocked`` in the job's status). Fenced like every report of a member, and
    only for the version its generation was named."""
    return await driver.changed_by(
        job_id, lambda: checkpoints.load_failed(job_id, version, body, credential)
    )


@router.get("", responses=errors(UnknownJob))
async def list_versions(job_id: JobId, checkpoints: CheckpointsDep) -> list[CheckpointInfo]:
    """Every version, committed or still being written, oldest first."""
    return await anyio.to_thread.run_sync(checkpoints.versions, job_id)


@router.get("/latest", responses=errors(UnknownJob, UnknownCheckpoint))
async def latest(job_id: JobId, checkpoints: CheckpointsDep) -> CheckpointInfo:
    """The authoritative latest version, with read URLs for its manifest and shards."""
    return await anyio.to_thread.run_sync(checkpoints.get, job_id, None)


@router.get("/best", responses=errors(UnknownJob, UnknownCheckpoint))
async def best(job_id: JobId, checkpoints: CheckpointsDep) -> CheckpointInfo:
    """The job's best version by the ``keep_best`` rule its newest version was saved
    under (``metric``, ``min`` or ``max``), with read URLs: 404 ``unknown_checkpoint``
    while it keeps none or no good version carries the metric."""
    return await anyio.to_thread.run_sync(checkpoints.best, job_id)


@router.get("/peer-key", responses=errors(UnknownJob))
async def peer_key(job_id: JobId, checkpoints: CheckpointsDep) -> PeerKey:
    """The public key nodes' replica servers check peer grants with."""
    key = await anyio.to_thread.run_sync(checkpoints.peer_key, job_id)
    return PeerKey(public_key=key)


@router.get("/{version}", responses=errors(UnknownJob, UnknownCheckpoint))
async def get_version(
    job_id: JobId, version: VersionNumber, checkpoints: CheckpointsDep
) -> CheckpointInfo:
    """One version; read URLs once it is committed."""
    return await anyio.to_thread.run_sync(checkpoints.get, job_id, version)


_QUARANTINE_ERRORS = errors(UnknownJob, UnknownCheckpoint, CheckpointConflict)


@router.put("/{version}/quarantine", dependencies=[AdminOnly], responses=_QUARANTINE_ERRORS)
async def quarantine(
    job_id: JobId,
    version: VersionNumber,
    checkpoints: CheckpointsDep,
    driver: DriverDep,
    body: Annotated[QuarantineRequest | None, Body()] = None,
) -> CheckpointInfo:
    """Marks a committed version bad (operator only): no generation resumes from it;
    if it was the latest (or the newest durable), that pointer moves back to the newest
    good version. The running generation goes on unless ``restart``. Idempotent."""
    request = body or QuarantineRequest()
    return await driver.changed_by(
        job_id,
        lambda: checkpoints.quarantine(job_id, version, request.reason, restart=request.restart),
    )


def _clears_mark(path: str) -> Callable[[_F], _F]:
    """The route of an operator's clearing a mark off a version (admin token only)."""
    return router.delete(
        path, dependencies=[AdminOnly], responses=errors(UnknownJob, UnknownCheckpoint)
    )


@_clears_mark("/{version}/quarantine")
async def unquarantine(
    job_id: JobId, version: VersionNumber, checkpoints: CheckpointsDep, driver: DriverDep
) -> CheckpointInfo:
    """Clears a version's quarantine (operator only); if it was saved by the job's
    latest generation and is newer than the latest, the pointer moves forward to it
    again. Idempotent."""
    return await driver.changed_by(job_id, lambda: checkpoints.unquarantine(job_id, version))


@_clears_mark("/{version}/unrecoverable")
async def recover(
    job_id: JobId, version: VersionNumber, checkpoints: CheckpointsDep, driver: DriverDep
) -> CheckpointInfo:
    """Clears a version's ``unrecoverable`` mark (operator only), once the copies a rank
    could not read are back or the cause was elsewhere: it may be named again, and the
    latest moves forward to it as for an unquarantine. Idempotent."""
    return await driver.changed_by(job_id, lambda: checkpoints.recover(job_id, version))
