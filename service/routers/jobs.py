"""Jobs, their membership, and the rendezvous itself (``/v1/jobs``)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Annotated, Literal

import anyio.to_thread
from fastapi import APIRouter, Body, Header, Request, Response
from fastapi.types import DecoratedCallable
from starlette.datastructures import State
from starlette.types import Receive

from rallypoint.client.models import (
    TIMELINE_GENERATIONS,
    Assignment,
    FaultReport,
    HangReport,
    HeartbeatReply,
    HeartbeatRequest,
    JobSpec,
    JobStatus,
    JobSummary,
    JoinReply,
    JoinRequest,
    LeaveRequest,
    MemberInfo,
    NodeInfo,
    NodeQuarantineRequest,
    QuarantinedNode,
    RankProgress,
    StacksReport,
    Timeline,
    WaitRequest,
    WorldSizeReport,
)

from .. import _credentials as credentials
from .. import _health as health
from .. import _seal as seal
from .. import _timeline
from .._checkpoints import Checkpoints
from .._contract import errors
from .._driver import Driver, hang_up, until_changed
from .._rendezvous import Generation, Job, Node, Rendezvous
from ..deps import (
    AdminOnly,
    Auth,
    CheckpointsDep,
    Credential,
    DriverDep,
    GenerationNumber,
    JobId,
    NodeId,
    PrincipalDep,
    RdzvDep,
    ViewsDep,
)
from ..errors import (
    BeatRefused,
    JobConflict,
    JobFull,
    JoinTimeout,
    NodeQuarantined,
    RallypointServiceError,
    StaleGeneration,
    StandbyReleased,
    UnknownJob,
    UnknownNode,
)
from ..storage import within

__all__ = [
    "answer_heartbeat",
    "answer_join",
    "answer_wait",
    "heartbeat",
    "join",
    "read_timeline",
    "router",
    "wait",
]

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Auth])


@router.get("")
async def list_jobs(rdzv: RdzvDep, principal: PrincipalDep) -> list[JobSummary]:
    """Every job this coordinator's storage knows (a scoped token's: its own)."""
    jobs = await anyio.to_thread.run_sync(rdzv.list_jobs)
    return [rdzv.summary(job) for job in jobs if principal.may("read", job.job_id)]


@router.put(
    "/{job_id}",
    status_code=201,
    responses={
        200: {"model": JobSummary, "description": "The job exists with this spec"},
        **errors(JobConflict),
    },
)
async def create_job(
    job_id: JobId, spec: JobSpec, rdzv: RdzvDep, views: ViewsDep, response: Response
) -> JobSummary:
    """Creates a job; repeating it with the same spec is harmless (200), another is 409."""
    job, created = await anyio.to_thread.run_sync(rdzv.create_job, job_id, spec)
    if created:
        views.touched(job_id)  # a status that found no job finds it now
    else:
        response.status_code = 200
    return rdzv.summary(job)


@router.get("/{job_id}", responses=errors(UnknownJob))
async def job_status(job_id: JobId, views: ViewsDep) -> JobStatus:
    """Members (rank, address, heartbeat age, state), waiting nodes, generation history.

    Answered from this replica's view of the job, read about once a second for all its
    viewers (``as_of``; ``age``: how old the view is). While storage does not answer,
    the last view, its ``age`` growing; 503 ``storage_unavailable`` where there is none.
    """
    return await views.status(job_id)


def read_timeline(rdzv: Rendezvous, checkpoints: Checkpoints, job_id: str) -> Timeline:
    """A job's timeline, as storage has it now (blocking: a few table reads; no member
    list is unpacked, nor a committed version's reports).

    Raises:
        UnknownJob: No job has this id.
    """
    job = rdzv.get_job(job_id)
    since = max(1, job.generation - TIMELINE_GENERATIONS + 1)
    return _timeline.timeline(
        rdzv.summary(job),
        rdzv.history(job_id, since),
        checkpoints.versions(job_id),
        checkpoints.collected(job_id),
        rdzv.clock(),
    )


@router.get("/{job_id}/timeline", responses=errors(UnknownJob))
async def timeline(job_id: JobId, rdzv: RdzvDep, checkpoints: CheckpointsDep) -> Timeline:
    """The job's history for a timeline: its last generations (world size, when each
    sealed and ended, and why, in one word as ``cause``), its checkpoint versions (kept,
    and the last collected ones) with their tiers and marks, and the pointers; ``now``
    is the coordinator's clock. The status page draws it; ``rallypoint jobs show JOB
    --timeline`` prints it."""
    return await anyio.to_thread.run_sync(read_timeline, rdzv, checkpoints, job_id)


def _awaits_seal(
    path: str, poll: str, *refusals: type[RallypointServiceError]
) -> Callable[[DecoratedCallable], DecoratedCallable]:
    """The route of a request that waits for its round to seal (a join, a wait): a
    JoinReply, sealed, or 202 still waiting (``poll`` says where to ask again), or one of
    the refusals of every round (and ``refusals``: the route's own, after UnknownJob)."""
    return router.post(
        path,
        response_model=JoinReply,
        responses={
            202: {"model": JoinReply, "description": f"still waiting: {poll}"},
            **errors(UnknownJob, *refusals, JobFull, NodeQuarantined, JoinTimeout, StandbyReleased),
        },
    )


@_awaits_seal("/{job_id}/join", "poll /wait", JobConflict)
async def join(
    job_id: JobId,
    body: JoinRequest,
    rdzv: RdzvDep,
    driver: DriverDep,
    request: Request,
    response: Response,
) -> JoinReply | Response:
    """Registers a node for the next generation and waits up to ``wait`` s for its seal.

    The reply carries the registration's ``credential``: the node's later requests
    (heartbeat, wait, leave, store, checkpoints) must send it.

    (Well-formed, authorized joins are answered by :class:`HeartbeatFastPath` before
    routing; this route answers the rest, with the same :func:`answer_join`.)
    """
    return await answer_join(job_id, body, rdzv, driver, request.receive, response)


async def answer_join(
    job_id: str,
    body: JoinRequest,
    rdzv: Rendezvous,
    driver: Driver,
    receive: Receive,
    response: Response,
) -> JoinReply | Response:
    """A join of a valid id and body, for the route and the fast path alike.

    Args:
        rdzv, driver: The app's (its state's ``rdzv`` and ``driver``).
        receive: The request's ASGI ``receive``, its body already read: its next
            message is the caller hanging up, which ends a held join.
        response: Takes the status of a reply still waiting (202).

    Returns:
        A sealed round's reply, made (its members' JSON is prebuilt), or a JoinReply to
        serialize.

    Raises:
        RallypointServiceError: As the route's (see :func:`_awaits_seal`).
    """
    try:
        # The driver's snapshot (at most a pass old) spares each of a thousand joins a
        # read of the job: the spec never changes, and a stale round only costs a retry.
        known, _ = await driver.snapshot(job_id)
    except UnknownJob:
        if body.spec is None:
            raise
        known = await driver.create(job_id, body.spec)
    node = await anyio.to_thread.run_sync(
        functools.partial(
            rdzv.register,
            job_id,
            body.node_id,
            body.addr,
            body.port,
            body.spec,
            body.join_id,
            body.peer,
            known=known,
            warm=body.warm,
        )
    )
    driver.poke(job_id)
    return await _await_seal(job_id, node, body.wait, rdzv, driver, receive, response, node.parked)


@_awaits_seal("/{job_id}/nodes/{node_id}/wait", "poll again", UnknownNode)
async def wait(
    job_id: JobId,
    node_id: NodeId,
    body: WaitRequest,
    rdzv: RdzvDep,
    driver: DriverDep,
    request: Request,
    response: Response,
    credential: Credential,
) -> JoinReply | Response:
    """Waits up to ``wait`` s more for the round a join registered for to seal.

    With ``ready``, a node parked by a hot join says its workers wait to train: the
    running generation ends for it first (its members regroup with the node at once).

    (Well-formed, authorized waits are answered by :class:`HeartbeatFastPath` before
    routing; this route answers the rest, with the same :func:`answer_wait`.)
    """
    return await answer_wait(
        job_id, node_id, body, credential, rdzv, driver, request.receive, response
    )


async def answer_wait(
    job_id: str,
    node_id: str,
    body: WaitRequest,
    credential: str,
    rdzv: Rendezvous,
    driver: Driver,
    receive: Receive,
    response: Response,
) -> JoinReply | Response:
    """A wait of valid ids, body and credential's form, for the route and the fast path
    alike (arguments and results as :func:`answer_join`'s).

    Raises:
        RallypointServiceError: As the route's (see :func:`_awaits_seal`).
    """
    node = await anyio.to_thread.run_sync(rdzv.node, job_id, node_id)
    credentials.check(node.cred, credential, node_id)
    if body.ready and await anyio.to_thread.run_sync(rdzv.ready, job_id, node_id, body.round):
        driver.poke(job_id)
    node = replace(node, round=body.round, credential=None)
    return await _await_seal(job_id, node, body.wait, rdzv, driver, receive, response)


def _sealed_reply(job_id: str, node: Node, sealed: Generation) -> Response:
    """The JoinReply of a sealed round, around the generation's prebuilt members JSON."""
    body = b'{"status":"sealed","round":%d,"assignment":%b%b}' % (
        sealed.generation,
        sealed.assignment_json(job_id, node.node_id),
        b',"credential":"%b"' % node.credential.encode() if node.credential else b"",
    )
    return Response(body, media_type="application/json")


async def _await_seal(
    job_id: str,
    node: Node,
    wait: float,
    rdzv: RdzvDep,
    driver: DriverDep,
    receive: Receive,
    response: Response,
    parked: bool = False,
) -> JoinReply | Response:
    node_id, round, credential = node.node_id, node.round, node.credential
    # A round follows the generation before it: a snapshot that has not seen that one
    # sealed missed a seal through another replica (a round's own seal wakes the wait).
    join_timeout = (await driver.snapshot(job_id, round - 1))[0].spec.join_timeout.total_seconds()
    deadline = time.monotonic() + wait
    # The held join is the node's watch until its first held heartbeat: a cut one (its
    # process died while it waited) keeps it out of the round, as a cut heartbeat ends
    # a generation, rather than sealing a dead node and finding it at the timeout.
    gone = hang_up(receive)
    try:
        with driver.waiting(job_id, node_id, beat=not node.beat):
            reply = await _wait_for_seal(
                job_id, node, join_timeout, deadline, rdzv, driver, response, gone, parked
            )
    finally:
        gone.cancel()
    if reply is None:
        # Out of the driver's waiters first: their beats would hide the cut.
        driver.dropped(job_id, node_id, generation=None)  # a held join
        response.status_code = 202
        return JoinReply(status="waiting", round=node.round, credential=credential)
    return reply


async def _wait_for_seal(
    job_id: str,
    node: Node,
    join_timeout: float,
    deadline: float,
    rdzv: Rendezvous,
    driver: Driver,
    response: Response,
    gone: asyncio.Future[None],
    parked: bool = False,
) -> JoinReply | Response | None:
    """The wait of :func:`_await_seal`; None once the caller hung up. A join that parked
    its node (``parked``) is answered ``standby`` at once: the node knows it stands by
    (a hot standby starts its workers), and its next wait is held."""
    node_id, round, credential = node.node_id, node.round, node.credential
    while True:
        job, changed = await driver.snapshot(job_id)
        # Before the seal, or with the generation cached, no storage is read: stay on
        # the event loop rather than hop to a thread for each of a thousand waiters.
        if job.generation < round or rdzv.cached(job_id, round) is not None:
            outcome = rdzv.outcome(job, node_id, round)
        else:
            outcome = await anyio.to_thread.run_sync(rdzv.outcome, job, node_id, round)
        if outcome == "missed":
            # Sealed without this node (it came too late): it wants the next one.
            node = await anyio.to_thread.run_sync(
                functools.partial(
                    rdzv.register,
                    job_id,
                    node_id,
                    node.addr,
                    node.port,
                    None,
                    node.join_id,
                    node.peer,
                    node.registration,  # the same join: the caller's credential holds
                    known=job,
                    warm=node.warm,  # as it joined: a hot join parks, and ends nothing
                )
            )
            round = node.round
            # Parked beside the generation (a standby, a node waiting for a world size):
            # answered at once, so that the node hears it stands by, with its credential.
            parked = parked or node.parked
            driver.poke(job_id)
            continue
        if outcome is not None:
            return _sealed_reply(job_id, node, outcome)
        if seal.released(job, round, node.joined_at):
            raise StandbyReleased(
                f"generation {job.generation} of job {job_id!r}, which node {node_id} "
                "parked beside as a standby, finished training"
            )
        # A standby waits as long as the generation it parks beside runs; once its
        # round opens, its join timeout counts from then (``changed_at``), like a
        # newcomer's from its join.
        standby = seal.parked(job, round)
        if not standby and rdzv.clock() - max(node.joined_at, job.changed_at) > join_timeout:
            # Not refused before storage is read: the round may have sealed through
            # another replica since this one's last pass.
            if (await driver.snapshot(job_id, round))[0].generation >= round:
                continue
            blocked = rdzv.blocked(job)
            raise JoinTimeout(
                f"round {round} of job {job_id!r} did not seal within {join_timeout:.0f} s"
                + (f"; {blocked}" if blocked else "")
            )
        left = deadline - time.monotonic()
        if gone.done():
            return None
        if left <= 0 or driver.closing or (standby and parked):
            response.status_code = 202
            return JoinReply(
                status="standby" if standby else "waiting", round=round, credential=credential
            )
        # The seal resolves ``changed`` and a hang-up ``gone``; the timeout only paces
        # the join-timeout checks.
        pace = max(1.0, job.spec.heartbeat_timeout.total_seconds() / 3)
        await until_changed(changed, min(left, pace), gone)


@router.post(
    "/{job_id}/nodes/{node_id}/heartbeat",
    responses=errors(UnknownJob, UnknownNode, StaleGeneration),
    response_model_exclude_none=True,  # as the fast path: no ``reason`` where none
)
async def heartbeat(
    job_id: JobId,
    node_id: NodeId,
    body: HeartbeatRequest,
    rdzv: RdzvDep,
    driver: DriverDep,
    request: Request,
    credential: Credential,
) -> HeartbeatReply:
    """A member's heartbeat; the reply says whether its generation still runs.

    With ``wait``, the reply is held while the generation runs and sent the moment it
    ends, so members restart within milliseconds of a change rather than at their next
    heartbeat. The beat itself counts when the request arrives.

    (Well-formed, authorized beats are answered by :class:`HeartbeatFastPath` before
    routing; this route answers the rest, with the same :func:`answer_heartbeat`.)
    """
    return await answer_heartbeat(
        job_id,
        node_id,
        body.generation,
        body.wait,
        credential,
        request.app.state,
        request.receive,
        body.progress,
    )


async def answer_heartbeat(
    job_id: str,
    node_id: str,
    generation: int | None,
    wait: float,
    credential: str | None,
    state: State,
    receive: Receive,
    progress: Sequence[RankProgress] | None = None,
) -> HeartbeatReply:
    """A heartbeat of valid ids and body, for the route and the fast path alike.

    Args:
        generation, wait, progress: The body's (see :class:`HeartbeatRequest`).
        credential: The node's credential, as the request carried it.
        state: The app's state (``rdzv``, ``driver``, ``metrics``).
        receive: The request's ASGI ``receive``, its body already read: its next
            message is the caller hanging up, which ends a held reply.

    Raises:
        RallypointServiceError: Unknown job or node, not the node's credential, storage
            failures.
    """
    rdzv: Rendezvous = state.rdzv
    driver: Driver = state.driver
    # The beat counts from now: what follows may wait on storage (a snapshot this
    # replica has yet to read, a generation's record), and the other replicas judge the
    # node's silence by the stamp, not by when this one got to it.
    arrived = rdzv.clock()
    # A generation newer than this replica's snapshot is read from storage first: a
    # member's first beat may follow the seal, made by another replica, by milliseconds.
    job, changed = await driver.snapshot(job_id, generation)
    failing = driver.failing(job_id)
    if failing is not None:
        # A beat this replica cannot write is not taken: the member's retry (the 503's
        # Retry-After) goes through the balancer to a replica that can. Replicas find
        # storage again at different times (docs/OPERATIONS.md#storage-outages), and one
        # that found it judges silence by what is in storage: a beat held here would be
        # invisible to it, and a live member declared dead.
        raise BeatRefused(f"storage does not answer this replica: {failing}")
    action = rdzv.judge_beat(job, node_id, generation)
    if generation is not None:
        await _check_member(rdzv, job, node_id, generation, credential)
    else:
        with within(job.spec.heartbeat_timeout.total_seconds() / 3):
            node = await anyio.to_thread.run_sync(rdzv.node, job_id, node_id)
        credentials.check(node.cred, credential, node_id)
    state.metrics.heartbeats.labels(job_id).inc()  # a beat of the node itself
    limit = rdzv.hang_limit(job_id)
    if action == "continue":
        driver.queue_beat(job_id, node_id, generation or 0, arrived, progress)
        if progress and health.overdue(job.spec, progress, limit):
            driver.urgent(job_id)  # written and judged now, not at the next pass
    elif seal.restarting(job, generation, arrived):
        # A member stopping its workers to join again: alive, so the round waits for it.
        assert generation is not None
        driver.queue_beat(job_id, node_id, generation, arrived)
    if generation is not None and wait > 0 and action == "continue" and not driver.closing:
        # Held until the job changes, the caller hangs up, or the hold ends.
        deadline = time.monotonic() + wait
        gone = hang_up(receive)
        cut = False
        try:
            while action == "continue" and not driver.closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                await until_changed(changed, left, gone)
                if gone.done():
                    # The member's process is gone (or will reconnect at once: see dropped).
                    driver.dropped(job_id, node_id, arrived, generation=generation)
                    cut = True
                    break
                job, changed = await driver.snapshot(job_id)
                action = rdzv.judge_beat(job, node_id, generation)
        finally:
            gone.cancel()
        if action == "continue" and not cut:
            driver.released(job_id, node_id, generation, arrived)  # until its next beat
    reason = rdzv.end_reason(job, generation) if action == "restart" else None
    hung = None
    if action == "restart" and job.last_hang is not None:
        ended, hung_node, rank = job.last_hang
        hung = (rank,) if (ended, hung_node) == (generation, node_id) else None
    # The limit only to a node that reports progress: any other gets the bytes it always
    # did (an older agent's parser reads them as before).
    shown = round(limit, 1) if progress is not None and limit is not None else None
    return _reply(action, job.generation, reason, shown, hung)


async def _check_member(
    rdzv: Rendezvous, job: Job, node_id: str, generation: int, credential: str | None
) -> None:
    """Checks that ``credential`` is ``node_id``'s in ``generation``, against the
    generation's record (cached: it never changes), so it costs a hash, not a storage
    read.

    Raises:
        RallypointServiceError: Not a member, not its credential, storage failures.
    """
    sealed = rdzv.cached(job.job_id, generation)
    if sealed is None:
        with within(job.spec.heartbeat_timeout.total_seconds() / 3):
            sealed = await anyio.to_thread.run_sync(rdzv.sealed, job.job_id, generation)
    sealed.check_credential(node_id, credential)


@functools.lru_cache(maxsize=256)
def _reply(
    action: Literal["continue", "restart"],
    generation: int,
    reason: str | None = None,
    hang_limit: float | None = None,
    hung: tuple[int, ...] | None = None,
) -> HeartbeatReply:
    # Every member gets one of a few replies every second: made once (they are frozen).
    return HeartbeatReply(
        action=action,
        generation=generation,
        reason=reason,
        hang_limit=hang_limit,
        hung=hung,
    )


@router.post(
    "/{job_id}/nodes/{node_id}/leave", responses=errors(UnknownJob, UnknownNode, StaleGeneration)
)
async def leave(
    job_id: JobId,
    node_id: NodeId,
    body: LeaveRequest,
    rdzv: RdzvDep,
    driver: DriverDep,
    credential: Credential,
) -> dict[str, str]:
    """Takes a node out at its own request (with its credential); if it was a member,
    its generation ends and the others restart."""
    try:
        await anyio.to_thread.run_sync(
            rdzv.leave, job_id, node_id, body.generation, body.reason, credential
        )
    except StaleGeneration:
        # Storage showed the generation over: this replica's heartbeats must not answer
        # "continue" from an older snapshot after saying so.
        await driver.refresh(job_id)
        raise
    await driver.refresh(job_id)
    return {"status": "left"}


@router.post(
    "/{job_id}/nodes/{node_id}/fault",
    status_code=202,
    responses=errors(UnknownJob, UnknownNode, StaleGeneration),
)
async def fault(
    job_id: JobId,
    node_id: NodeId,
    body: FaultReport,
    rdzv: RdzvDep,
    driver: DriverDep,
    request: Request,
    credential: Credential,
) -> dict[str, str]:
    """A member reports that a collective with its peers failed while its generation
    ran (with its credential). It ends nothing by itself; a member of the same
    generation whose heartbeat watch was cut at this replica counts as gone at once,
    without the reconnect window (see the operations guide). ``stale_generation`` once
    the generation is no longer the job's."""
    job, _ = await driver.snapshot(job_id, body.generation)
    await _check_member(rdzv, job, node_id, body.generation, credential)
    if seal.verdict(job, node_id, body.generation) != "continue":
        raise StaleGeneration(
            f"generation {body.generation} of job {job_id!r} is not running "
            f"(latest is {job.generation}, {job.status})"
        )
    request.app.state.metrics.faults.labels(job_id).inc()
    driver.fault(job_id, node_id, body.generation, body.detail)
    return {"status": "noted"}


@router.post(
    "/{job_id}/nodes/{node_id}/world-sizes",
    responses=errors(UnknownJob, UnknownNode, StaleGeneration),
)
async def world_sizes(
    job_id: JobId,
    node_id: NodeId,
    body: WorldSizeReport,
    rdzv: RdzvDep,
    driver: DriverDep,
    credential: Credential,
) -> JobSummary:
    """A member's worker found that its generation's world cannot train the job (its
    global batch does not split: ``WorldSizeError``) and names the world sizes, in
    nodes, that can (with its credential). The job keeps them (``world_sizes`` in its
    status) and the generation ends; from then on a round seals only a size the job
    takes, the largest its nodes make, and the nodes beyond it wait as standbys.
    Fenced like every report of a member: ``stale_generation`` once the generation is
    over (another rank reported first)."""
    job = await driver.changed_by(
        job_id, lambda: rdzv.learn_world_sizes(job_id, node_id, body, credential)
    )
    return rdzv.summary(job)


@router.delete(
    "/{job_id}/nodes/{node_id}",
    dependencies=[AdminOnly],
    responses=errors(UnknownJob, UnknownNode),
)
async def remove_node(
    job_id: JobId, node_id: NodeId, rdzv: RdzvDep, driver: DriverDep
) -> dict[str, str]:
    """The operator takes a node out (admin token; no node credential): as if it had
    left, so its generation ends and the others restart without it; its agent stops
    rather than joining again."""
    await driver.changed_by(job_id, lambda: rdzv.remove(job_id, node_id, f"node {node_id} removed"))
    return {"status": "removed"}


@router.put(
    "/{job_id}/nodes/{node_id}/quarantine", dependencies=[AdminOnly], responses=errors(UnknownJob)
)
async def quarantine_node(
    job_id: JobId,
    node_id: NodeId,
    rdzv: RdzvDep,
    driver: DriverDep,
    body: Annotated[NodeQuarantineRequest | None, Body()] = None,
) -> list[QuarantinedNode]:
    """Keeps a node out of the job (admin token): its joins are refused with
    ``node_quarantined`` and no round seals it; a member's generation ends, as for a
    removal. The node need not have joined. Idempotent (the first mark stays). Returns
    the job's quarantined nodes."""
    reason = (body or NodeQuarantineRequest()).reason
    job = await driver.changed_by(job_id, lambda: rdzv.quarantine_node(job_id, node_id, reason))
    return list(job.quarantined)


@router.delete(
    "/{job_id}/nodes/{node_id}/quarantine", dependencies=[AdminOnly], responses=errors(UnknownJob)
)
async def unquarantine_node(
    job_id: JobId, node_id: NodeId, rdzv: RdzvDep, driver: DriverDep
) -> list[QuarantinedNode]:
    """Admits a quarantined node again (admin token), its counted losses forgotten.
    Idempotent. Returns the job's quarantined nodes."""
    job = await driver.changed_by(job_id, lambda: rdzv.unquarantine_node(job_id, node_id))
    return list(job.quarantined)


@router.get("/{job_id}/hangs", responses=errors(UnknownJob))
async def hangs(job_id: JobId, rdzv: RdzvDep) -> list[HangReport]:
    """The ranks found hung in the job (the last 20), oldest first, without their stacks:
    the generation each ended, the node, the rank, what it did (its phase), its step, how
    long it made no progress and the limit it passed."""
    return await anyio.to_thread.run_sync(rdzv.hang_reports, job_id)


@router.get("/{job_id}/hangs/{generation}", responses=errors(UnknownJob, UnknownNode))
async def hang(job_id: JobId, generation: GenerationNumber, rdzv: RdzvDep) -> HangReport:
    """The hang that ended ``generation``, with the stacks of the hung process's threads as
    its node's agent took them before stopping it (or why it could not).
    ``unknown_node`` if no hang ended that generation."""
    return await anyio.to_thread.run_sync(rdzv.hang_report, job_id, generation)


@router.put(
    "/{job_id}/generations/{generation}/nodes/{node_id}/stacks",
    responses=errors(UnknownJob, UnknownNode, StaleGeneration),
)
async def stacks(
    job_id: JobId,
    generation: GenerationNumber,
    node_id: NodeId,
    body: StacksReport,
    rdzv: RdzvDep,
    driver: DriverDep,
    credential: Credential,
) -> HangReport:
    """A hung rank's stacks, from its node's agent (with the node's credential in the
    generation the hang ended): kept with the hang's report. ``unknown_node`` unless a
    hang of this node's ``rank`` ended ``generation``."""
    job, _ = await driver.snapshot(job_id, generation)
    await anyio.to_thread.run_sync(
        functools.partial(rdzv.member, job, node_id, generation, credential, ended=True)
    )
    return await anyio.to_thread.run_sync(rdzv.record_stacks, job_id, generation, node_id, body)


@router.delete("/{job_id}/blocked", dependencies=[AdminOnly], responses=errors(UnknownJob))
async def unblock(job_id: JobId, rdzv: RdzvDep, driver: DriverDep) -> JobSummary:
    """Lets a job that stopped restarting restart again (admin token): one whose
    generations made no progress several times in a row (``blocked: no progress``), or
    whose world size kept failing to load its checkpoint. Idempotent."""
    job = await driver.changed_by(job_id, lambda: rdzv.unblock(job_id))
    return rdzv.summary(job)


@router.get("/{job_id}/nodes/{node_id}", responses=errors(UnknownJob, UnknownNode))
async def node_info(job_id: JobId, node_id: NodeId, rdzv: RdzvDep) -> NodeInfo:
    """A node's registration; ``left`` once it left (a preempted node's agent stops)."""
    node = await anyio.to_thread.run_sync(rdzv.node, job_id, node_id)
    return NodeInfo(node_id=node.node_id, addr=node.addr, round=node.round, state=node.state)


@router.get(
    "/{job_id}/generations/{generation}/nodes/{node_id}",
    response_model=Assignment,
    responses=errors(UnknownJob, UnknownNode, StaleGeneration),
)
async def assignment(
    job_id: JobId,
    generation: GenerationNumber,
    node_id: NodeId,
    rdzv: RdzvDep,
    driver: DriverDep,
    credential: Credential,
) -> Response:
    """A member's assignment in a running generation, without joining again (what a
    worker under torchrun asks for with its agent's credential: the agent joined)."""
    job, _ = await driver.snapshot(job_id, generation)
    sealed, _ = await anyio.to_thread.run_sync(rdzv.member, job, node_id, generation, credential)
    return Response(sealed.assignment_json(job_id, node_id), media_type="application/json")


@router.get(
    "/{job_id}/generations/{generation}/members",
    response_model=list[MemberInfo],
    responses={
        304: {"description": "Not modified: the If-None-Match ETag is the list's"},
        **errors(UnknownJob, StaleGeneration),
    },
)
async def members(
    job_id: JobId,
    generation: GenerationNumber,
    rdzv: RdzvDep,
    driver: DriverDep,
    if_none_match: Annotated[str | None, Header(max_length=128)] = None,
) -> Response:
    """A sealed generation's members in rank order (address, port, replica server).

    Assignments carry only the list's digest, which is its ETag: a generation's members
    never change, so a cache (or ``If-None-Match``) keeps one copy per generation.
    """
    job, _ = await driver.snapshot(job_id, generation)
    if generation > job.generation:
        raise StaleGeneration(
            f"generation {generation} of job {job_id!r} never sealed (latest is {job.generation})"
        )
    sealed = rdzv.cached(job_id, generation)
    if sealed is None:
        sealed = await anyio.to_thread.run_sync(rdzv.sealed, job_id, generation)
    etag = f'"{sealed.members_digest}"'
    headers = {"ETag": etag, "Cache-Control": "private, max-age=86400, immutable"}
    if if_none_match is not None and etag in (t.strip() for t in if_none_match.split(",")):
        return Response(status_code=304, headers=headers)
    return Response(sealed.members_json, media_type="application/json", headers=headers)
