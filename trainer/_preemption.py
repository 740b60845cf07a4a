"""``PreemptionWatcher``: notice that this machine is going, and leave cleanly.

Azure announces a Spot eviction at least 30 s ahead through Scheduled Events (IMDS), and
container platforms send SIGTERM. Either way the job should lose no steps: every rank
agrees at one step boundary, takes an emergency checkpoint, and the departing node leaves
the job, so the others regroup at once instead of after a heartbeat timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Literal, NoReturn

import httpx
import torch
import torch.distributed as dist

from rallypoint.client import ElasticClient, RallypointError
from rallypoint.tls import ssl_context

from . import health

__all__ = ["IMDS_ENV", "RESTART_EXIT_CODE", "VM_NAME_ENV", "Notice", "PreemptionWatcher"]

log = logging.getLogger("rallypoint.trainer")

#: The base URL of the instance metadata service (tests and the demo point it elsewhere).
IMDS_ENV = "RALLYPOINT_IMDS_URL"
#: This VM's name as Scheduled Events spell it; read from IMDS when unset.
VM_NAME_ENV = "RALLYPOINT_VM_NAME"
IMDS_URL = "http://169.254.169.254"
EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
#: The exit status of a process that stops for a membership change, so a supervisor
#: (AzureML, Kubernetes, a shell loop) restarts it (EX_TEMPFAIL: "try again").
RESTART_EXIT_CODE = 75
_SIGTERM_EXIT = 128 + signal.SIGTERM


@dataclass(frozen=True)
class Notice:
    """Why this node is going.

    Attributes:
        kind: ``Preempt`` or ``Terminate`` (a Scheduled Event), or ``SIGTERM``.
        event_id: The Scheduled Event to acknowledge; None for a signal.
        not_before: When Azure will act, as it wrote it (empty for a signal).
        noticed_at: ``time.time()`` when this process noticed.
    """

    kind: Literal["Preempt", "Terminate", "SIGTERM"]
    event_id: str | None
    not_before: str
    noticed_at: float


class PreemptionWatcher:
    """Watches for the end of this machine; the training loop asks at step boundaries.

    One process per node polls Scheduled Events (the one with ``LOCAL_RANK`` 0; IMDS
    allows a few requests a second per VM), every process catches SIGTERM.
    :meth:`should_stop` is a collective, so all ranks stop at the same step::

        watcher = PreemptionWatcher(client)
        with watcher:
            for step in range(start, steps):
                train_step()
                if watcher.should_stop():
                    checkpoints.save(state, step, blocking=True, persist=True)
                    watcher.finish()   # leaves the job or waits for the restart; exits

    Under torchrun a SIGTERM also comes from the agent restarting workers after a
    membership change; the watcher asks the coordinator which it is, and exits at once
    for a restart rather than wait for a step boundary a collective may never reach.

    Args:
        client: The job's client, joined (``ElasticClient.from_env().join()``); without
            one, :meth:`finish` only exits.
        imds_url: The metadata service; defaults to ``RALLYPOINT_IMDS_URL``, else Azure's.
        vm_name: This VM's name in events; defaults to ``RALLYPOINT_VM_NAME``, else asks
            IMDS, else the host name.
        poll_interval: Between Scheduled Events polls.
        grace: After a SIGTERM, how long to wait for a step boundary before exiting
            anyway (Azure gives 30 s; torchrun kills its workers 30 s after SIGTERM).
        poll: Whether this process polls IMDS; defaults to ``LOCAL_RANK`` being 0.
        signals: The signals taken as a notice.
    """

    def __init__(
        self,
        client: ElasticClient | None = None,
        *,
        imds_url: str | None = None,
        vm_name: str | None = None,
        poll_interval: timedelta = timedelta(seconds=0.5),
        grace: timedelta = timedelta(seconds=20),
        poll: bool | None = None,
        signals: tuple[signal.Signals, ...] = (signal.SIGTERM,),
    ) -> None:
        self.client = client
        self.imds_url = (imds_url or os.environ.get(IMDS_ENV) or IMDS_URL).rstrip("/")
        self._vm_name = vm_name or os.environ.get(VM_NAME_ENV)
        self.poll_interval = poll_interval
        self.grace = grace
        self._poll = os.environ.get("LOCAL_RANK", "0") == "0" if poll is None else poll
        self._signals = signals
        self._notice: Notice | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._previous: dict[int, object] = {}
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._old_wakeup_fd = -1
        self.stopping = False
        self._finishing = False

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> PreemptionWatcher:
        """Starts polling and installs the signal handlers (from the main thread)."""
        if self._poll:
            self._spawn(self._poll_events, "rallypoint-imds")
        if threading.current_thread() is threading.main_thread() and self._signals:
            # Python runs signal handlers only when the main thread is back in the
            # interpreter, not while it is stuck in a collective: a wake-up socket lets a
            # thread see the signal at once.
            reader, writer = socket.socketpair()
            reader.setblocking(True)
            writer.setblocking(False)
            self._wakeup = (reader, writer)
            self._old_wakeup_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            for sig in self._signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            self._spawn(self._watch_signals, "rallypoint-signals")
        return self

    def stop(self) -> None:
        """Stops the threads and restores the previous signal handlers."""
        self._stop.set()
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
            self._previous.clear()
            if self._wakeup is not None:
                signal.set_wakeup_fd(self._old_wakeup_fd)
        if self._wakeup is not None:
            with contextlib.suppress(OSError):
                self._wakeup[1].send(b"\0")  # wakes the signal thread to see _stop
        for thread in self._threads:
            thread.join(timeout=5)
        if self._wakeup is not None:
            for sock in self._wakeup:
                sock.close()
            self._wakeup = None

    def __enter__(self) -> PreemptionWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, target: object, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)  # type: ignore[arg-type]
        thread.start()
        self._threads.append(thread)

    # --- noticing -----------------------------------------------------------------------

    @property
    def notice(self) -> Notice | None:
        """This process's notice, if it got one."""
        return self._notice

    def _noticed(self, notice: Notice) -> None:
        with self._lock:
            if self._notice is not None:
                return
            self._notice = notice
        log.warning("rallypoint: %s notice (%s); stopping at the next step", notice.kind, notice)
        if notice.kind == "SIGTERM":
            self._spawn(self._deadline, "rallypoint-grace")

    def _deadline(self) -> None:
        if not self._stop.wait(self.grace.total_seconds()):
            log.error("rallypoint: no step boundary within %s of SIGTERM; exiting", self.grace)
            os._exit(_SIGTERM_EXIT)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # The work happens in _watch_signals, which also runs while this cannot.
        pass

    def _watch_signals(self) -> None:
        assert self._wakeup is not None
        reader = self._wakeup[0]
        while not self._stop.is_set():
            try:
                data = reader.recv(64)
            except OSError:
                return
            for signum in data:
                if signum in self._signals and not self._stop.is_set():
                    self._on_sigterm()

    def _on_sigterm(self) -> None:
        if self._finishing:
            return  # this process is leaving and exits by itself in a moment
        if self.stopping and self._notice is None:
            os._exit(RESTART_EXIT_CODE)  # a survivor waiting for its restart: this is it
        if self._membership_changed():
            # torchrun's agent stops its workers to restart them: the generation is over
            # and any step taken now would be lost. Leave without waiting for the loop.
            log.info("rallypoint: SIGTERM after a membership change; exiting for the restart")
            os._exit(RESTART_EXIT_CODE)
        self._noticed(Notice("SIGTERM", None, "", time.time()))

    def _membership_changed(self) -> bool:
        if self.client is None or self.client.assignment is None:
            return False
        try:
            return self.client.heartbeat().action == "restart"
        except RallypointError:
            return True  # fenced out (stale) or unreachable: nothing to save for anyway

    def vm_name(self) -> str:
        """This VM's name as Scheduled Events name it."""
        if self._vm_name is None:
            try:
                reply = httpx.get(
                    self.imds_url + NAME_PATH,
                    headers={"Metadata": "true"},
                    timeout=2,
                    verify=ssl_context(),
                )
                reply.raise_for_status()
                self._vm_name = reply.text.strip() or socket.gethostname()
            except httpx.HTTPError:
                self._vm_name = socket.gethostname()
        return self._vm_name

    def _poll_events(self) -> None:
        interval = self.poll_interval.total_seconds()
        failures = 0
        with httpx.Client(headers={"Metadata": "true"}, timeout=5, verify=ssl_context()) as http:
            while not self._stop.is_set():
                try:
                    reply = http.get(self.imds_url + EVENTS_PATH)
                    reply.raise_for_status()
                    events = reply.json().get("Events", [])
                    failures = 0
                except (httpx.HTTPError, ValueError, AttributeError) as exc:
                    failures += 1
                    if failures == 1:
                        log.info("rallypoint: Scheduled Events unreachable (%s)", exc)
                    # Off Azure there is nothing to reach: back off to once a minute.
                    self._stop.wait(min(60.0, interval * 2**failures))
                    continue
                for event in events:
                    if self._concerns_me(event):
                        self._noticed(
                            Notice(
                                event["EventType"],
                                str(event.get("EventId")),
                                str(event.get("NotBefore", "")),
                                time.time(),
                            )
                        )
                        return
                self._stop.wait(interval)

    def _concerns_me(self, event: object) -> bool:
        if not isinstance(event, dict) or event.get("EventType") not in ("Preempt", "Terminate"):
            return False
        resources = event.get("Resources") or []
        return isinstance(resources, list) and self.vm_name() in resources

    def acknowledge(self) -> None:
        """Tells Azure this VM is ready to go now (the event starts early)."""
        notice = self._notice
        if notice is None or notice.event_id is None:
            return
        body = {"StartRequests": [{"EventId": notice.event_id}]}
        try:
            httpx.post(
                self.imds_url + EVENTS_PATH,
                json=body,
                headers={"Metadata": "true"},
                timeout=5,
                verify=ssl_context(),
            ).raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("rallypoint: could not acknowledge event %s: %s", notice.event_id, exc)

    # --- the training loop's side -------------------------------------------------------

    def should_stop(self) -> bool:
        """Whether any rank got a notice; every rank gets the same answer.

        A collective (an all-reduce of one integer, and a device sync on GPUs) when a
        process group is up, so call it on every rank at the same steps: every step on
        CPUs, every few steps on GPUs (a 30 s notice leaves time).
        """
        flag = int(self._notice is not None)
        if dist.is_available() and dist.is_initialized():
            device = torch.device("cpu")
            if dist.get_backend() == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            agreed = torch.tensor([flag], dtype=torch.int32, device=device)
            with health.waiting():  # for its peers: if one hangs, it is not this one
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            flag = int(agreed.item())
        if flag:
            self.stopping = True
        return bool(flag)

    def finish(self) -> NoReturn:
        """Ends this process after the emergency checkpoint, on every rank.

        Waits until every rank has saved (a barrier: the version is committed), then
        the node that got the notice leaves the job and acknowledges the event, and
        exits 0; under torchrun, a process that got SIGTERM ends by that signal instead
        (see :func:`_end_by_sigterm`). The others exit :data:`RESTART_EXIT_CODE` for
        their supervisor, or, under torchrun, wait for their agent to restart them at
        the new world size.
        """
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        self.stopping = True
        if self._notice is not None:
            # Leaving ends the generation, and the agent stops its workers at once: the
            # SIGTERM it sends must not cut the acknowledgement short.
            self._finishing = True
            if self.client is not None and os.environ.get("LOCAL_RANK", "0") == "0":
                try:
                    self.client.leave(f"preempted ({self._notice.kind})", fenced=False)
                except RallypointError as exc:
                    log.warning("rallypoint: could not leave the job: %s", exc)
            self.acknowledge()
            self.stop()
            sys.stdout.flush()
            if self._notice.kind == "SIGTERM" and "TORCHELASTIC_RUN_ID" in os.environ:
                _end_by_sigterm()
            os._exit(0)  # not sys.exit: process-group teardown could block on departed peers
        if "TORCHELASTIC_RUN_ID" in os.environ:
            # The agent restarts this worker within a heartbeat interval of the departure;
            # the SIGTERM it sends ends the wait (see _on_sigterm).
            self._stop.wait(self.grace.total_seconds())
        sys.stdout.flush()
        os._exit(RESTART_EXIT_CODE)


def _end_by_sigterm() -> NoReturn:
    """Ends this process as SIGTERM would have, with status 143, once its emergency
    checkpoint is saved.

    Under torchrun, a worker's SIGTERM comes from its agent stopping its workers (for a
    membership change, or because the agent itself was told to stop): the agent waits
    for them to exit and reads nothing they return. A worker that torch started as a
    function (``rallypoint run``'s warm start) and that exits 0 waits for its agent to
    read its result first, so a node stopped with SIGTERM held its agent 30 s, until
    torch's SIGKILL ("Unable to shutdown process ... via 15, forcefully exiting via 9").
    Ended so, the worker is gone at once, however it was started; an agent that did not
    send the signal (someone signalled the worker alone) counts the worker failed and
    restarts it, where after an exit 0 it would wait for it forever.
    """
    os._exit(_SIGTERM_EXIT)
