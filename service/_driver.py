"""One coordinator process's driver: it coalesces the storage work of many requests.

A thousand nodes long-polling for a seal, or heartbeating once a second, must not each
read the job and query the partition. Per job that this process serves, one task:

- refreshes a snapshot of the job entity every ``interval`` (heartbeat replies and
  long-polls read it from memory) and wakes the long-polls when it changes;
- calls :meth:`Rendezvous.tick` (seal an open round, end a generation with a silent
  member) as soon as a join asks and otherwise at least every ``max_tick``;
- writes the heartbeats it received since its last pass as batches of 100, each stamped
  with the time it arrived, and keeps the nodes long-polling here alive the same way;
- reads the job at once, for every request that names a generation newer than the
  snapshot (another replica sealed it since this one's last pass), before any of them is
  answered: behind a balancer that sends each request to the next replica, a node's
  first heartbeat follows the join that sealed its generation by milliseconds.

The driver holds no state that matters: it is rebuilt from storage after a restart, and
any number of replicas may drive the same job, as every write is ETag-conditioned.
Heartbeats are buffered for at most one ``interval`` before they reach storage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import anyio.to_thread
from starlette.types import Receive

from rallypoint.client.models import JobSpec, RankProgress

from . import _seal as seal
from ._rendezvous import Job, Rendezvous
from .errors import StorageError, UnknownJob
from .storage import each_try_within, within

__all__ = ["Driver", "hang_up", "until_changed"]

log = logging.getLogger("rallypoint.driver")

_T = TypeVar("_T")
#: What a queued beat said of its node's processes, as its request parsed it.
_Said = tuple[RankProgress, ...]


async def until_changed(
    changed: asyncio.Future[None], timeout: float, *others: asyncio.Future[None]
) -> None:
    """Waits for the job to change (the future :meth:`Driver.snapshot` gave with it), for
    one of ``others``, or ``timeout`` seconds: the one way a request waits on a job here.

    Ten thousand long-polls wait on the same future, with no task or timer wake-ups of
    their own (polling each held heartbeat four times a second cost 8,000 wake-ups a
    second at 2,048 members and made every reply half a second late). They wait through
    :func:`_waiters_of`'s set, not a done-callback each on ``changed``, as
    ``asyncio.wait`` would add: a wait that times out takes its callback back, and a
    future's callbacks are a list, so that is O(waiters) each, and 10,000 held joins
    timing out cost 1.1 s of CPU (0.06 s for 1,000), a long-poll's timeout O(1) here.
    """
    if changed.done() or any(other.done() for other in others):
        return
    loop = asyncio.get_running_loop()
    mine = loop.create_future()

    def wake(_: object = None) -> None:
        if not mine.done():
            mine.set_result(None)

    waiters = _waiters_of(changed)
    waiters.add(mine)
    timer = loop.call_later(max(0.0, timeout), wake)
    for other in others:  # one per request (its hang-up): its own list
        other.add_done_callback(wake)
    try:
        await mine
    finally:
        timer.cancel()
        waiters.discard(mine)
        for other in others:
            other.remove_done_callback(wake)


#: The futures waiting on each ``changed`` future (:func:`until_changed`), resolved by
#: the one callback it holds; gone with the future.
_WAITERS: weakref.WeakKeyDictionary[asyncio.Future[None], set[asyncio.Future[None]]] = (
    weakref.WeakKeyDictionary()
)


def _waiters_of(changed: asyncio.Future[None]) -> set[asyncio.Future[None]]:
    waiters = _WAITERS.get(changed)
    if waiters is None:
        waiters = _WAITERS[changed] = set()

        def wake_all(_: object, waiters: set[asyncio.Future[None]] = waiters) -> None:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

        changed.add_done_callback(wake_all)
    return waiters


def hang_up(receive: Receive) -> asyncio.Task[None]:
    """A task that ends when the caller of a request whose body was read hangs up (the
    server's ``http.disconnect``): with :func:`until_changed`, what ends a held reply
    early. Cancel it once the reply is made."""

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    return asyncio.ensure_future(watch())


@dataclass
class _Cut:
    """A node's cut heartbeat watch, while its check waits (see :meth:`Driver.dropped`)."""

    generation: int | None  # the held heartbeat's; None for a held join
    at: float  # when the cut was seen (``time.monotonic``)
    since: float  # only a beat that arrived later is the node's return (rendezvous clock)
    # Set when another member's failed collective corroborates the cut (see Driver.fault).
    corroborated: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Released:
    """A member's held heartbeat answered ``continue``: its watch lapses until its next
    beat arrives (see :meth:`Driver.released`)."""

    generation: int
    arrived: float  # when the released beat arrived (the rendezvous clock)
    at: float  # when it was answered (``time.monotonic``)
    awaited: bool = False  # a check of its return is under way


@dataclass
class _JobState:
    """What the driver keeps of one job: its snapshot, the beats queued for the next
    pass, the nodes waiting here, and the task that runs the passes."""

    job: Job | None = None
    read_at: float = 0.0  # when the read that produced ``job`` started
    # Resolved when the job changes, then replaced: a future, not an Event, so that a
    # thousand held requests wait on it with asyncio.wait and no task of their own.
    changed: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    # Each node's queued beat: its generation, when it arrived (see Driver.dropped) and
    # what it said of the node's processes (a beat row's progress, or None).
    beats: dict[str, tuple[int, float, _Said | None]] = field(default_factory=dict)
    dropped: dict[str, _Cut] = field(default_factory=dict)
    # Each generation's reports of failed collectives: member -> when (time.monotonic).
    faults: dict[int, dict[str, float]] = field(default_factory=dict)
    released: dict[str, _Released] = field(default_factory=dict)
    passing: bool = False  # a storage pass is under way
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # ends the wait for a pass
    waiters: Counter[str] = field(default_factory=Counter)
    creating: asyncio.Lock = field(default_factory=asyncio.Lock)
    tick_now: bool = True
    #: A beat asked for the next tick (urgent): it reads the members' progress.
    urgent: bool = False
    failing_since: float | None = None  # the first of the passes failing since
    pass_seconds: float = 0.0  # how long the last storage pass took
    passes: int = 0  # storage passes ended (written or failed)
    last_used: float = field(default_factory=time.monotonic)
    error: BaseException | None = None
    task: asyncio.Task[None] | None = None
    # The read a request naming a generation newer than ``job`` started, and when.
    missed: tuple[float, asyncio.Task[None]] | None = None


class Driver:
    """Drives the jobs this process serves (see module docstring).

    Args:
        rdzv: The domain logic and its storage.
        interval: Seconds between passes: the age of a snapshot, the delay of a beat.
        max_tick: Seconds between ticks at most, which bounds failure detection.
        idle: Seconds without requests after which a job's task stops.
        reconnect: Seconds a node whose heartbeat watch (a held heartbeat, or a held
            join) was cut has to beat again, to which the duration of this process's
            last storage pass is added (a beat through another replica waits for one).
        grace: Seconds that :meth:`snapshot` answers with the last job read while
            storage does not answer: nothing can change a job meanwhile, as nobody can
            write it, so held watches and joins go on through a storage outage (new
            beats are refused meanwhile: see :meth:`failing`).
        on_change: Called with the job's id each time a read shows the job changed (a
            seal, an end, a moved pointer): the status views read it again
            (:meth:`._views.Views.touched`).
    """

    def __init__(
        self,
        rdzv: Rendezvous,
        *,
        interval: float = 0.1,
        max_tick: float = 0.5,
        idle: float = 30.0,
        reconnect: float = 0.25,
        grace: float = 60.0,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        self.rdzv = rdzv
        self.on_change = on_change
        self.interval = interval
        self.max_tick = max_tick
        self.idle = idle
        self.reconnect = reconnect
        self.grace = grace
        self._checks: set[asyncio.Task[None]] = set()
        self._states: dict[str, _JobState] = {}
        self._closing = False

    def _state(self, job_id: str) -> _JobState:
        state = self._states.get(job_id)
        if state is None or state.task is None or state.task.done():
            state = _JobState()
            self._states[job_id] = state
            state.task = asyncio.create_task(self._run(job_id, state), name=f"drive-{job_id}")
        state.last_used = time.monotonic()
        return state

    async def snapshot(
        self, job_id: str, generation: int | None = None
    ) -> tuple[Job, asyncio.Future[None]]:
        """The job as of at most one interval ago, and a future resolved when it changes.

        Args:
            generation: The generation a request names. A snapshot older than it (another
                replica sealed it since this one's last pass) is read again from storage
                first, once for all the requests that miss together, and the read
                becomes the snapshot; a snapshot as new costs nothing more.

        Raises:
            UnknownJob: No such job (or whatever else the last read raised).
            StorageError: Storage has not answered for ``grace`` seconds, or had not
                since this process began to drive the job; or the read on a miss failed.
        """
        state = self._state(job_id)
        await state.ready.wait()
        if state.error is not None and not (
            isinstance(state.error, StorageError)
            and state.job is not None
            and state.failing_since is not None
            and time.monotonic() - state.failing_since < self.grace
        ):
            raise state.error
        assert state.job is not None
        if generation is not None and generation > state.job.generation:
            await self._catch_up(job_id, state, generation)
        return state.job, state.changed

    def failing(self, job_id: str) -> StorageError | None:
        """The error this process's passes for the job fail with while storage does not
        answer it (None once one got through): :meth:`snapshot` still answers, within
        ``grace``, but a request whose worth is a write (a heartbeat) must not be taken
        here then."""
        state = self._states.get(job_id)
        if state is None or state.failing_since is None:
            return None
        return state.error if isinstance(state.error, StorageError) else None

    async def _catch_up(self, job_id: str, state: _JobState, generation: int) -> None:
        """Reads the job for a request that named ``generation``, newer than the snapshot.

        Requests that miss together share a read, but only one that began after they
        arrived: the generation a request names was sealed before it was sent, and a read
        begun earlier may not show it.
        """
        arrived = time.monotonic()
        while state.job is not None and state.job.generation < generation:
            if state.missed is None:
                task = asyncio.ensure_future(self._read_missed(job_id, state, generation))
                # Retrieved here too: the requests awaiting it may all have hung up.
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
                state.missed = (time.monotonic(), task)
            began, task = state.missed
            # Shielded: one waiter hanging up must not cancel the others' read.
            await asyncio.shield(task)
            if began >= arrived:
                return

    async def _read_missed(self, job_id: str, state: _JobState, generation: int) -> None:
        assert state.job is not None
        known, started = state.job, time.monotonic()
        # A heartbeat's storage reads have a third of the heartbeat timeout.
        budget = known.spec.heartbeat_timeout.total_seconds() / 3
        try:
            job = await anyio.to_thread.run_sync(self._read_within, known, generation, budget)
            self._publish(state, job, started)
        finally:
            state.missed = None

    def _read_within(self, known: Job, generation: int, budget: float) -> Job:
        with within(budget):
            return self.rdzv.catch_up(known, generation)

    async def create(self, job_id: str, spec: JobSpec) -> Job:
        """Creates a job that :meth:`snapshot` did not find, once for all the joins that
        found it missing together (a thousand agents starting at once), and publishes it.

        Raises:
            JobConflict: It exists with another spec.
        """
        state = self._state(job_id)
        async with state.creating:
            if state.job is not None and state.error is None:
                return state.job  # created while this join waited for the lock
            started = time.monotonic()
            job, _ = await anyio.to_thread.run_sync(self.rdzv.create_job, job_id, spec)
            state.error = state.failing_since = None  # the pass that found no job is past
            self._publish(state, job, started)
            return job

    def poke(self, job_id: str) -> None:
        """Asks for a tick on the next pass (after a join registered)."""
        self._state(job_id).tick_now = True

    def urgent(self, job_id: str) -> None:
        """Asks for a pass with a tick now, not at the next interval: a beat whose
        progress shows a rank past the hang limit (its write and the tick that judges it
        follow at once)."""
        state = self._state(job_id)
        state.tick_now = True
        state.urgent = True  # and reads the members' progress (Rendezvous.tick)
        state.wake.set()

    async def refresh(self, job_id: str) -> None:
        """Reads the job now and asks for a tick on the next pass.

        Called after a departure through this process, so the next heartbeat here
        already answers ``restart``: read-your-writes on one replica. (Joins only
        :meth:`poke`: their outcome reaches the joiner through the long-poll anyway.)
        """
        self.poke(job_id)
        started = time.monotonic()
        job = await anyio.to_thread.run_sync(self.rdzv.get_job, job_id)
        self._publish(self._state(job_id), job, started)

    async def changed_by(self, job_id: str, change: Callable[[], _T]) -> _T:
        """Runs ``change`` (a write to the job) off the event loop, then :meth:`refresh`:
        this replica's heartbeats answer from the job as it is now (a restart at once).

        Returns:
            What ``change`` returned.
        """
        result = await anyio.to_thread.run_sync(change)
        await self.refresh(job_id)
        return result

    def _publish(self, state: _JobState, job: Job, read_at: float) -> None:
        if read_at < state.read_at:
            return  # a newer read was published while this one was in flight
        state.read_at = read_at
        if state.job is None or job.etag != state.job.etag:
            state.job = job
            if not state.changed.done():
                state.changed.set_result(None)
            state.changed = asyncio.get_running_loop().create_future()
            if self.on_change is not None:
                self.on_change(job.job_id)

    def queue_beat(
        self,
        job_id: str,
        node_id: str,
        generation: int,
        arrived: float,
        progress: Sequence[RankProgress] | None = None,
    ) -> None:
        """Queues a heartbeat that arrived at ``arrived`` (the rendezvous clock, taken as
        the request came in); it is written within one interval, stamped with that time,
        with what it said of the node's processes (``progress``).

        A beat answered late (its request waited on storage) neither replaces a later
        one queued meanwhile nor counts as the return of a node whose watch was cut, or
        lapsed, after it arrived.
        """
        state = self._state(job_id)
        queued = state.beats.get(node_id)
        if queued is None or queued[1] < arrived:
            state.beats[node_id] = (generation, arrived, tuple(progress) if progress else None)
        cut = state.dropped.get(node_id)
        if cut is not None and arrived > cut.since:
            del state.dropped[node_id]
        gap = state.released.get(node_id)
        if gap is not None and arrived > gap.arrived:
            del state.released[node_id]

    def released(self, job_id: str, node_id: str, generation: int, arrived: float) -> None:
        """A member's held heartbeat (arrived at ``arrived``) was answered ``continue``.

        Until its next beat, a few milliseconds later, the node holds no watch here: a
        node that died in that gap cut nothing, and was found only at its heartbeat
        timeout (a bench's kills, timed a step after a generation began, landed there in
        2 to 4 of 25). Where another member of the generation reports a failed
        collective (:meth:`fault`), a node that has not beaten again within the reconnect
        window of its release counts as cut then (:meth:`dropped`, the report
        corroborating it); without a report a slow node only waits longer, as before.
        """
        state = self._state(job_id)
        gap = state.released[node_id] = _Released(generation, arrived, time.monotonic())
        if seal.corroborated(node_id, gap.at, state.faults.get(generation, {}), self.reconnect):
            self._await_return(job_id, state, node_id, gap)

    def _await_return(self, job_id: str, state: _JobState, node_id: str, gap: _Released) -> None:
        """Counts a released member as cut if no beat of it arrives here within the
        reconnect window of its release (see :meth:`released`)."""
        if gap.awaited:
            return
        gap.awaited = True

        async def check() -> None:
            await asyncio.sleep(max(0.0, gap.at + self.reconnect - time.monotonic()))
            if state.released.get(node_id) is gap:  # no beat of it since
                del state.released[node_id]
                self.dropped(job_id, node_id, gap.arrived, generation=gap.generation)

        self._check(check(), f"return-{job_id}-{node_id}")

    def _check(self, check: Coroutine[None, None, None], name: str) -> None:
        """Runs a check as a task of its own, kept until it ends."""
        task = asyncio.create_task(check, name=name)
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    def dropped(
        self, job_id: str, node_id: str, since: float | None = None, *, generation: int | None
    ) -> None:
        """A node's heartbeat watch was cut: its process exited (the kernel closes its
        sockets when a process dies, even by SIGKILL). A live client reconnects at once;
        if no beat of the node arrives here within ``reconnect`` seconds (and this
        process's last storage pass), nor reaches storage through another replica, it
        counts as silent now rather than at the end of its heartbeat timeout. A failed
        collective that another member of its generation reports here (:meth:`fault`)
        ends the wait at once (:func:`._seal.corroborated`).

        Args:
            since: Only a beat that arrived later counts as the node's return: for a
                held heartbeat, the time that beat arrived (a later request is the
                node's; the held beat's own write may reach storage after the cut: a
                node killed within a pass of its beat was found only at the timeout);
                by default now (a held join, whose waits are beaten for by the driver).
            generation: The held heartbeat's generation (None for a held join).
        """
        state = self._state(job_id)
        since = self.rdzv.clock() if since is None else since
        cut = state.dropped[node_id] = _Cut(generation, time.monotonic(), since)
        self._corroborate(state, node_id, cut)
        # The cut request's own beat, not yet written, must not be written after the
        # mark below: a beat's write replaces the mark (a pass taking it now is waited
        # for). It arrived before the cut, so it proves nothing.
        queued = state.beats.get(node_id)
        if queued is not None and queued[1] <= since:
            del state.beats[node_id]
        # A pass under way at the cut may have taken that beat: its write must land first.
        passes = state.passes if state.passing else None

        async def check() -> None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(cut.corroborated.wait(), self.reconnect + state.pass_seconds)
            while (
                passes is not None
                and state.passes <= passes
                and state.task is not None
                and not state.task.done()
            ):
                await asyncio.sleep(self.interval / 4)  # the pass under way at the cut
            if state.dropped.get(node_id) is not cut:
                return  # it beat again here
            del state.dropped[node_id]
            if node_id in state.waiters:
                return  # it waits here again
            if await anyio.to_thread.run_sync(self.rdzv.expire, job_id, node_id, since):
                log.info(
                    "job %s: node %s dropped its heartbeat watch%s",
                    job_id,
                    node_id,
                    " (a peer's collective failed)" if cut.corroborated.is_set() else "",
                )
                # The tick that ends its generation runs now, not at the next pass.
                self.poke(job_id)
                state.wake.set()

        self._check(check(), f"dropped-{job_id}-{node_id}")

    def fault(self, job_id: str, node_id: str, generation: int, detail: str = "") -> int:
        """A member of ``generation`` reports that a collective with its peers failed
        while the generation ran: a watch of another member cut here counts at once
        (:func:`._seal.corroborated`), so the generation ends without the reconnect
        window. Ends nothing by itself: a collective also fails on a bug, and a peer that
        died without closing its sockets is found at its heartbeat timeout.

        Returns:
            How many cut watches it corroborated.
        """
        state = self._state(job_id)
        now = time.monotonic()
        # Only the running generation's reports and releases matter; older ones go.
        for old in [g for g in state.faults if g < generation]:
            del state.faults[old]
        for node in [n for n, gap in state.released.items() if gap.generation < generation]:
            del state.released[node]
        state.faults.setdefault(generation, {})[node_id] = now
        corroborated = 0
        for cut_node, cut in state.dropped.items():
            if cut.generation == generation and self._corroborate(state, cut_node, cut):
                corroborated += 1
                log.info(
                    "job %s: node %s's collective failed in generation %d (%s): node %s's "
                    "cut heartbeat watch counts now",
                    job_id,
                    node_id,
                    generation,
                    detail or "no detail",
                    cut_node,
                )
        for gap_node, gap in list(state.released.items()):
            if gap.generation == generation and gap_node != node_id:
                self._await_return(job_id, state, gap_node, gap)
        return corroborated

    def _corroborate(self, state: _JobState, node_id: str, cut: _Cut) -> bool:
        """Ends the reconnect window of ``node_id``'s cut if the reports of its
        generation corroborate it (:func:`._seal.corroborated`); whether this did."""
        if cut.generation is None or cut.corroborated.is_set():
            return False
        faults = state.faults.get(cut.generation, {})
        if not seal.corroborated(node_id, cut.at, faults, self.reconnect):
            return False
        cut.corroborated.set()
        return True

    @contextlib.contextmanager
    def waiting(self, job_id: str, node_id: str, beat: bool = True) -> Iterator[None]:
        """Marks a node as long-polling here, which keeps its heartbeat fresh.

        Args:
            beat: Write a beat of the node at the next pass (False: the request wrote
                one itself, as a join's registration does).
        """
        state = self._state(job_id)
        state.waiters[node_id] += 1
        # Its first wait here is a beat at once, not at the next waiters' beat: a join
        # that follows a cut one (through any replica) must reach storage within the
        # reconnect window. A join whose registration wrote its first beat has one:
        # another for each of 10,000 joins in a round was 10,000 rows more to write.
        state.dropped.pop(node_id, None)
        if beat and node_id not in state.beats:
            state.beats[node_id] = (0, self.rdzv.clock(), None)
        try:
            yield
        finally:
            state.waiters[node_id] -= 1
            if state.waiters[node_id] <= 0:
                del state.waiters[node_id]

    async def close(self) -> None:
        """Stops every task and wakes every long-poll (which then answers)."""
        self._closing = True
        for state in self._states.values():
            if not state.changed.done():
                state.changed.set_result(None)
            if state.task is not None:
                state.task.cancel()
        for state in self._states.values():
            if state.task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await state.task

    @property
    def closing(self) -> bool:
        return self._closing

    async def _run(self, job_id: str, state: _JobState) -> None:
        next_tick = 0.0
        # A tick reads every waiting node's rows: O(N). While ten thousand joins poke,
        # a tick at every pass kept the process saturated and each tick slower, past its
        # deadline. After a tick that took t seconds, joins' pokes wait t more.
        earliest_poked_tick = 0.0
        next_waiter_beat = 0.0
        while True:
            started = time.monotonic()
            state.wake.clear()
            state.passing = True
            known = state.job
            timeout = known.spec.heartbeat_timeout.total_seconds() if known else 3.0
            # A pass's storage tries get a third of the heartbeat timeout each: a frozen
            # account shows as an error within it, not after the SDK's minutes.
            budget = timeout / 3
            beats, state.beats = state.beats, {}
            try:
                if state.waiters and started >= next_waiter_beat:
                    now = self.rdzv.clock()
                    for node_id in state.waiters:
                        beats.setdefault(node_id, (0, now, None))
                    next_waiter_beat = started + timeout / 3
                tick = (state.tick_now and started >= earliest_poked_tick) or started >= next_tick
                urgent = tick and state.urgent
                if tick:
                    state.tick_now = state.urgent = False
                fresh, wait = await anyio.to_thread.run_sync(
                    self._storage_pass, job_id, beats, tick, budget, urgent
                )
                if tick:
                    now = time.monotonic()
                    earliest_poked_tick = now + (now - started)
                if wait is not None:
                    next_tick = started + min(max(wait, self.interval), self.max_tick)
                job: Job | None = fresh
                if state.failing_since is not None:
                    log.warning(
                        "job %s: storage answers again after %.1f s",
                        job_id,
                        started - state.failing_since,
                    )
                state.error = None
                state.failing_since = None
                state.pass_seconds = time.monotonic() - started
            except Exception as exc:  # storage down, job deleted: report to requests, retry
                if state.failing_since is None:
                    # A job not created yet is what a first join finds (it creates it next):
                    # not worth a warning at every job's start.
                    level = logging.DEBUG if isinstance(exc, UnknownJob) else logging.WARNING
                    log.log(level, "job %s: %s", job_id, exc)
                    state.failing_since = started
                state.error = exc
                job = None
                if isinstance(exc, StorageError):
                    # The beats this pass could not write are written by the next one (a
                    # beat that arrived meanwhile is newer), and the rendezvous learns that
                    # beats it did not see may have been lost (see Rendezvous.storage_lost).
                    state.beats = {**beats, **state.beats}
                    self.rdzv.storage_lost()
            state.passes += 1
            state.passing = False
            if job is not None:
                self._publish(state, job, started)
            state.ready.set()
            if not state.waiters and time.monotonic() - state.last_used > self.idle:
                self._states.pop(job_id, None)
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    state.wake.wait(), max(0.0, self.interval - (time.monotonic() - started))
                )

    def _storage_pass(
        self,
        job_id: str,
        beats: dict[str, tuple[int, float, _Said | None]],
        tick: bool,
        budget: float,
        urgent: bool = False,
    ) -> tuple[Job, float | None]:
        """A pass's storage work, in one worker thread: writes the beats, then ticks (or
        reads the job) and warms the sealed generation's cache.

        Each storage try gets ``budget`` (a frozen account shows as an error within it,
        and the breaker then fails the rest at once), not the pass as a whole: a pass
        writes every member's beat and a tick reads every waiting node's row, so its time
        grows with the job, and at 10,000 nodes on Azurite every pass ran past a budget
        for the whole, failed, and re-queued the same work. The limit starts here, in the
        thread: the wait for a worker thread, behind a thousand joins' own storage calls,
        is not storage being slow.

        Returns:
            The job, and the tick's wait (None without a tick).
        """
        with each_try_within(budget):
            by_generation: dict[int, dict[str, float]] = {}
            said: dict[str, _Said] = {}
            for node_id, (generation, arrived, progress) in beats.items():
                by_generation.setdefault(generation, {})[node_id] = arrived
                if progress is not None:
                    said[node_id] = progress
            # Written here, in the pass's thread, not by the request on the event loop;
            # and the parse goes with it, so this replica's ticks do not parse it again.
            for generation, nodes in by_generation.items():
                self.rdzv.record_beats(job_id, nodes, generation, at=nodes, progress=said)
            wait: float | None = None
            if tick:
                fresh, wait = self.rdzv.tick(job_id, urgent)
            else:
                fresh = self.rdzv.get_job(job_id)
            if fresh.status == "sealed" and self.rdzv.cached(job_id, fresh.generation) is None:
                # Warm the cache before the waiters wake: each needs the members' digest.
                self.rdzv.sealed(job_id, fresh.generation).members_digest  # noqa: B018
        return fresh, wait
