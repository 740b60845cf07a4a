"""``ElasticClient``: what a trainer calls before every (re)start."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel

from rallypoint.closing import Closing
from rallypoint.tls import ssl_context

from .errors import JoinTimeout, RallypointError, StandbyReleased, TransportError, error_for
from .models import (
    CREDENTIAL_HEADER,
    ENVELOPE_PATH,
    MAX_FAILURE_REASON,
    Assignment,
    BeginCheckpoint,
    CheckpointBegun,
    CheckpointInfo,
    FaultReport,
    HangReport,
    HeartbeatReply,
    HeartbeatRequest,
    JobSpec,
    JobStatus,
    JobSummary,
    JoinReply,
    JoinRequest,
    KeepBest,
    LeaveRequest,
    LoadFailure,
    MemberInfo,
    NodeInfo,
    NodeQuarantineRequest,
    PeerKey,
    QuarantinedNode,
    QuarantineRequest,
    RankProgress,
    ReportShard,
    RestoreFailure,
    RestoreReport,
    ShardFile,
    StacksReport,
    StoreReply,
    StoreRequest,
    Timeline,
    TokenCreated,
    TokenInfo,
    TokenRequest,
    WaitRequest,
    WorldSizeReport,
    check_id,
)

__all__ = [
    "CREDENTIAL_ENV",
    "ENDPOINT_KEY_ENV",
    "GENERATION_ENV",
    "JOB_ENV",
    "NODE_ENV",
    "READY_DIR_ENV",
    "READY_MARK",
    "STANDBY_ROUND_ENV",
    "TOKEN_ENV",
    "TRANSPORT_ENV",
    "URL_ENV",
    "ElasticClient",
    "Heartbeats",
    "RetryPolicy",
]

log = logging.getLogger("rallypoint.client")

#: The coordinator's URL, e.g. ``http://coordinator:8080``.
URL_ENV = "RALLYPOINT_URL"
#: The job id.
JOB_ENV = "RALLYPOINT_JOB"
#: The bearer token, if the coordinator has one.
TOKEN_ENV = "RALLYPOINT_TOKEN"
#: This node's id; defaults to the host name (stable across restarts of the node).
NODE_ENV = "RALLYPOINT_NODE"
#: The generation a torchrun agent joined, set for its workers: their ``join()`` returns
#: the agent's assignment instead of starting a round of their own.
GENERATION_ENV = "RALLYPOINT_GENERATION"
#: The node credential a torchrun agent's join got, set for its workers (they act for
#: the agent's node: checkpoint reports, the assignment).
CREDENTIAL_ENV = "RALLYPOINT_CREDENTIAL"
#: The round a hot standby's agent parks for (``--rdzv-conf hot_standby=1``), set for the
#: workers it starts before it is promoted: their ``join()`` waits for the node's seal,
#: then sets torchrun's rank variables from the assignment.
STANDBY_ROUND_ENV = "RALLYPOINT_STANDBY_ROUND"
#: Where a hot standby's or a hot join's workers mark that they wait in :meth:`join`
#: (one file each, :data:`READY_MARK` and the local rank), set by the agent with
#: :data:`STANDBY_ROUND_ENV`: the agent tells the coordinator once all of them are.
READY_DIR_ENV = "RALLYPOINT_READY_DIR"
READY_MARK = "ready-"
#: ``rest`` (the default) or ``envelope`` (every call through one route; see ElasticClient).
TRANSPORT_ENV = "RALLYPOINT_TRANSPORT"
#: A gateway's key (an AzureML endpoint's), when the gateway takes ``Authorization``.
ENDPOINT_KEY_ENV = "RALLYPOINT_ENDPOINT_KEY"

# Each long-poll is held this long by the coordinator: far below proxies' 180 s limits.
_POLL = 30.0
_RETRY_STATUS = {429, 502, 503, 504}


def _reason(exc: httpx.TransportError) -> str:
    """A transport error as a person would put it: ``connection refused``."""
    text = re.sub(r"^\[Errno -?\d+\]\s*", "", str(exc)).strip()
    return text[:1].lower() + text[1:] if text else type(exc).__name__


def _retry_after(response: httpx.Response) -> float | None:
    """A reply's ``Retry-After`` in seconds, if it gives one as a number."""
    try:
        return max(0.0, float(response.headers["Retry-After"]))
    except (KeyError, ValueError):
        return None


class RetryPolicy(BaseModel):
    """Capped exponential backoff with full jitter, for transport errors and 429/5xx.

    Attributes:
        initial: The first backoff's cap.
        maximum: No backoff is longer.
        deadline: Retries stop once this much time passed since the first attempt.
    """

    initial: timedelta = timedelta(milliseconds=200)
    maximum: timedelta = timedelta(seconds=10)
    deadline: timedelta = timedelta(seconds=120)

    def delays(self) -> Iterator[float]:
        """Backoffs to sleep between attempts, until the deadline is spent."""
        end = time.monotonic() + self.deadline.total_seconds()
        cap = self.initial.total_seconds()
        while True:
            delay = random.uniform(0, cap)
            if time.monotonic() + delay > end:
                return
            yield delay
            cap = min(cap * 2, self.maximum.total_seconds())


#: For reports that only feed the coordinator's metrics.
_REPORT_RETRY = RetryPolicy(deadline=timedelta(seconds=2))


def _default_node_id() -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64].strip(".")
    return name or "node"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class ElasticClient(Closing):
    """A node's handle on one job of a Rallypoint coordinator.

    Args:
        url: The coordinator, e.g. ``http://coordinator:8080``.
        job_id: The job, ``[A-Za-z0-9._-]{1,64}``.
        node_id: This node; defaults to ``RALLYPOINT_NODE`` or the host name.
        token: The coordinator's bearer token, if it has one.
        retry: How transport errors and 429/5xx answers are retried.
        timeout: Connect and read timeout of requests other than long-polls.
        transport: ``"rest"`` calls each operation at its own path; ``"envelope"`` posts
            every one to a single route, for gateways that forward one path (an AzureML
            managed online endpoint: pass its scoring URI as ``url``). Defaults to
            ``RALLYPOINT_TRANSPORT``, else ``"rest"``. With ``"envelope"``, a ``url``
            without a path gets ``/v1/envelope`` appended.
        endpoint_key: A gateway's own key (an AzureML endpoint key), sent as
            ``Authorization: Bearer``; the coordinator's ``token`` then travels in
            ``X-Rallypoint-Token``.
        http_transport: An httpx transport (tests, proxies).
        generation: A generation this node already joined (its torchrun agent did):
            :meth:`join` returns that assignment rather than joining again.
        credential: The node credential of that join (see :attr:`credential`).
        standby_round: The round this node's agent parks for as a hot standby:
            :meth:`join` waits for it to seal with the node (see :data:`STANDBY_ROUND_ENV`).

    Raises:
        ValueError: ``job_id`` or ``node_id`` is not a valid id, or ``transport`` is
            neither ``"rest"`` nor ``"envelope"``.
    """

    def __init__(
        self,
        url: str,
        job_id: str,
        node_id: str | None = None,
        token: str | None = None,
        *,
        retry: RetryPolicy | None = None,
        timeout: timedelta = timedelta(seconds=30),
        transport: Literal["rest", "envelope"] | None = None,
        endpoint_key: str | None = None,
        http_transport: httpx.BaseTransport | None = None,
        generation: int | None = None,
        credential: str | None = None,
        standby_round: int | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.job_id = check_id(job_id)
        self.node_id = check_id(node_id or os.environ.get(NODE_ENV) or _default_node_id())
        self.retry = retry or RetryPolicy()
        chosen = transport or os.environ.get(TRANSPORT_ENV) or "rest"
        if chosen not in ("rest", "envelope"):
            raise ValueError(f"transport must be 'rest' or 'envelope', not {chosen!r}")
        self.transport = chosen
        self._envelope_url = self.url
        if not httpx.URL(self.url).path.strip("/"):
            self._envelope_url += ENVELOPE_PATH
        self._timeout = timeout.total_seconds()
        headers: dict[str, str] = {}
        if endpoint_key:
            headers["Authorization"] = f"Bearer {endpoint_key}"
            if token:
                headers["X-Rallypoint-Token"] = token
        elif token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=self._timeout,
            transport=http_transport,
            verify=ssl_context(),
        )
        self.assignment: Assignment | None = None
        self._joined = generation
        self._standby_round = standby_round
        #: The round this node parks for while :meth:`join` waits as a standby (None
        #: otherwise): an agent reads it to start its workers hot.
        self.parked_round: int | None = None
        self.credential: str | None = None
        if credential:
            self._credential(credential)
        #: Where :meth:`heartbeat` takes the node's processes' progress from (None:
        #: it sends none). ``rallypoint.trainer`` sets it in a process that is its own
        #: node (no agent); under an agent, the agent reports for its workers.
        self.progress: Callable[[], Sequence[RankProgress] | None] | None = None

    @classmethod
    def from_env(cls, **kwargs: Any) -> ElasticClient:
        """A client from ``RALLYPOINT_URL``, ``RALLYPOINT_JOB``, ``RALLYPOINT_TOKEN``,
        ``RALLYPOINT_ENDPOINT_KEY``, ``RALLYPOINT_TRANSPORT``, ``RALLYPOINT_NODE``,
        ``RALLYPOINT_GENERATION`` and ``RALLYPOINT_CREDENTIAL`` (set by the torchrun
        plugin for its workers); keyword arguments win over the environment.

        Raises:
            ValueError: ``RALLYPOINT_URL`` or ``RALLYPOINT_JOB`` is not set.
        """
        url = kwargs.pop("url", None) or os.environ.get(URL_ENV)
        job_id = kwargs.pop("job_id", None) or os.environ.get(JOB_ENV)
        if not url or not job_id:
            raise ValueError(f"set {URL_ENV} and {JOB_ENV} (or pass url= and job_id=)")
        kwargs.setdefault("token", os.environ.get(TOKEN_ENV) or None)
        kwargs.setdefault("endpoint_key", os.environ.get(ENDPOINT_KEY_ENV) or None)
        generation = os.environ.get(GENERATION_ENV)
        if generation:
            kwargs.setdefault("generation", int(generation))
        parked = os.environ.get(STANDBY_ROUND_ENV)
        if parked and not generation:
            kwargs.setdefault("standby_round", int(parked))
        kwargs.setdefault("credential", os.environ.get(CREDENTIAL_ENV) or None)
        return cls(url, job_id, **kwargs)

    def _credential(self, credential: str) -> None:
        """From now on every request acts as this registration of the node."""
        self.credential = credential
        self._http.headers[CREDENTIAL_HEADER] = credential

    def follow(self, assignment: Assignment, credential: str | None = None) -> None:
        """Moves this client to a generation its agent joined for the node: a worker
        that stays in its process across generations (see
        ``rallypoint.trainer.generations``) acts for the node's new registration.

        Args:
            assignment: The node's assignment in the new generation.
            credential: The credential of the agent's new join, if it got one.
        """
        self.assignment = assignment
        if credential:
            self._credential(credential)

    # --- plumbing -----------------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        body: BaseModel | None = None,
        *,
        read_timeout: float = 0,
        retry: RetryPolicy | None = None,
        via: httpx.Client | None = None,
    ) -> httpx.Response:
        """Sends a request, retrying transport errors and 429/5xx (by ``retry``, else the
        client's policy), through ``via`` if given (else the client's pool); raises error
        replies."""
        retry = retry or self.retry
        content = body.model_dump_json(exclude_none=True) if body is not None else None
        url = path
        if self.transport == "envelope":
            operation = json.dumps({"method": method, "path": path})
            content = f'{operation[:-1]}, "body": {content or "null"}}}'
            method, url = "POST", self._envelope_url
        timeout = httpx.Timeout(self._timeout, read=self._timeout + read_timeout)
        delays = retry.delays()
        attempt = 1
        while True:
            unreachable: str | None = None
            soon: float | None = None
            try:
                response = (via or self._http).request(
                    method,
                    url,
                    content=content,
                    headers={"Content-Type": "application/json"} if content else None,
                    timeout=timeout,
                )
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
                unreachable = _reason(exc)
            else:
                if response.status_code < 400:
                    return response
                if response.status_code not in _RETRY_STATUS:
                    raise self._error(response)
                problem = f"HTTP {response.status_code}"
                soon = _retry_after(response)
            delay = next(delays, None)
            if delay is None:
                raise TransportError(
                    f"{method} {self.url}{path} failed for {retry.deadline}: {problem}"
                )
            if soon is not None:
                delay = min(delay, soon)  # the coordinator knows when it is worth asking
            attempt += 1
            if unreachable is not None:
                # A warning at every backoff: a node that cannot reach its coordinator
                # (a wrong URL, one that is down) says so at once, not after the deadline.
                log.warning(
                    "cannot reach %s: %s; retrying in %.2f s, attempt %d (%s %s)",
                    self.url,
                    unreachable,
                    delay,
                    attempt,
                    method,
                    path,
                )
            else:
                log.info("%s %s: %s; retrying in %.2f s", method, path, problem, delay)
            time.sleep(delay)

    @staticmethod
    def _error(response: httpx.Response) -> RallypointError:
        try:
            body = response.json()
            code, message = str(body["code"]), str(body["message"])
        except (ValueError, KeyError, TypeError):
            code, message = f"http_{response.status_code}", response.text[:200]
        return error_for(response.status_code, code, message)

    @property
    def _job(self) -> str:
        return f"/v1/jobs/{self.job_id}"

    @property
    def _node(self) -> str:
        return f"{self._job}/nodes/{self.node_id}"

    # --- jobs ---------------------------------------------------------------------------

    def create_job(
        self,
        min_nodes: int,
        max_nodes: int,
        *,
        last_call: timedelta = timedelta(seconds=5),
        heartbeat_timeout: timedelta = timedelta(seconds=10),
        join_timeout: timedelta = timedelta(seconds=600),
        standbys: int = 0,
    ) -> JobSummary:
        """Creates the job; harmless if it exists with the same parameters.

        Args:
            standbys: Nodes that park beside a full generation and take a lost
                member's rank (``JobSpec.standbys``).

        Raises:
            JobConflict: It exists with other parameters.
        """
        spec = JobSpec(
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            last_call=last_call,
            heartbeat_timeout=heartbeat_timeout,
            join_timeout=join_timeout,
            standbys=standbys,
        )
        reply = self._request("PUT", self._job, spec)
        return JobSummary.model_validate_json(reply.content)

    def membership(self) -> JobStatus:
        """The job's members, waiting nodes and generation history."""
        return JobStatus.model_validate_json(self._request("GET", self._job).content)

    def timeline(self) -> Timeline:
        """The job's history for a timeline: its last generations with why each ended,
        its checkpoint versions (kept and lately collected) by tier, and the pointers."""
        return Timeline.model_validate_json(self._request("GET", f"{self._job}/timeline").content)

    def jobs(self) -> list[JobSummary]:
        """Every job on the coordinator (that this client's token covers)."""
        return [JobSummary.model_validate(j) for j in self._request("GET", "/v1/jobs").json()]

    # --- tokens (the admin token's) -----------------------------------------------------

    def create_token(
        self,
        role: Literal["trainer", "reader"],
        *,
        expires_in: timedelta | None = None,
        name: str | None = None,
    ) -> TokenCreated:
        """Makes a token scoped to this client's job (needs the admin token).

        Args:
            role: ``trainer`` joins the job and acts for its nodes; ``reader`` reads it.
            expires_in: Its lifetime; None: until revoked.
            name: A label for people.

        Returns:
            The token's record with ``token`` itself, shown this once.

        Raises:
            Forbidden: This client's token is not the admin token.
        """
        body = TokenRequest(
            job_id=self.job_id,
            role=role,
            expires_in=None if expires_in is None else expires_in.total_seconds(),
            name=name,
        )
        return TokenCreated.model_validate_json(self._request("POST", "/v1/tokens", body).content)

    def tokens(self, *, all_jobs: bool = False) -> list[TokenInfo]:
        """This job's scoped tokens (every job's, with ``all_jobs``), revoked ones
        included; never the tokens themselves (needs the admin token)."""
        query = "" if all_jobs else f"?job_id={self.job_id}"
        reply = self._request("GET", f"/v1/tokens{query}")
        return [TokenInfo.model_validate(t) for t in reply.json()]

    def revoke_token(self, token_id: str) -> TokenInfo:
        """Revokes a scoped token: every coordinator replica refuses it within a second
        (needs the admin token).

        Raises:
            UnknownToken: No token has this id.
        """
        return TokenInfo.model_validate_json(
            self._request("DELETE", f"/v1/tokens/{token_id}").content
        )

    # --- rendezvous ---------------------------------------------------------------------

    def join(
        self,
        addr: str | None = None,
        port: int | None = None,
        *,
        timeout: timedelta | None = None,
        spec: JobSpec | None = None,
        peer: str | None = None,
        warm: bool = False,
    ) -> Assignment:
        """Joins the job's next generation and blocks until it seals.

        In a worker that torchrun started with ``--rdzv-backend=rallypoint`` (the client
        came from :meth:`from_env`), the agent joined already: the first call returns the
        agent's assignment, checkpoint pointer included, and starts no round.

        Each request is a long-poll the coordinator holds for at most 30 s, so no proxy
        cuts it; between them the client polls again until the seal or ``timeout``. A
        node that joins a full generation of a job with standbys (``JobSpec.standbys``)
        parks: it waits, with no timeout, until a member is lost and it takes its rank.

        Args:
            addr: How other nodes reach this one; defaults to the host name.
            port: A free port here (rank 0's becomes the master port); one is picked.
            timeout: Give up after this long; defaults to the job's ``join_timeout``,
                which the coordinator enforces too.
            spec: Creates the job with these parameters if it does not exist yet.
            peer: The base URL of this node's replica server (the agent's memory tier
                runs one), where other nodes copy their checkpoint files.
            warm: A hot join (torchrun's ``hot_join=1``): joining a running generation
                with room, the node parks instead of ending it (``parked_round`` says
                for which round) while its workers start; the caller then says when
                they wait to train with :meth:`ready`, and only that ends the
                generation. Without ``ready`` the node parks until the generation ends
                for another reason.

        Returns:
            The assignment: generation, rank, world size, master address and port,
            members, and the checkpoint every member resumes from.

        Raises:
            JoinTimeout: No generation with this node sealed in time.
            JobFull, JobConflict, UnknownJob: As named.
            StaleGeneration: The agent's generation ended before this worker asked.
        """
        if self._joined is not None and self.assignment is None:
            self.assignment = self.assignment_in(self._joined)
            return self.assignment
        if self._standby_round is not None and self.assignment is None:
            return self._promoted(timeout)
        wait = _POLL if timeout is None else min(_POLL, timeout.total_seconds())
        request = JoinRequest(
            node_id=self.node_id,
            addr=addr or socket.gethostname(),
            port=port or _free_port(),
            spec=spec,
            wait=wait,
            join_id=uuid.uuid4().hex,  # retries of this request are the same join
            peer=peer,
            warm=warm,
        )
        reply = JoinReply.model_validate_json(
            self._request("POST", f"{self._job}/join", request, read_timeout=request.wait).content
        )
        if reply.credential:
            self._credential(reply.credential)
        return self._sealed(reply, timeout)

    def _promoted(self, timeout: timedelta | None) -> Assignment:
        """A hot standby's worker: waits, as its agent does, for the round the agent
        parks for to seal with the node, then gives the process torchrun's rank
        variables of that assignment (the ones it started with were placeholders), so
        ``init_process_group`` and :func:`~rallypoint.trainer.generations` find the
        generation. Every node runs as many workers, as torchrun numbers them.

        Raises:
            SystemExit: 0, if the job finished while the node stood by (its agent
                exits 0 as well).
        """
        assert self._standby_round is not None
        parked = JoinReply(status="standby", round=self._standby_round)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        ready = os.environ.get(READY_DIR_ENV)
        if ready:
            # This worker waits to train: its agent counts the marks (each says how
            # many to expect), and once every worker of the node has one, a hot join
            # ends the generation for it. Renamed into place: never read half-written.
            partial = Path(ready, f".{READY_MARK}{local_rank}")
            partial.write_text(str(local_world))
            os.replace(partial, Path(ready, f"{READY_MARK}{local_rank}"))
        try:
            assignment = self._sealed(parked, timeout)
        except StandbyReleased as exc:
            log.warning("rallypoint: %s; this standby's worker exits", exc)
            raise SystemExit(0) from None
        rank, world = (
            assignment.rank * local_world + local_rank,
            assignment.world_size * local_world,
        )
        os.environ.update(
            {
                "RANK": str(rank),
                "ROLE_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "ROLE_WORLD_SIZE": str(world),
                "GROUP_RANK": str(assignment.rank),
                "GROUP_WORLD_SIZE": str(assignment.world_size),
                "MASTER_ADDR": assignment.master_addr,
                "MASTER_PORT": str(assignment.master_port),
                GENERATION_ENV: str(assignment.generation),
            }
        )
        os.environ.pop(STANDBY_ROUND_ENV, None)
        self._standby_round = None
        return assignment

    def _sealed(self, reply: JoinReply, timeout: timedelta | None) -> Assignment:
        """Polls from a join's first reply until its round seals with this node."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()

        def wait_for() -> float:
            if deadline is None:
                return _POLL
            return max(0.0, min(_POLL, deadline - time.monotonic()))

        parked = False
        while reply.assignment is None:
            if reply.status == "standby" or parked:
                # Parked beside a full generation (JobSpec.standbys): it waits for as
                # long as that generation runs, so the timeout starts again from each
                # reply that says so, and from the first that says its round is open
                # (the coordinator counts the same way).
                if not parked:
                    log.info(
                        "rallypoint: node %s parks as a standby of job %s (round %d)",
                        self.node_id,
                        self.job_id,
                        reply.round,
                    )
                parked = reply.status == "standby"
                self.parked_round = reply.round if parked else None
                if timeout is not None:
                    deadline = time.monotonic() + timeout.total_seconds()
            if deadline is not None and time.monotonic() >= deadline:
                raise JoinTimeout(
                    f"round {reply.round} of job {self.job_id!r} did not seal within {timeout}",
                    status=408,
                )
            poll = WaitRequest(round=reply.round, wait=wait_for())
            reply = JoinReply.model_validate_json(
                self._request("POST", f"{self._node}/wait", poll, read_timeout=poll.wait).content
            )
        self.parked_round = None
        self.assignment = reply.assignment
        return reply.assignment

    def assignment_in(self, generation: int) -> Assignment:
        """This node's assignment in a running generation it is a member of.

        Raises:
            StaleGeneration: The generation is not running (any more).
            UnknownNode: This node is not a member of it.
        """
        path = f"{self._job}/generations/{generation}/nodes/{self.node_id}"
        return Assignment.model_validate_json(self._request("GET", path).content)

    def members(self, generation: int | None = None) -> list[MemberInfo]:
        """A sealed generation's members in rank order (this node's, by default).

        Assignments carry only the list's digest (``members_digest``): fetch it when you
        need more than your rank, the world size and the master.

        Raises:
            StaleGeneration: The generation never sealed.
        """
        chosen = generation if generation is not None else self._generation(None)
        reply = self._request("GET", f"{self._job}/generations/{chosen}/members")
        return [MemberInfo.model_validate(m) for m in reply.json()]

    def node_info(self) -> NodeInfo:
        """This node's registration (``left`` after :meth:`leave`).

        Raises:
            UnknownNode: It never joined.
        """
        return NodeInfo.model_validate_json(self._request("GET", self._node).content)

    def store(self, generation: int, request: StoreRequest) -> StoreReply:
        """One operation on a generation's key-value store (see
        ``rallypoint.trainer.CoordinatorStore``, the ``torch.distributed.Store`` on it),
        as this node (a member of ``generation``)."""
        if request.node_id is None:
            request = request.model_copy(update={"node_id": self.node_id})
        reply = self._request(
            "POST", f"{self._job}/store/{generation}", request, read_timeout=request.wait
        )
        return StoreReply.model_validate_json(reply.content)

    def heartbeat(
        self,
        wait: timedelta = timedelta(0),
        progress: Sequence[RankProgress] | None = None,
    ) -> HeartbeatReply:
        """Tells the coordinator this node lives; the reply says whether to restart.

        Args:
            wait: Let the coordinator hold the reply this long while the generation runs:
                it answers ``restart`` the moment the generation ends (keep it well
                under the heartbeat timeout: the next beat follows the reply).
            progress: The node's processes' progress (default: what :attr:`progress`
                returns, if set). The coordinator judges hangs and stragglers from it.
        """
        generation = self.assignment.generation if self.assignment else None
        if progress is None and self.progress is not None:
            progress = self.progress()
        body = HeartbeatRequest(
            generation=generation,
            wait=wait.total_seconds(),
            progress=list(progress) if progress else None,
        )
        reply = self._request("POST", f"{self._node}/heartbeat", body, read_timeout=body.wait)
        return HeartbeatReply.model_validate_json(reply.content)

    def heartbeats(
        self,
        interval: timedelta | None = None,
        on_restart: Callable[[HeartbeatReply], None] | None = None,
    ) -> Heartbeats:
        """A background thread that heartbeats until stopped (use it as a context manager).

        Args:
            interval: Between heartbeats; defaults to a quarter of the job's timeout.
            on_restart: Called once, from the thread, when the generation ended.
        """
        if interval is None:
            interval = self.membership().spec.heartbeat_timeout / 4
        return Heartbeats(self, interval, on_restart)

    def ready(self, round: int) -> bool:
        """Tells the coordinator that this node, parked for ``round`` by a hot join
        (:meth:`join` with ``warm``), has its workers waiting to train: the running
        generation ends for it, and the next round seals with it. Returns at once.

        Returns:
            Whether the node still waits for ``round`` (False once it sealed).
        """
        body = WaitRequest(round=round, wait=0, ready=True)
        response = self._request("POST", f"{self._node}/wait", body, read_timeout=5.0)
        return JoinReply.model_validate_json(response.content).assignment is None

    def report_fault(self, detail: str = "", *, generation: int | None = None) -> None:
        """Tells the coordinator that a collective with this node's peers failed while
        its generation ran, before the generation was known to have ended. It ends
        nothing by itself; a peer whose heartbeat watch the coordinator saw cut counts
        as gone at once, not after the reconnect window. :func:`~rallypoint.trainer.
        generations` reports for its workers. One try: a report that comes late is
        worth nothing.

        Args:
            detail: What failed (the error's first line), for the coordinator's log.
            generation: The generation it failed in (default: this node's).

        Raises:
            StaleGeneration: The generation has ended already.
        """
        body = FaultReport(generation=self._generation(generation), detail=detail[:500])
        # On a connection of its own, closed after: in bench runs, reports sent on the
        # pool the worker's checkpoint calls share were followed by a regroup that
        # stalled in 3 of 31 rounds, and 3 of 197 this way (cause not found; see
        # docs/BENCHMARKS.md, "Failed collectives corroborate a cut").
        with httpx.Client(
            base_url=self.url,
            headers=self._http.headers,
            timeout=self._timeout,
            verify=ssl_context(),
        ) as own:
            once = RetryPolicy(deadline=timedelta(0))
            self._request("POST", f"{self._node}/fault", body, retry=once, via=own)

    def report_world_sizes(
        self,
        world_sizes: Sequence[int],
        reason: str = "",
        *,
        rank: int = 0,
        generation: int | None = None,
    ) -> JobSummary:
        """Tells the coordinator that this node's generation has a world the job cannot
        train (its global batch does not split: ``WorldSizeError``), and which world
        sizes, in nodes, can. The job keeps them and the generation ends; from then on
        the coordinator seals only a size the job takes, the largest its nodes make, and
        nodes beyond it wait as standbys (``status`` says why). Every rank may report:
        the first one counts. :func:`rallypoint.trainer.report_world_sizes` reports a
        ``WorldSizeError`` for you (the integrations and ``CheckpointManager.loading``
        call it).

        Args:
            world_sizes: The node counts that can, ascending (the valid rank counts over
                the processes per node); those outside ``min_nodes`` to ``max_nodes``
                are dropped.
            reason: What failed (the error); its first line goes into the generation's
                end reason.
            rank: This process's global rank.
            generation: The generation it failed in (default: this node's, or its
                agent's under torchrun).

        Returns:
            The job afterwards (``world_sizes``: the sizes it takes now).

        Raises:
            StaleGeneration: The generation ended already (another rank reported first).
        """
        generation = generation or (self.assignment.generation if self.assignment else None)
        generation = generation or self._joined
        if generation is None:
            raise ValueError("join() first, or pass the generation this node runs in")
        body = WorldSizeReport(
            generation=generation,
            world_sizes=list(world_sizes),
            rank=rank,
            reason=reason[:MAX_FAILURE_REASON],
        )
        reply = self._request("POST", f"{self._node}/world-sizes", body)
        return JobSummary.model_validate_json(reply.content)

    def leave(self, reason: str = "left", *, fenced: bool = True) -> None:
        """Leaves the job; if this node was a member, the others restart without it.

        Args:
            reason: Shown in the job's generation history.
            fenced: Refuse if this node's generation ended already (a zombie must not
                act); False leaves whatever runs (an agent shutting down).

        Raises:
            StaleGeneration: This node's generation ended already (``fenced`` only).
        """
        generation = self.assignment.generation if self.assignment and fenced else None
        self._request(
            "POST", f"{self._node}/leave", LeaveRequest(generation=generation, reason=reason)
        )

    # --- health -------------------------------------------------------------------------

    def hangs(self) -> list[HangReport]:
        """The ranks found hung in this job (the last 20), oldest first, without stacks."""
        reply = self._request("GET", f"{self._job}/hangs")
        return [HangReport.model_validate(h) for h in reply.json()]

    def hang(self, generation: int) -> HangReport:
        """The hang that ended ``generation``, with the hung process's stacks.

        Raises:
            UnknownNode: No hang ended that generation.
        """
        reply = self._request("GET", f"{self._job}/hangs/{generation}")
        return HangReport.model_validate_json(reply.content)

    def report_stacks(self, generation: int, report: StacksReport) -> HangReport:
        """Sends a hung rank's stacks (its node's agent does, with the node's credential,
        once the coordinator ended ``generation`` for the hang).

        Raises:
            UnknownNode: No hang of this node's ``report.rank`` ended ``generation``.
        """
        reply = self._request(
            "PUT", f"{self._job}/generations/{generation}/nodes/{self.node_id}/stacks", report
        )
        return HangReport.model_validate_json(reply.content)

    def unblock(self) -> JobSummary:
        """Lets this job restart again after it stopped for generations without progress
        or failed loads (the admin token)."""
        reply = self._request("DELETE", f"{self._job}/blocked")
        return JobSummary.model_validate_json(reply.content)

    # --- checkpoints --------------------------------------------------------------------

    def _generation(self, generation: int | None) -> int:
        if generation is not None:
            return generation
        if self.assignment is None:
            raise ValueError("join() first, or pass the generation this node runs in")
        return self.assignment.generation

    def begin_checkpoint(
        self,
        step: int,
        files: Sequence[str] = ("shard.safetensors",),
        *,
        generation: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        persist: bool = False,
        persist_every: int = 1,
        persist_after: float | None = None,
        memory: bool = False,
    ) -> CheckpointBegun:
        """The version of ``step`` in this node's generation (every rank gets the same one)
        and write URLs for this rank's ``files``.

        Args:
            step: The training step.
            files: The names of the files this rank will write.
            generation: Defaults to this node's.
            rank: This process's global rank (torchrun's ``RANK``); with ``world_size``.
                None: the node's rank, for one process per node.
            world_size: The job's number of processes, the same for every rank.
            persist, persist_every, persist_after: The persistence policy the version is
                created with (see :class:`~rallypoint.client.BeginCheckpoint`).
            memory: This rank keeps its files in its node's memory tier: the reply
                names the peer to copy them to.

        Raises:
            StaleGeneration: The generation ended; re-join before saving.
            CheckpointConflict: The version expired and is being collected, it was begun
                with another world size, or another node holds this rank.
        """
        body = BeginCheckpoint(
            node_id=self.node_id,
            generation=self._generation(generation),
            step=step,
            files=list(files),
            rank=rank,
            world_size=world_size,
            persist=persist,
            persist_every=persist_every,
            persist_after=persist_after,
            memory=memory,
        )
        reply = self._request("POST", f"{self._job}/checkpoints", body)
        return CheckpointBegun.model_validate_json(reply.content)

    def report_checkpoint(
        self,
        version: int,
        files: Sequence[ShardFile],
        *,
        metadata: dict[str, Any] | None = None,
        rank_metadata: dict[str, Any] | None = None,
        generation: int | None = None,
        rank: int | None = None,
        storage: bool = True,
        memory: Sequence[str] = (),
        metrics: Mapping[str, float] | None = None,
        keep_best: KeepBest | None = None,
        keep_last: int | None = None,
    ) -> CheckpointInfo:
        """Reports this rank's uploaded files of ``version``; the last rank's report
        commits it. Safe to retry.

        Args:
            version: From :meth:`begin_checkpoint`.
            files: Every file this rank uploaded, with size and checksum.
            metadata: Rank 0's becomes the version's (replicated non-tensor state).
            rank_metadata: This rank's own non-tensor state.
            generation: Defaults to this node's.
            rank: The global rank given to :meth:`begin_checkpoint`, if any.
            storage: Whether the files were uploaded to blob storage.
            memory: The nodes whose memory tier holds them (this one, its replica).
            metrics: Rank 0's become the version's (finite values).
            keep_best: Rank 0's: the rule the job keeps its best versions by.
            keep_last: Rank 0's: how many of its newest good versions the job keeps
                (None: the coordinator's setting).

        Raises:
            StaleGeneration: The generation ended: this version will never commit.
            IncompleteUpload: A file is not in storage at its reported size.
            CheckpointConflict: The version expired.
        """
        body = ReportShard(
            node_id=self.node_id,
            generation=self._generation(generation),
            files=list(files),
            metadata=metadata,
            rank_metadata=rank_metadata,
            rank=rank,
            storage=storage,
            memory=list(memory),
            metrics=None if metrics is None else dict(metrics),
            keep_best=keep_best,
            keep_last=keep_last,
        )
        reply = self._request("POST", f"{self._job}/checkpoints/{version}/shards", body)
        return CheckpointInfo.model_validate_json(reply.content)

    def report_restore(
        self,
        version: int,
        bytes_from: Mapping[str, int],
        *,
        rank: int,
        generation: int | None = None,
    ) -> None:
        """Tells the coordinator what this rank's restore of ``version`` read, by source
        (``"memory"``: this node's memory tier, ``"peer"``: another node's, ``"storage"``:
        blob storage), for its metrics. :class:`~rallypoint.trainer.CheckpointManager`
        reports each restore itself.

        Args:
            version: The version restored.
            bytes_from: Bytes read by source.
            rank: This process's global rank.
            generation: Defaults to this node's.

        Raises:
            ValueError: A source other than those three, or a negative count.
            StaleGeneration: The generation ended.
            UnknownCheckpoint: No such version (or it was collected since).
            CheckpointConflict: The version is not committed.
        """
        # Validated from plain data: the sources are checked here, not by the type.
        body = RestoreReport.model_validate(
            {
                "node_id": self.node_id,
                "generation": self._generation(generation),
                "rank": rank,
                "bytes_from": dict(bytes_from),
            }
        )
        # Metrics only: a coordinator out of reach must not hold up the restored trainer
        # for the client's whole retry deadline.
        self._request(
            "POST", f"{self._job}/checkpoints/{version}/restores", body, retry=_REPORT_RETRY
        )

    def report_unreadable(
        self, version: int, reason: str, *, rank: int, generation: int | None = None
    ) -> CheckpointInfo:
        """Tells the coordinator that this rank could not load ``version`` from any copy
        it was given (a holder gone, a file missing or failing its checksum). The
        coordinator marks the version unrecoverable, so no generation resumes from it
        again, and ends the generation: the next one resumes from the newest version
        still recoverable. :class:`~rallypoint.trainer.CheckpointManager` reports its own
        failed restores.

        Args:
            version: The version that failed to load.
            reason: What failed (cut to 1,000 characters).
            rank: This process's global rank.
            generation: Defaults to this node's.

        Returns:
            The version, marked.

        Raises:
            StaleGeneration: The generation ended.
            UnknownCheckpoint: No such version (or it was collected since).
            CheckpointConflict: The version is not committed.
        """
        body = self._failure(reason, rank, generation)
        reply = self._request("POST", f"{self._job}/checkpoints/{version}/failures", body)
        return CheckpointInfo.model_validate_json(reply.content)

    def _failure(self, reason: str, rank: int, generation: int | None) -> RestoreFailure:
        """What a rank reports of a version it could not read or load (cut to fit)."""
        return RestoreFailure(
            node_id=self.node_id,
            generation=self._generation(generation),
            rank=rank,
            reason=reason[:MAX_FAILURE_REASON] or "unknown",
        )

    def report_load_failure(
        self, version: int, reason: str, *, rank: int, generation: int | None = None
    ) -> LoadFailure:
        """Tells the coordinator that this rank read ``version`` but could not load it
        (a ZeRO partition count that does not match, a model that does not fit, an error
        in the load code): the generation ends with the reason's first line, for
        ``status`` and the page to show. The version is not marked: another world may
        load it. After two such generations in a row at one world size the coordinator
        holds back a third of that size and waits for a world of another size.
        :meth:`CheckpointManager.resuming <rallypoint.trainer.CheckpointManager.resuming>`
        reports for you.

        Args:
            version: The version this generation was named.
            reason: What failed; its first line is kept.
            rank: This process's global rank.
            generation: Defaults to this node's.

        Returns:
            The failure as recorded (another rank's, if it reported first).

        Raises:
            StaleGeneration: The generation ended (another rank reported first, or a
                member died).
            CheckpointConflict: The generation was not named ``version``.
        """
        body = self._failure(reason, rank, generation)
        reply = self._request("POST", f"{self._job}/checkpoints/{version}/load-failures", body)
        return LoadFailure.model_validate_json(reply.content)

    def checkpoint(self, version: int | Literal["latest", "best"] | None = None) -> CheckpointInfo:
        """A version with read URLs for its manifest and files: by number, the
        authoritative ``"latest"`` (also if ``version`` is None), or the job's ``"best"``
        by the ``keep_best`` rule it saves under.

        Raises:
            UnknownCheckpoint: No such version, none committed yet, or no best.
        """
        path = f"{self._job}/checkpoints/{'latest' if version is None else version}"
        return CheckpointInfo.model_validate_json(self._request("GET", path).content)

    def peer_key(self) -> str:
        """The job's public key that replica servers check peer grants with."""
        reply = self._request("GET", f"{self._job}/checkpoints/peer-key")
        return PeerKey.model_validate_json(reply.content).public_key

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every version of the job, committed or being written, oldest first."""
        reply = self._request("GET", f"{self._job}/checkpoints")
        return [CheckpointInfo.model_validate(v) for v in reply.json()]

    def quarantine(
        self, version: int, reason: str = "", *, restart: bool = False
    ) -> CheckpointInfo:
        """Marks a committed version bad (the admin token): no generation resumes from
        it, and a pointer at it moves back to the newest good version. Idempotent.

        Args:
            version: The version.
            reason: Why, shown beside it.
            restart: End the running generation, so that every member reloads now
                (else the next generation is the first to skip it).

        Raises:
            UnknownCheckpoint: No such version.
            CheckpointConflict: It is not committed.
        """
        body = QuarantineRequest(reason=reason, restart=restart)
        reply = self._request("PUT", f"{self._job}/checkpoints/{version}/quarantine", body)
        return CheckpointInfo.model_validate_json(reply.content)

    def unquarantine(self, version: int) -> CheckpointInfo:
        """Clears a version's quarantine (the admin token); it may be named again, and
        is the latest again if its generation is the job's latest and nothing newer
        committed since. Idempotent.

        Raises:
            UnknownCheckpoint: No such version.
        """
        reply = self._request("DELETE", f"{self._job}/checkpoints/{version}/quarantine")
        return CheckpointInfo.model_validate_json(reply.content)

    def recover(self, version: int) -> CheckpointInfo:
        """Clears a version's ``unrecoverable`` mark (the admin token), once its copies
        are back: it may be named again. Idempotent.

        Raises:
            UnknownCheckpoint: No such version.
        """
        reply = self._request("DELETE", f"{self._job}/checkpoints/{version}/unrecoverable")
        return CheckpointInfo.model_validate_json(reply.content)

    def quarantine_node(self, node_id: str, reason: str = "") -> list[QuarantinedNode]:
        """Keeps a node out of this client's job (the admin token): its joins are
        refused with :class:`NodeQuarantined` and no round seals it; if it is a member,
        its generation ends. Idempotent.

        Returns:
            The job's quarantined nodes.
        """
        body = NodeQuarantineRequest(reason=reason)
        path = f"{self._job}/nodes/{check_id(node_id)}/quarantine"
        reply = self._request("PUT", path, body)
        return [QuarantinedNode.model_validate(q) for q in reply.json()]

    def unquarantine_node(self, node_id: str) -> list[QuarantinedNode]:
        """Admits a quarantined node again (the admin token). Idempotent.

        Returns:
            The job's quarantined nodes.
        """
        reply = self._request("DELETE", f"{self._job}/nodes/{check_id(node_id)}/quarantine")
        return [QuarantinedNode.model_validate(q) for q in reply.json()]

    def close(self) -> None:
        self._http.close()


class Heartbeats:
    """Heartbeats from a background thread (see :meth:`ElasticClient.heartbeats`).

    Attributes:
        restart: Set once the coordinator answered ``restart``.
        last: The last reply.
        error: The error that stopped the thread, if one did.
    """

    def __init__(
        self,
        client: ElasticClient,
        interval: timedelta,
        on_restart: Callable[[HeartbeatReply], None] | None,
    ) -> None:
        self._client = client
        self._interval = interval.total_seconds()
        self._on_restart = on_restart
        self._stop = threading.Event()
        self.restart = threading.Event()
        self.last: HeartbeatReply | None = None
        self.error: RallypointError | None = None
        self._thread = threading.Thread(target=self._run, name="rallypoint-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                # Held by the coordinator for an interval, or until the generation ends.
                self.last = self._client.heartbeat(wait=timedelta(seconds=self._interval))
            except RallypointError as exc:
                log.warning("heartbeat failed: %s", exc)
                self.error = exc
                return
            if self.last.action == "restart":
                self.restart.set()
                if self._on_restart is not None:
                    self._on_restart(self.last)
                return
            self._stop.wait(max(0.0, self._interval - (time.monotonic() - started)))

    def stop(self) -> None:
        """Stops the thread (waits for a request in flight)."""
        self._stop.set()
        with contextlib.suppress(RuntimeError):
            self._thread.join()

    def __enter__(self) -> Heartbeats:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
