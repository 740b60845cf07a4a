"""The ``rallypoint`` rendezvous backend of torchrun.

Registered through the ``torchrun.handlers`` entry point, so stock torchrun finds it::

    torchrun --rdzv-backend=rallypoint --rdzv-endpoint=http://coordinator:8080 \\
        --rdzv-id=JOB --nnodes=2:8 --max-restarts=100 train.py

Options come from ``--rdzv-conf key=value,...`` (see :class:`RendezvousSettings`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from rallypoint.client import (
    CREDENTIAL_ENV,
    ENDPOINT_KEY_ENV,
    GENERATION_ENV,
    JOB_ENV,
    NODE_ENV,
    READY_DIR_ENV,
    READY_MARK,
    STANDBY_ROUND_ENV,
    TOKEN_ENV,
    URL_ENV,
    Assignment,
    ElasticClient,
    JobFull,
    JobSpec,
    JoinTimeout,
    RallypointError,
    RetryPolicy,
    ServerError,
    StaleGeneration,
    StandbyReleased,
    TransportError,
    UnknownNode,
)
from rallypoint.client.models import (
    FINISHED,
    MAX_STACKS_BYTES,
    HeartbeatReply,
    JobSummary,
    RankProgress,
    StacksReport,
)

from .._pids import alive
from ..health import PROGRESS_ENV, Starvation, read_node, records, take_stacks
from ..memory import MEMORY_ENV, OFF, NodeMemory, ReplicaServer, default_root
from ._board import REGROUP_ENV, Board, Posted
from ._launch import WORKER_ENV_FILE
from ._store import CoordinatorStore

__all__ = [
    "BACKEND",
    "START_GATE_ENV",
    "RallypointRendezvousHandler",
    "RendezvousSettings",
    "create_handler",
]

# torchrun's worker rank assignment through the store (torch.distributed.elastic.agent.
# server.api.SimpleElasticAgent._assign_worker_ranks): its keys, and the role torchrun
# gives workers unless a launcher names another.
_ROLE_INFO = "torchelastic/role_info/"
_ASSIGNED_RANKS = "torchelastic/assigned_ranks/"
_ROLE = "default"
#: A parked node's placeholder master port: no port at all (see ``_park_hot``).
_NO_MASTER_PORT = 2**16
#: How often the agent reads its workers' progress between two beats (``_Beats``).
_PROGRESS_POLL_S = 0.1
#: Tests only: a path. Before its first join the agent writes ``PATH.NODE`` and waits
#: (at most :data:`_GATE_LIMIT_S`) until ``PATH`` exists: a test starts a job's first
#: nodes as one (``Cluster.start``), so that they reach the coordinator milliseconds apart
#: however loaded the machine, and its first round holds them all. Production never
#: sets it, and then nothing waits.
START_GATE_ENV = "RALLYPOINT_TEST_START_GATE"
_GATE_LIMIT_S = 300.0

log = logging.getLogger("rallypoint.trainer")

#: The name torchrun knows the backend by (``--rdzv-backend``).
BACKEND = "rallypoint"


@dataclass(frozen=True)
class RendezvousSettings:
    """The plugin's settings, from torchrun's flags and ``--rdzv-conf``.

    ``--rdzv-conf`` keys, each read with torch's ``get_as_int``/``get``:

    =====================  =========================================================
    ``token``              the coordinator's bearer token (default ``RALLYPOINT_TOKEN``)
    ``node_id``            this node's id (default ``RALLYPOINT_NODE``, else
                           ``HOST-PID``: each agent process is a node)
    ``heartbeat_timeout``  s; a member silent this long is dead (default 10)
    ``heartbeat_interval`` s; between heartbeats (default a quarter of the timeout)
    ``last_call``          s; after ``min`` nodes joined, wait this long for more (default 5)
    ``join_timeout``       s; give up joining after this long (default torchrun's
                           ``--rdzv-timeout``, else 600)
    ``store_timeout``      s; how long store reads wait for a key (default 300)
    ``standbys``           nodes that park beyond ``MAX`` and take a lost member's
                           rank, so the world keeps its size (default 0)
    ``hot_standby``        1: this node, if it parks, starts its workers at once; they
                           wait in ``ElasticClient.join()`` until it is promoted
                           (default 0: they start at its promotion)
    ``hot_join``           1: this node, joining a running generation with room,
                           parks and starts its workers; the generation ends for it
                           only once they wait in ``ElasticClient.join()``, so the
                           members never wait for its process start (default 1; a
                           script that builds its process group first fails to at
                           once, and the node goes in cold). 0: the generation ends
                           as soon as the node joins
    ``hang_limit``         s; a worker that makes no progress this long while it
                           trains is hung (default: learned from the job's steps;
                           0: hangs are not judged)
    ``phase_limit``        s; the bound of start-up, saves, loads and evaluations
                           (default 600)
    ``straggler``          ``report`` (default), ``replace`` or ``drop``
    ``straggler_threshold`` the relative score a straggler stays under (default 0.75)
    ``world_sizes``        the node counts the job can take, ascending, separated by
                           ``/`` (torch splits ``--rdzv-conf`` on commas): ``2/4/8``.
                           A round seals the largest its nodes make; the others wait
                           as standbys (``JobSpec.world_sizes``; default: any from
                           ``MIN`` to ``MAX``, or what a ``WorldSizeError`` teaches)
    =====================  =========================================================

    The job is created by the first node with ``--nnodes MIN:MAX`` and these timeouts;
    a node that asks for other values is refused (``job_conflict``).
    """

    url: str
    job_id: str
    node_id: str
    addr: str
    token: str | None
    spec: JobSpec
    heartbeat_interval: timedelta
    store_timeout: timedelta
    hot_standby: bool = False
    hot_join: bool = True

    @classmethod
    def from_parameters(cls, params: RendezvousParameters) -> RendezvousSettings:
        """Reads torchrun's ``RendezvousParameters``.

        Raises:
            ValueError: A value is malformed or out of range.
        """
        url = params.endpoint.strip()
        if not url:
            raise ValueError("--rdzv-endpoint must name the coordinator, e.g. http://host:8080")
        if "://" not in url:
            url = "http://" + url

        def seconds(key: str, default: float) -> timedelta:
            value = params.get_as_int(key)
            return timedelta(seconds=default if value is None else value)

        heartbeat_timeout = seconds("heartbeat_timeout", 10)
        interval = params.get_as_int("heartbeat_interval")
        hang_limit = params.get_as_int("hang_limit")
        threshold = params.get("straggler_threshold")
        spec = JobSpec(
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            last_call=seconds("last_call", 5),
            heartbeat_timeout=heartbeat_timeout,
            join_timeout=seconds("join_timeout", params.get_as_int("timeout") or 600),
            standbys=params.get_as_int("standbys") or 0,
            hang_limit=None if hang_limit is None else timedelta(seconds=hang_limit),
            phase_limit=seconds("phase_limit", 600),
            straggler=params.get("straggler") or "report",
            straggler_threshold=0.75 if threshold is None else float(threshold),
            world_sizes=_world_sizes(params.get("world_sizes")),
        )
        return cls(
            url=url,
            job_id=params.run_id,
            node_id=params.get("node_id")
            or os.environ.get(NODE_ENV)
            or f"{socket.gethostname()}-{os.getpid()}"[-64:],
            addr=params.local_addr or socket.gethostname(),
            token=params.get("token") or os.environ.get(TOKEN_ENV) or None,
            spec=spec,
            heartbeat_interval=heartbeat_timeout / 4
            if interval is None
            else timedelta(seconds=interval),
            store_timeout=seconds("store_timeout", 300),
            hot_standby=bool(params.get_as_int("hot_standby") or 0),
            hot_join=bool(params.get_as_int("hot_join", 1)),
        )


def _world_sizes(value: str | None) -> tuple[int, ...] | None:
    """``--rdzv-conf world_sizes=2/4/8``: node counts separated by ``/``.

    Raises:
        ValueError: Not whole numbers (the spec checks their order and range).
    """
    if value is None or not value.strip():
        return None
    try:
        return tuple(int(part) for part in value.split("/"))
    except ValueError:
        raise ValueError(
            f"world_sizes={value!r}: node counts separated by '/', e.g. world_sizes=2/4/8"
        ) from None


def _beside_a_full_generation(job: JobSummary) -> bool:
    """Whether a node that parked waits as a standby (beside a running generation with
    ``max_nodes`` members: it goes in when a member is lost) rather than for a hot join
    (the generation had room, and ends for the node once its workers are ready). The
    coordinator's own rule for the second is ``seal.warms``; a running generation's
    members do not change, so what the job says after the park says which it was."""
    return job.status == "sealed" and job.world_size >= job.spec.max_nodes


def _left_job(client: ElasticClient) -> bool:
    """Whether this node left the job (a worker of it did, after a preemption notice);
    False if the coordinator cannot say, so a rendezvous goes on to report why."""
    with contextlib.suppress(RallypointError):
        return client.node_info().state == "left"
    return False


class _Beats:
    """Heartbeats for one generation from a thread; notes when it must restart.

    Each beat carries the node's workers' progress (``progress``). Between two held
    beats a second thread reads it every :data:`_PROGRESS_POLL_S`, and beats at once when
    a worker has gone past its bound (the job's hang limit while it trains, which each
    reply carries, or ``phase_limit``): the coordinator judges the hang then, not at the
    next beat, an interval later. A restart that names this node's ranks hung calls
    ``on_hung`` before the agent hears of the end, so their stacks are taken and they are
    stopped before torchrun stops the others. After the end it beats on, unheld, until
    :meth:`stop`: the node is alive while its workers stop, and the next round waits.
    """

    def __init__(
        self,
        client: ElasticClient,
        interval: timedelta,
        progress: Callable[[], list[RankProgress]] | None = None,
        spec: JobSpec | None = None,
        on_hung: Callable[[int, Sequence[int]], None] | None = None,
    ) -> None:
        self._client = client
        self._interval = interval.total_seconds()
        self._progress = progress
        self._spec = spec
        self._on_hung = on_hung
        self._stop = threading.Event()
        self.ended: str | None = None
        self.left = False
        #: The job's hang limit as the last reply said (None: not known yet).
        self.limit: float | None = None
        self._nudged: set[tuple[int, int]] = set()
        self._misread = False  # a progress read failed (logged once)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rallypoint-beats", daemon=True)
        self._thread.start()
        if progress is not None and spec is not None:
            threading.Thread(target=self._watch, name="rallypoint-progress", daemon=True).start()

    def _said(self) -> list[RankProgress] | None:
        if self._progress is None:
            return None
        try:
            return self._progress()
        except OSError as exc:  # a folder gone under a stopping agent: no progress
            log.debug("progress not read: %s", exc)
            return None
        except Exception:  # a bug here must not cost the node its beats
            # A beat without progress is one the coordinator takes as ever; a beats thread
            # that died of a bad figure (a negative starved time did) got the node
            # declared dead 3 s later while its workers trained on.
            if not self._misread:
                self._misread = True
                log.warning("progress not read; beats go on without it", exc_info=True)
            return None

    def _run(self) -> None:
        assignment = self._client.assignment
        generation = assignment.generation if assignment is not None else None
        pause = 0.0
        while not self._stop.wait(pause):
            started = time.monotonic()
            ended = self.ended is not None
            if ended:
                # Beats on, unheld and without progress, until the agent joins again
                # (stop): the coordinator counts them while the node's workers stop, so
                # the next round waits for it (service/_seal.py, restarting). Silent, a
                # node whose workers took over a heartbeat timeout to stop was left
                # out, and its join then ended the generation sealed without it.
                current = self._client.assignment
                if current is None or current.generation != generation:
                    return  # joined a generation since: that one's beats are its own
            try:
                # A watch: held an interval, or answered the moment the generation ends.
                reply = self._client.heartbeat(
                    wait=timedelta(seconds=0 if ended else self._interval),
                    progress=[] if ended else self._said(),
                )
            except (StaleGeneration, UnknownNode) as exc:
                if self.ended is None:
                    self.ended = str(exc)
                return
            except RallypointError as exc:
                # The coordinator may be restarting: keep trying. It gives members a
                # full heartbeat timeout from its start before declaring one dead.
                log.warning("heartbeat failed, retrying: %s", exc)
                pause = self._interval
                continue
            if not ended and self._heard(reply) and self.left:
                return  # its workers left the job: the node does not come back
            pause = max(0.0, self._interval - (time.monotonic() - started))

    def _heard(self, reply: HeartbeatReply) -> bool:
        """Takes a reply in; whether the generation ended."""
        if reply.hang_limit is not None:
            self.limit = reply.hang_limit
        if reply.action != "restart":
            return False
        with self._lock:
            if self.ended is not None:
                return True
            if reply.hung and self._on_hung is not None:
                assignment = self._client.assignment
                if assignment is not None:
                    self._on_hung(assignment.generation, reply.hung)
            if _left_job(self._client):
                # A worker here left the job (a preemption): the agent must not
                # restart it, and waits at the exit barrier for nobody.
                self.left = True
                self.ended = f"node {self._client.node_id} left the job"
            else:
                self.ended = reply.reason or f"generation {reply.generation} followed"
        return True

    def _watch(self) -> None:
        """Beats at once when a worker passes its bound (see the class docstring)."""
        assert self._spec is not None
        spec = self._spec
        if spec.hang_limit is not None and spec.hang_limit.total_seconds() == 0:
            return  # hangs are not judged: nothing to hurry
        phase_limit = spec.phase_limit.total_seconds()
        while not self._stop.wait(_PROGRESS_POLL_S) and self.ended is None:
            said = self._said() or []
            over = [
                p
                for p in said
                if p.idle > (self.limit if p.phase == "train" and self.limit else phase_limit)
                and (p.rank, p.step) not in self._nudged
            ]
            if not over:
                continue
            self._nudged.update((p.rank, p.step) for p in over)
            try:
                reply = self._client.heartbeat(progress=said)
            except RallypointError as exc:
                log.debug("progress beat failed: %s", exc)
                continue
            if self._heard(reply):
                return

    def stop(self) -> None:
        # Not joined: the thread may be inside a held heartbeat for up to an interval,
        # and a rendezvous must not wait for it. Its answer goes nowhere.
        self._stop.set()


class RallypointRendezvousHandler(RendezvousHandler):
    """torchrun's rendezvous through a Rallypoint coordinator.

    Each ``next_rendezvous`` joins the job's next generation and heartbeats for it from
    a thread; ``num_nodes_waiting`` is non-zero as soon as the generation ended, for a
    newcomer or for a member that died or left, so the agent restarts its workers
    within the heartbeat timeout instead of hanging in a collective. Workers inherit
    ``RALLYPOINT_URL``, ``RALLYPOINT_JOB``, ``RALLYPOINT_NODE`` and
    ``RALLYPOINT_GENERATION``: ``ElasticClient.from_env().join()`` in them returns this
    agent's assignment, checkpoint pointer included.

    If every worker of the node regroups in place (``CheckpointManager.generations``;
    they say so on the board, :mod:`._board`), the agent does not restart them: it
    joins the next generation itself, from a thread, and posts the node's new
    assignment on the board, where they pick it up. torchrun keeps its own view of the
    first generation; the workers do not use it. A worker that fails anyway is
    restarted as before (counted in :attr:`fallbacks`), and the node re-joins.

    Args:
        settings: See :class:`RendezvousSettings`.
    """

    def __init__(self, settings: RendezvousSettings) -> None:
        self.settings = settings
        # Backoffs no longer than a heartbeat interval: after a coordinator restart the
        # beats must resume within its grace period (one heartbeat timeout).
        retry = RetryPolicy(maximum=min(timedelta(seconds=1), settings.heartbeat_interval))
        self._client = ElasticClient(
            settings.url,
            settings.job_id,
            settings.node_id,
            settings.token,
            retry=retry,
            # Behind an AzureML endpoint (RALLYPOINT_TRANSPORT=envelope): its key.
            endpoint_key=os.environ.get(ENDPOINT_KEY_ENV) or None,
        )
        self._assignment: Assignment | None = None
        self._beats: _Beats | None = None
        self._closed = False
        self._left = False
        self._board = Board(Path(tempfile.mkdtemp(prefix="rallypoint-regroup-")))
        # Where this node's workers keep their progress records (trainer.health).
        self._progress = self._board.folder / "progress"
        self._progress.mkdir()
        #: Each worker's run delay since its last progress (what its beats call starved).
        self._starvation = Starvation()
        self._store: CoordinatorStore | None = None
        #: The world size of the generation torchrun last rendezvoused in.
        self._agent_world = 0
        self._regroup: threading.Thread | None = None
        self._regroup_failed: str | None = None
        #: Whether the node said that its generation ended (once a generation).
        self._said_ended = False
        # A hot standby's join, which goes on after torchrun started its workers.
        self._hot = threading.Lock()
        self._hot_started = False
        self._hot_result: Assignment | BaseException | None = None
        #: The round a hot standby or hot join parks for, while its workers wait.
        self._hot_round: int | None = None
        #: Its workers exited before it went in: it goes in cold (next_rendezvous).
        self._hot_abandoned = False
        #: A worker of it hung and was stopped: the node joins again hot.
        self._rejoin_hot = False
        self._gate = os.environ.get(START_GATE_ENV) or None
        #: Generations this agent's workers went into in place, and the times its
        #: workers were restarted after regrouping in place had begun (a worker failed).
        self.regroups = 0
        self.fallbacks = 0
        # This node's memory tier (the workers' checkpoint copies): the agent owns it,
        # so it outlives a worker, and goes when the agent does.
        root = os.environ.get(MEMORY_ENV)
        chosen = None if root == OFF else Path(root) if root else default_root()
        self._memory = (
            None if chosen is None else NodeMemory(chosen, settings.job_id, settings.node_id)
        )
        self._replicas: ReplicaServer | None = None
        self._joining = False  # a standby takes copies of the members' files meanwhile
        if self._memory is not None:
            try:
                self._memory.claim()
            except OSError as exc:
                log.warning("rallypoint: no memory tier in %s: %s", chosen, exc)
                self._memory = None
        if self._memory is not None:
            # Other nodes' ranks copy their files here; restarting ranks read them back.
            self._replicas = ReplicaServer(
                self._memory,
                self._client,
                settings.addr,
                lambda: self._assignment.generation if self._assignment else 0,
                lambda: self._joining,
            ).start()
        # torchrun does not call shutdown() when a signal kills the agent; leaving is
        # still right (it is this node's departure, not the job's end).
        atexit.register(self._leave, "agent exited")

    @property
    def assignment(self) -> Assignment | None:
        """The generation this agent runs in, once joined."""
        return self._assignment

    def get_backend(self) -> str:
        """See base class."""
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        """See base class: workers build their own store at the master address."""
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class."""
        if self._closed:
            raise RendezvousClosedError(f"the rendezvous of job {self.settings.job_id} is closed")
        cold: Assignment | None = None
        if self._regroup is not None:
            with self._hot:
                hot = self._hot_round
                self._hot_abandoned = hot is not None
            if hot is not None:
                # A worker exited while the node stood by hot: the node goes in as a
                # cold one, its workers started for the generation it gets. A hot join
                # says it is ready now: its join would wait for an end that nothing
                # else may bring (a standby's waits for a lost slot, as a cold one's).
                log.warning(
                    "rallypoint: a worker of node %s exited while it parked for round %d; "
                    "its workers start again when the node goes in (a script that builds "
                    "its process group before ElasticClient.join() fails at the parked "
                    "node's placeholder master; --rdzv-conf hot_join=0 starts its "
                    "workers only when the node goes in)",
                    self.settings.node_id,
                    hot,
                )
                if self.settings.hot_join:
                    with contextlib.suppress(RallypointError):
                        self._client.ready(hot)
            self._regroup.join()  # a worker failed while the node regrouped in place
            self._regroup = None
            if hot is not None:
                result, self._hot_result = self._hot_result, None
                if isinstance(result, BaseException):
                    raise result
                cold = result
        if self._board.registered():
            # The agent restarts workers that were regrouping in place: one failed (its
            # own log says why), or the node could not regroup.
            self.fallbacks += 1
            log.warning(
                "rallypoint: restarting the workers of node %s instead of regrouping in "
                "place (%d time(s) so far): %s",
                self.settings.node_id,
                self.fallbacks,
                self._regroup_failed or "a worker exited",
            )
            self._board.forget_workers()
        self._regroup_failed = None
        self._stop_beats()
        if self._assignment is not None and _left_job(self._client):
            # Only if the agent restarts its workers for another reason (one failed):
            # this node left the job and must not join it again.
            raise RendezvousClosedError(
                f"node {self.settings.node_id} left job {self.settings.job_id}"
            )
        hot = self.settings.hot_join or (self.settings.hot_standby and self.settings.spec.standbys)
        # A node whose worker hung comes back in as a newcomer, hot: the others train
        # meanwhile (the coordinator does not wait for it), and the generation ends for it
        # only once its new workers are ready.
        again, self._rejoin_hot = self._rejoin_hot, False
        if cold is not None:
            assignment = cold
        elif hot and (self._assignment is None or (again and self.settings.hot_join)):
            parked = self._park_hot()
            if isinstance(parked, RendezvousInfo):
                return parked
            assignment = parked
        else:
            assignment = self._join()
        self._assignment = assignment
        self._said_ended = False
        self._export(assignment)
        self._beats = self._beats_for()
        log.info(
            "rallypoint: generation %d, node rank %d of %d, checkpoint %s",
            assignment.generation,
            assignment.rank,
            assignment.world_size,
            assignment.checkpoint.version if assignment.checkpoint else None,
        )
        store = self._store_of(assignment.generation)
        self._store = store
        self._agent_world = assignment.world_size
        self._board.post(Posted(assignment.generation, ended=False, assignment=assignment))
        return RendezvousInfo(
            store,
            assignment.rank,
            assignment.world_size,
            RendezvousStoreInfo(assignment.master_addr, assignment.master_port),
        )

    def _beats_for(self) -> _Beats:
        """Heartbeats for the generation just joined, with its workers' progress."""
        return _Beats(
            self._client,
            self.settings.heartbeat_interval,
            progress=self._node_progress,
            spec=self.settings.spec,
            on_hung=self._stop_hung,
        )

    def _node_progress(self) -> list[RankProgress]:
        """The progress of this node's workers in its generation (what beats carry)."""
        assignment = self._assignment
        if assignment is None:
            return []
        return read_node(self._progress, assignment.generation, starvation=self._starvation)

    def _stop_hung(self, generation: int, ranks: Sequence[int]) -> None:
        """Takes the stacks of this node's workers of ``ranks``, which the coordinator
        found hung in ``generation``, then stops them (SIGKILL: a stuck process may not
        take SIGTERM), and sends the stacks to the coordinator. Stopping them releases
        their peers from the collectives they wait in with them at once (their
        connections close), rather than at the group's timeout."""
        for record in records(self._progress).values():
            if record.rank not in ranks or record.generation != generation:
                continue
            if not alive(record.pid):
                continue
            taken = take_stacks(record.pid, self._progress)
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGKILL)
            self._rejoin_hot = True
            log.warning(
                "rallypoint: rank %d (pid %d) hung in generation %d; stopped with SIGKILL. "
                "Its stacks (%s):\n%s",
                record.rank,
                record.pid,
                generation,
                taken.tool or taken.error,
                taken.text or f"none: {taken.error}",
            )
            report = StacksReport(
                rank=record.rank,
                pid=record.pid,
                stacks=None if taken.text is None else taken.text[:MAX_STACKS_BYTES],
                error=None if taken.error is None else taken.error[:1000],
                taken_by=None if taken.tool is None else taken.tool[:100],
            )
            threading.Thread(
                target=self._send_stacks,
                args=(generation, report),
                name="rallypoint-stacks",
                daemon=True,
            ).start()

    def _send_stacks(self, generation: int, report: StacksReport) -> None:
        try:
            self._client.report_stacks(generation, report)
        except RallypointError as exc:
            log.warning("rallypoint: could not send rank %d's stacks: %s", report.rank, exc)

    def _park_hot(self) -> RendezvousInfo | Assignment:
        """A hot join's or hot standby's first rendezvous: joins from a thread, and if
        the node parks (and :meth:`_starts_parked`), hands torchrun a one-node world to
        start its workers in at once. They wait in ``ElasticClient.join()`` for the round
        the node parks for (``STANDBY_ROUND_ENV``); the thread goes on waiting too, and
        posts the node's assignment when the node is promoted (:meth:`_promoted`). A node
        that does not park, or parks as a cold standby, gets its assignment."""
        with self._hot:  # a node that parks again (its worker hung) starts afresh
            self._hot_result, self._hot_started, self._hot_abandoned = None, False, False
        self._client.parked_round = None
        joining = threading.Thread(target=self._join_hot, name="rallypoint-standby", daemon=True)
        joining.start()
        while joining.is_alive() and self._client.parked_round is None:
            time.sleep(0.01)
        start = self._client.parked_round is not None and self._starts_parked()
        with self._hot:
            parked = self._client.parked_round
            if self._hot_result is None and parked is not None and start:
                self._hot_started = True
        if not self._hot_started:
            joining.join()
            result = self._hot_result
            if isinstance(result, BaseException):
                raise result
            assert result is not None
            return result
        assert parked is not None
        self._hot_round = parked
        self._regroup = joining  # torchrun's monitor hears of no waiting node meanwhile
        ready = self._ready_folder(parked)
        shutil.rmtree(ready, ignore_errors=True)
        ready.mkdir(parents=True)
        self._export(None, parked, ready)
        if self.settings.hot_join:
            threading.Thread(
                target=self._say_ready,
                args=(parked, ready, joining),
                name="rallypoint-ready",
                daemon=True,
            ).start()
        self._store = self._store_of(0)  # its keys stay here until the promotion
        self._agent_world = 1
        log.info(
            "rallypoint: node %s stands by for round %d; its workers start now and wait",
            self.settings.node_id,
            parked,
        )
        # A placeholder master: the workers' join() sets the real one. Its port is out
        # of range so that nothing can meet at it: a script that builds its process
        # group before join() fails at once (torch's store refuses a port above 65535
        # before it connects), and the node goes in cold (next_rendezvous). Port 0 let
        # such a script's rank 0 bind a free port and, alone on its node, train alone.
        return RendezvousInfo(
            self._store, 0, 1, RendezvousStoreInfo(self.settings.addr, _NO_MASTER_PORT)
        )

    def _ready_folder(self, round: int) -> Path:
        """Where the workers of a node parked for ``round`` mark that they wait."""
        return self._board.folder / f"ready-{round}"

    def _starts_parked(self) -> bool:
        """Whether this node, parked, starts its workers now: always for a hot join (its
        generation ends for it only once they wait); for a standby only with
        ``hot_standby``, else at its promotion, as a cold join's."""
        if self.settings.hot_standby and self.settings.spec.standbys:
            return True
        try:
            job = self._client.membership()
        except RallypointError as exc:
            # Starting them is right either way (a standby's then wait hot): a hot join
            # whose workers did not start would wait for an end nothing brings.
            log.warning("rallypoint: could not read job %s: %s", self.settings.job_id, exc)
            return True
        return not _beside_a_full_generation(job)

    def _join_hot(self) -> None:
        """The hot standby's join (see :meth:`_park_hot`)."""
        try:
            result: Assignment | BaseException = self._join()
        except BaseException as exc:
            result = exc
        with self._hot:
            started = self._hot_started and not self._hot_abandoned
            if not started:
                self._hot_result = result
            round, self._hot_round = self._hot_round, None
        if started:
            if isinstance(result, Assignment):
                assert round is not None
                self._promoted(result, round)
            elif not isinstance(result, SystemExit):
                # Its workers' own waits end the same way: they exit, and torchrun with
                # them. (Released, SystemExit: they exit 0.)
                log.warning("rallypoint: the standby's join failed: %s", result)

    def _say_ready(self, round: int, folder: Path, joining: threading.Thread) -> None:
        """A hot join's wait for its workers: once each has marked that it waits in
        ``ElasticClient.join()`` (a file in ``folder`` holding the node's number of
        workers), tells the coordinator, which ends the running generation for the node.
        Ends with the join (promoted, released or failed) if that comes first."""
        while joining.is_alive():
            marks = list(folder.glob(f"{READY_MARK}*"))
            with contextlib.suppress(OSError, ValueError):
                if marks and len(marks) >= int(marks[0].read_text() or "1"):
                    try:
                        self._client.ready(round)
                    except RallypointError as exc:
                        # Its workers wait either way: the node goes in at the next end.
                        log.warning("rallypoint: could not say node is ready: %s", exc)
                    else:
                        node = self.settings.node_id
                        log.info("rallypoint: node %s ready for round %d", node, round)
                    return
            time.sleep(0.01)

    def _promoted(self, assignment: Assignment, round: int) -> None:
        """A hot standby taken into ``assignment``'s generation (sealed as ``round``): its
        workers, already running, got the same assignment from their own waits."""
        assert self._store is not None
        # torchrun assigned its workers' ranks in this process: their number is there.
        local_world = 1
        with contextlib.suppress(Exception):
            raw = self._store.get(f"{_ROLE_INFO}0")
            local_world = int(json.loads(raw)["local_world_size"])
        self._went_in(assignment, local_world, round)
        log.info(
            "rallypoint: generation %d: standby promoted to node rank %d of %d, checkpoint %s",
            assignment.generation,
            assignment.rank,
            assignment.world_size,
            assignment.checkpoint.version if assignment.checkpoint else None,
        )

    def _join(self) -> Assignment:
        self._joining = True
        try:
            return self._await_assignment()
        finally:
            self._joining = False

    def _await_gate(self) -> None:
        """Waits at the tests' start gate (:data:`START_GATE_ENV`), once."""
        gate, self._gate = self._gate, None
        if gate is None:
            return
        Path(f"{gate}.{self.settings.node_id}").touch()
        deadline = time.monotonic() + _GATE_LIMIT_S
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _await_assignment(self) -> Assignment:
        self._await_gate()
        spec = self.settings.spec
        deadline = time.monotonic() + spec.join_timeout.total_seconds()
        while True:
            left = timedelta(seconds=max(0.0, deadline - time.monotonic()))
            try:
                return self._client.join(
                    self.settings.addr,
                    timeout=left,
                    spec=spec,
                    peer=None if self._replicas is None else self._replicas.url,
                    warm=self.settings.hot_join,
                )
            except JobFull:
                # A running generation has max_nodes members: wait as a spare.
                if time.monotonic() >= deadline:
                    raise RendezvousTimeoutError(
                        f"job {self.settings.job_id} stayed full for {spec.join_timeout}"
                    ) from None
                time.sleep(min(5.0, spec.heartbeat_timeout.total_seconds() / 2))
            except StandbyReleased as exc:
                # The job finished while this node stood by: nothing failed, so the
                # agent exits 0 (torch's own graceful-exit error would end it in an
                # AttributeError in launch_agent, which reads the run's result).
                log.warning("rallypoint: %s; this standby exits", exc)
                raise SystemExit(0) from None
            except JoinTimeout as exc:
                raise RendezvousTimeoutError(str(exc)) from exc
            except TransportError as exc:
                raise RendezvousConnectionError(str(exc)) from exc
            except ServerError as exc:
                raise RendezvousStateError(f"{exc.code}: {exc}") from exc

    def _export(
        self,
        assignment: Assignment | None,
        standby_round: int | None = None,
        ready: Path | None = None,
    ) -> None:
        """The environment workers inherit (the agent starts them after this returns):
        the generation the node joined, or, for a hot standby's workers, the round it
        parks for (they wait for its seal)."""
        values = {
            URL_ENV: self.settings.url,
            JOB_ENV: self.settings.job_id,
            NODE_ENV: self.settings.node_id,
        }
        if assignment is not None:
            values[GENERATION_ENV] = str(assignment.generation)
            unset = [STANDBY_ROUND_ENV, READY_DIR_ENV]
        else:
            values[STANDBY_ROUND_ENV] = str(standby_round)
            values[READY_DIR_ENV] = str(ready)
            unset = [GENERATION_ENV]
        for name in unset:
            os.environ.pop(name, None)
        if self.settings.token:
            values[TOKEN_ENV] = self.settings.token
        if self._client.credential:
            values[CREDENTIAL_ENV] = self._client.credential
        values[MEMORY_ENV] = OFF if self._memory is None else str(self._memory.root)
        values[REGROUP_ENV] = str(self._board.folder)
        values[PROGRESS_ENV] = str(self._progress)
        os.environ.update(values)
        # Warm workers fork from a server started before this generation: they read
        # the variables from this file rather than from an environment that is stale.
        target = os.environ.get(WORKER_ENV_FILE)
        if target:
            partial = f"{target}.{os.getpid()}.tmp"
            # It holds the token and the node's credential: for this user's eyes only.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                # None: unset. The server may have started parked (a hot standby's
                # first workers), with the parked round in its own environment.
                json.dump({**values, **dict.fromkeys(unset)}, f)
            os.replace(partial, target)

    def _publish_ranks(self, assignment: Assignment, local_world: int) -> None:
        """Does this agent's part of torchrun's worker rank assignment in a generation
        it went into in place, for the agents that start workers in it (a node that
        joined): each agent says how many workers it runs, and the agent of node rank 0
        hands out the ranges of global ranks. torchrun's agent does this at every
        rendezvous (``SimpleElasticAgent._assign_worker_ranks``; the keys and the
        format are its own, copied here), and a newcomer's waits for every agent's
        part; this one skipped its rendezvous."""
        store = self._store_of(assignment.generation)
        mine = {"role": _ROLE, "rank": assignment.rank, "local_world_size": local_world}
        try:
            store.set(f"{_ROLE_INFO}{assignment.rank}", json.dumps(mine).encode())
            if assignment.rank != 0:
                return
            infos = [
                json.loads(raw)
                for raw in store.multi_get(
                    [f"{_ROLE_INFO}{i}" for i in range(assignment.world_size)]
                )
            ]
            total = sum(int(info["local_world_size"]) for info in infos)
            keys, values, base = [], [], 0
            for i, info in enumerate(infos):
                keys.append(f"{_ASSIGNED_RANKS}{i}")
                values.append(json.dumps([base, total, base, total]))
                base += int(info["local_world_size"])
            store.multi_set(keys, values)
        except Exception as exc:  # the generation ended first: nobody needs them now
            generation = assignment.generation
            log.debug("rallypoint: ranks of generation %d not published: %s", generation, exc)

    def _store_of(self, generation: int) -> CoordinatorStore:
        """The coordinator's store of ``generation``, whose waits end when it does."""
        return CoordinatorStore(
            self._client,
            generation,
            self.settings.store_timeout,
            abort=self._ended,
            release=self._departed,
        )

    def _departed(self) -> bool:
        beats = self._beats
        return beats is not None and beats.left

    def _ended(self) -> str | None:
        beats = self._beats
        return None if beats is None else beats.ended

    def _stop_beats(self) -> None:
        if self._beats is not None:
            self._beats.stop()
            self._beats = None

    def is_closed(self) -> bool:
        """See base class."""
        return self._closed

    def set_closed(self) -> None:
        """See base class: this agent joins no further generation."""
        self._closed = True

    def num_nodes_waiting(self) -> int:
        """See base class: 1 once this generation ended (a node joined, died or left),
        unless it ended because this node left (its workers are on their way out) or
        its workers regroup in place (the agent joins the next one for them)."""
        if self._regroup is not None and self._regroup.is_alive():
            return 0
        if self._regroup_failed is not None:
            return 1
        beats = self._beats
        if beats is None or beats.ended is None or beats.left:
            return 0
        # A worker here was stopped for a hang (set before ``ended``): the node restarts
        # its workers and comes back hot. torchrun may ask before it reaps the stopped
        # worker; regrouped in place, the node joined cold, sat the round out, and its
        # agent then waited on that join for good (a bench run under load, 2026-12-02).
        if self._rejoin_hot or not self._board.workers_in_place():
            if self._assignment is not None and not self._said_ended:
                # The one line a node says when its generation ends. The workers'
                # collectives may have failed already: the board tells them so, and
                # they wait to be stopped instead of printing a traceback (._quiet).
                generation = self._assignment.generation
                self._board.post(Posted(generation, ended=True, reason=beats.ended))
                log.warning(
                    "rallypoint: generation %d ended: %s; restarting workers",
                    generation,
                    beats.ended,
                )
                self._said_ended = True
            return 1
        self._regroup = threading.Thread(
            target=self._regroup_in_place, args=(beats.ended,), name="rallypoint-regroup"
        )
        self._regroup.start()
        return 0

    def _regroup_in_place(self, reason: str) -> None:
        """Joins the next generation for workers that stay (see the class docstring)."""
        old = self._assignment
        assert old is not None
        self._board.post(Posted(old.generation, ended=True, reason=reason))
        self._stop_beats()
        started = time.monotonic()
        try:
            assignment = self._join()
        except Exception as exc:  # the agent restarts its workers and joins as before
            self._regroup_failed = f"{type(exc).__name__}: {exc}"
            log.warning("rallypoint: could not regroup in place: %s", self._regroup_failed)
            self._board.post(
                Posted(old.generation, ended=True, reason=reason, failed=self._regroup_failed)
            )
            return
        self._went_in(assignment, self._board.local_world_size() or 1)
        self.regroups += 1
        log.info(
            "rallypoint: generation %d in place (%s): node rank %d of %d, checkpoint %s, "
            "joined in %.3f s",
            assignment.generation,
            reason,
            assignment.rank,
            assignment.world_size,
            assignment.checkpoint.version if assignment.checkpoint else None,
            time.monotonic() - started,
        )

    def _went_in(self, assignment: Assignment, local_world: int, parked: int | None = None) -> None:
        """This node is in ``assignment``'s generation while torchrun's agent, unaware,
        keeps the workers it runs (regrouped in place, or a hot standby's, ``parked``
        for that round): the workers hear of it on the board, torchrun's exit barrier
        follows it, and this agent does its part of torchrun's rank assignment for the
        agents that start workers in it."""
        self._assignment = assignment
        if parked is None:
            self._export(assignment)
        else:
            # A parked node's workers may fork only now (the warm server still imports
            # torch), with torchrun's placeholder variables: they must wait for the round,
            # as the others did, for join() to set the generation's (the round sealed,
            # so their wait returns at once). The generation's number alone would let
            # join() return it and leave them with the placeholders.
            self._export(None, parked, self._ready_folder(parked))
        self._beats = self._beats_for()
        if self._store is not None:
            # torchrun's exit barrier runs in the store it was handed, and counts the
            # agents of the generation it knows.
            self._store.follow(assignment.generation, self._agent_world - assignment.world_size)
        self._board.post(
            Posted(
                assignment.generation,
                ended=False,
                assignment=assignment,
                credential=self._client.credential,
            )
        )
        threading.Thread(
            target=self._publish_ranks,
            args=(assignment, local_world),
            name="rallypoint-ranks",
            daemon=True,
        ).start()

    def get_run_id(self) -> str:
        """See base class."""
        return self.settings.job_id

    def shutdown(self) -> bool:
        """See base class: this node leaves the job (the others go on without it), as
        finished if its workers succeeded (the job's standbys are then released)."""
        finished = self._store is not None and self._store.finished
        self._leave(FINISHED if finished else "agent shut down")
        return True

    def _leave(self, reason: str) -> None:
        self._stop_beats()
        shutil.rmtree(self._board.folder, ignore_errors=True)
        if self._replicas is not None:
            self._replicas.stop()
            self._replicas = None
        if self._memory is not None:
            self._memory.remove()
        if self._left or self._assignment is None:
            return
        self._left = True
        try:
            self._client.leave(reason, fenced=False)
        except RallypointError as exc:
            log.warning("could not leave job %s: %s", self.settings.job_id, exc)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun's handler creator for ``--rdzv-backend=rallypoint``."""
    return RallypointRendezvousHandler(RendezvousSettings.from_parameters(params))
