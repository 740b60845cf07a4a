"""What a replica shows of a job: its status, read from storage once for every viewer.

``GET /v1/jobs/{job}``, the job's page and the metrics answer from a view of the job that
this process holds: its status and, while someone looks at the page, the page's
checkpoint versions and hangs. One task per viewed job reads it every ``interval`` (a
second), whatever the number of viewers, and stops once nobody looked for ``linger``
seconds; the view stays for the next look. A request waits on storage only

- at the first look at a job, or the first after its task stopped (the view it kept is
  old), and at the page's first look (its parts were not read);
- after this process changed the job or saw it change (a seal, an end, a departure, a
  commit: :meth:`Views.touched`): it is answered from a read begun after the change, so
  a command's effect shows in the next status (read-your-writes on one replica). Such
  reads come at most every ``min_gap`` seconds, however often the job changes.

Requests that wait share the read under way (single flight); one hanging up cancels
nothing. While storage does not answer, the view stays and its ``age`` grows: the status
answers 200 with what was last read (503 where nothing was). Each replica holds its own
view, as each drives its own jobs (see ``_driver.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field

import anyio.to_thread

from rallypoint.client.models import CheckpointInfo, HangReport, JobStatus, TimelineVersion

from ._checkpoints import Checkpoints
from ._rendezvous import Rendezvous
from .errors import StorageError, StorageUnavailable
from .storage import each_try_within

__all__ = ["Page", "View", "Views", "aged"]

log = logging.getLogger("rallypoint.views")

#: Seconds each storage try of a read may take: a frozen account shows as an error
#: within it (and the breaker fails the read's other calls at once), and a look that
#: waits for a read waits no longer. Not the heartbeat path's budget: nothing is lost
#: by a status that shows an older view.
_TRY = 2.0


def aged(status: JobStatus, now: float) -> JobStatus:
    """``status`` as of ``now`` (the rendezvous clock): the ages that count from the clock
    (``heartbeat_age``, ``waiting_for``) counted on from its ``as_of`` to ``now`` (a view
    read a second ago must not show every heartbeat a second younger than it is), and
    ``age`` the view's own. Members' ``state`` stays as judged at ``as_of``: during a
    storage outage no beat reaches storage, and the coordinator declares nobody dead
    for it (see ``Rendezvous.storage_lost``)."""
    if status.as_of is None:
        return status
    shift = max(0.0, now - status.as_of)

    def older(age: float | None) -> float | None:
        return None if age is None else age + shift

    return status.model_copy(
        update={
            "members": [
                m.model_copy(update={"heartbeat_age": older(m.heartbeat_age)})
                for m in status.members
            ],
            "waiting": [
                w.model_copy(
                    update={
                        "waiting_for": w.waiting_for + shift,
                        "heartbeat_age": older(w.heartbeat_age),
                    }
                )
                for w in status.waiting
            ],
            "age": shift,
        }
    )


@dataclass(frozen=True)
class Page:
    """What a job's page shows beside its status."""

    versions: list[CheckpointInfo]
    collected: list[TimelineVersion]
    hangs: list[HangReport]


@dataclass(frozen=True)
class View:
    """One read of a job: its status and, if the page was wanted, the page's parts."""

    status: JobStatus
    page: Page | None = None


@dataclass
class _Watched:
    """A viewed job: its view, and the task that reads it."""

    view: View | None = None
    error: BaseException | None = None  # the last read's; None once one got through
    failing_since: float | None = None  # the first of the reads failing since
    tried: float = -math.inf  # when the last read, got through or not, began
    due: float = -math.inf  # an answer needs a read begun at or after this
    last_viewed: float = -math.inf
    page_wanted: float = -math.inf
    # Resolved when a read ends, then replaced: the requests waiting for a read share it.
    ended: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # a read now, not at interval
    task: asyncio.Task[None] | None = None


class Views:
    """This process's views of the jobs people look at (see module docstring).

    Args:
        rdzv: Reads a job's status.
        checkpoints: Reads the versions the page shows.
        interval: Seconds between reads of a viewed job.
        linger: Seconds after the last look that a job's reads stop.
        min_gap: Seconds between reads at least, when changes ask for them sooner.
    """

    def __init__(
        self,
        rdzv: Rendezvous,
        checkpoints: Checkpoints,
        *,
        interval: float = 1.0,
        linger: float = 5.0,
        min_gap: float = 0.25,
    ) -> None:
        self.rdzv = rdzv
        self.checkpoints = checkpoints
        self.interval = interval
        self.linger = linger
        self.min_gap = min_gap
        self._watched: dict[str, _Watched] = {}
        self._closing = False

    async def status(self, job_id: str, *, watch: bool = True) -> JobStatus:
        """The job's status from this process's view, aged to now (:func:`aged`).

        Args:
            watch: Keep the view fresh for the next ``linger`` seconds (a viewer, who
                looks again soon). False for a glance (a metrics scrape): the current
                view if the job is watched, else one read, shared with any under way.

        Raises:
            UnknownJob: No such job (as the last read found).
            StorageError: Storage did not answer, and there is no view to show.
        """
        view = await self._view(job_id, page=False, watch=watch)
        return aged(view.status, self.rdzv.clock())

    async def page(self, job_id: str) -> tuple[JobStatus, Page]:
        """The job's status (as :meth:`status`) and what its page shows beside it; the
        page's parts are read with the status while the page is looked at.

        Raises:
            UnknownJob, StorageError: As :meth:`status`.
        """
        view = await self._view(job_id, page=True, watch=True)
        assert view.page is not None
        return aged(view.status, self.rdzv.clock()), view.page

    def touched(self, job_id: str) -> None:
        """The job changed (this process wrote it, or its driver saw it change): the
        next answer comes from a read begun after now, which starts at once (within
        ``min_gap`` of the last). Nothing for a job nobody watches."""
        w = self._watched.get(job_id)
        if w is None or w.task is None or w.task.done():
            return  # the next look reads first anyway (see _watch)
        w.due = time.monotonic()
        w.wake.set()

    async def close(self) -> None:
        """Stops every read; requests still waiting for one get 503."""
        self._closing = True
        for w in self._watched.values():
            if w.task is not None:
                w.task.cancel()
        for w in self._watched.values():
            if w.task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await w.task
            if not w.ended.done():
                w.ended.set_result(None)

    def _watch(self, job_id: str, watch: bool) -> _Watched:
        w = self._watched.get(job_id)
        if w is None:
            w = self._watched[job_id] = _Watched()
        if (w.task is None or w.task.done()) and not self._closing:
            # A view that no task kept fresh is read again before it is shown.
            w.due = time.monotonic()
            w.task = asyncio.create_task(self._run(job_id, w), name=f"view-{job_id}")
        if watch:
            w.last_viewed = time.monotonic()
        return w

    async def _view(self, job_id: str, *, page: bool, watch: bool) -> View:
        w = self._watch(job_id, watch)
        if page:
            w.page_wanted = time.monotonic()
            if w.view is None or w.view.page is None:
                w.due = max(w.due, w.page_wanted)  # the next read reads the page's parts
        while w.tried < w.due:
            if self._closing:
                raise StorageUnavailable("the coordinator is shutting down")
            w.wake.set()
            # asyncio.wait, not await: a request cancelled (its caller hung up) must not
            # cancel the future the others wait on.
            await asyncio.wait({w.ended})
        if w.view is None or (w.error is not None and not isinstance(w.error, StorageError)):
            assert w.error is not None
            raise w.error
        if page and w.view.page is None:
            raise w.error or StorageUnavailable("the page's parts could not be read")
        return w.view

    async def _run(self, job_id: str, w: _Watched) -> None:
        while True:
            began = time.monotonic()
            w.wake.clear()
            page = began - w.page_wanted <= self.linger
            try:
                w.view = await anyio.to_thread.run_sync(self._read, job_id, page)
            except StorageError as exc:
                if w.failing_since is None:
                    log.warning("job %s: its status is the last view read: %s", job_id, exc)
                    w.failing_since = began
                w.error = exc
            except Exception as exc:  # the job is gone (UnknownJob), or a fault: shown as is
                w.view, w.error = None, exc
            else:
                if w.failing_since is not None:
                    log.warning(
                        "job %s: its status is read again after %.1f s",
                        job_id,
                        began - w.failing_since,
                    )
                w.error = w.failing_since = None
            w.tried = began
            ended, w.ended = w.ended, asyncio.get_running_loop().create_future()
            ended.set_result(None)
            if time.monotonic() - w.last_viewed > self.linger:
                if w.view is None and self._watched.get(job_id) is w:
                    del self._watched[job_id]  # nothing to keep (a job id nobody has)
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    w.wake.wait(), max(0.0, began + self.interval - time.monotonic())
                )
            await asyncio.sleep(max(0.0, began + self.min_gap - time.monotonic()))

    def _read(self, job_id: str, page: bool) -> View:
        """One read of the job, in a worker thread."""
        with each_try_within(_TRY):
            status = self.rdzv.status(job_id)
            if not page:
                return View(status)
            return View(
                status,
                Page(
                    self.checkpoints.versions(job_id),
                    self.checkpoints.collected(job_id),
                    self.rdzv.hang_reports(job_id),
                ),
            )
