"""Regrouping in place: a worker that keeps its process across membership changes.

When a node dies or joins, torchrun restarts every worker of every node: new processes
import torch, build the model, connect and load the checkpoint again, seconds per
change. A worker that iterates :func:`generations` (or
:meth:`CheckpointManager.generations <rallypoint.trainer.CheckpointManager.generations>`)
instead stays: for each generation it is part of, the iterator builds the process
group, and the caller builds what depends on it (DDP), restores the named checkpoint
in place and trains until the generation ends. Then:

1. it learns that the generation ended: from its agent's board (:mod:`._board`), which
   the agent's heartbeat watch updates the moment the coordinator ends the generation,
   or, without an agent, from its own heartbeat watch;
2. it leaves the generation's collectives (the training thread's, the background
   save's): an NCCL group is aborted. A gloo group cannot be (``abort()`` does nothing
   in torch 2.13, and destroying it closes nothing while DDP still holds it). Its ranks
   leave together instead, at the step whose :meth:`Generation.check` (an all-reduce
   of each rank's "ended") says so, and each then shuts down its gloo connections
   (:func:`_shut_gloo`), so that a peer still in a collective (one that failed on a
   dead peer's connection) gets an error, which the ``with generation:`` block
   swallows once the generation is known to have ended. A rank still in the block a
   grace after the end shuts them too. A peer that vanished without closing its end
   (a VM gone) is waited for up to the group's ``timeout``;
3. it destroys the process group, and waits for the node's assignment in the next
   generation (the agent joins it, as the same member);
4. it builds the new process group (a TCP store at the new rank 0) and yields it.

Only the workers of a node that died or joins start as processes. Ranks: node rank
times the node's workers plus the local rank, as torchrun numbers them (every node
runs as many workers). A worker that cannot regroup raises: its agent restarts the
node's workers, as before, and counts it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import linecache
import logging
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Protocol

import torch
import torch.distributed as dist

from rallypoint.client import Assignment, ElasticClient, RallypointError

from . import health
from .agent import REGROUP_ENV, Board, Posted
from .errors import GenerationEnded, RegroupError

__all__ = ["Follower", "Generation", "generations"]

log = logging.getLogger("rallypoint.trainer")

#: How often a worker looks at its agent's board (one ``stat``).
_POLL_S = 0.005


class Follower(Protocol):
    """What :func:`generations` moves along from one generation to the next;
    :class:`~rallypoint.trainer.CheckpointManager` is one. Defined here, below the
    manager, so that this module needs nothing of it."""

    def follow(self, assignment: Assignment) -> None:
        """From here on, act for ``assignment``'s generation."""

    def leave_generation(self, timeout: float) -> None:
        """Settle what the ended generation left in flight, within ``timeout`` seconds,
        before its process groups go.

        Raises:
            RegroupError: It could not be settled in time.
        """


class Generation:
    """One generation this process takes part in, its process group built.

    Use it as a context manager around the training of the generation: an exception
    raised in the block once the generation has ended (:class:`GenerationEnded`, or a
    collective that failed because a peer went) ends the block quietly, and the
    iterator moves on to the next generation. Any other exception propagates.

    Attributes:
        number: The generation.
        rank: This process's global rank in it.
        world_size: Its number of processes.
        local_rank: This process's rank on its node.
        assignment: The node's assignment (checkpoint pointer included).
        regrouped: Whether this process came into the generation in place (False for
            the first generation of a process).
        timings: For a generation come into in place, when (``time.time()``) this
            process saw the last one end (``ended``), had left its process group
            (``left``), got the node's new assignment (``assigned``) and had built the
            new group (``grouped``).
    """

    def __init__(
        self,
        assignment: Assignment,
        rank: int,
        world_size: int,
        local_rank: int,
        regrouped: bool,
        ended: threading.Event,
        detect: float,
        report: Callable[[int, str], None] | None = None,
        agree: bool = False,
    ) -> None:
        self.number = assignment.generation
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.assignment = assignment
        self.regrouped = regrouped
        self._ended = ended
        self._detect = detect
        self._report = report
        self.reason = ""
        self.timings: dict[str, float] = {}
        self._ended_at = 0.0
        # Whether check() agrees with the other ranks (gloo, more than one process);
        # when it was last called (time.monotonic()) and the time between the last two
        # calls, for the watcher's grace.
        self._agree = agree and world_size > 1
        self._checked: float | None = None
        self._step_s = 0.0

    @property
    def ended(self) -> bool:
        """Whether the generation ended (a member died or left, or a node joined)."""
        return self._ended.is_set()

    def check(self) -> None:
        """Raises :class:`GenerationEnded` if the generation ended: call it once a step,
        on every rank at the same steps.

        Under gloo it is a collective (an all-reduce of one integer on the generation's
        group): the ranks agree on whether the generation ended, so all of them leave
        at the same step, and none goes on into the next step's collectives once
        another has left. A rank that left at its own next step, as soon as it saw the
        end, could leave a peer inside that step's all-reduce, waiting on it for the
        group's timeout (``bench/gloo_end.py``). Under NCCL it reads a flag: an ended
        generation's communicator is aborted instead.

        Raises:
            GenerationEnded: As named.
        """
        ended = self._ended.is_set()
        now = time.monotonic()
        if self._checked is not None:
            self._step_s = now - self._checked
        self._checked = now
        if self._agree:
            flag = torch.tensor([int(ended)])
            with health.waiting():  # for its peers: if one hangs, it is not this one
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() and not ended:
                # Another rank saw the end first: this one's board shows it within ms.
                ended = self._ended.wait(self._detect) or True
        if ended:
            raise GenerationEnded(f"generation {self.number} ended: {self.reason or 'ended'}")

    def __enter__(self) -> Generation:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is None:
            return False
        if isinstance(exc, GenerationEnded):
            return True
        if not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit: not ours to swallow
        # A collective fails the moment a peer's connection closes, which may come
        # before the coordinator has seen the peer go: give detection its time. The
        # report lets the coordinator count a peer's cut heartbeat watch at once.
        failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if not self._ended.is_set() and self._report is not None:
            self._report(self.number, failed)
        if self._ended.wait(self._detect):
            log.info(
                "rank %d: generation %d ended (%s); left it at: %s",
                self.rank,
                self.number,
                self.reason,
                failed,
            )
            return True
        return False


class _Membership:
    """Where a worker learns of generations: its agent's board, or its own client."""

    def __init__(self, client: ElasticClient) -> None:
        self.client = client
        folder = os.environ.get(REGROUP_ENV)
        self.board = Board(Path(folder)) if folder else None
        self._beats = None
        self._addr: str | None = None
        if self.board is None:
            self._beats = client.heartbeats()
            # Joins again as it joined: at the address the others reached it at.
            me = [m for m in client.members() if m.node_id == client.node_id]
            self._addr = me[0].addr if me else None

    def ended(self, generation: int) -> str | None:
        """Why ``generation`` ended, or None while it runs."""
        if self.board is not None:
            posted = self.board.read()
            if posted is None or posted.generation < generation:
                return None
            if posted.generation > generation:
                return "the node is in a later generation"
            return posted.reason or "ended" if posted.ended else None
        beats = self._beats
        if beats is not None and beats.restart.is_set():
            return "the coordinator ended it"
        if beats is not None and beats.error is not None:
            return f"heartbeats failed: {beats.error}"
        return None

    def next(self, after: int, timeout: float) -> Assignment:
        """The node's assignment in the first generation after ``after``; the client
        follows it (the agent's join got the node a new credential)."""
        if self.board is None:
            if self._beats is not None:
                self._beats.stop()
            self.client.assignment = None
            assignment = self.client.join(self._addr, timeout=timedelta(seconds=timeout))
            self._beats = self.client.heartbeats()
            return assignment
        deadline = time.monotonic() + timeout
        while True:
            posted: Posted | None = self.board.read()
            if posted is not None and posted.failed:
                raise RegroupError(f"the agent could not regroup in place: {posted.failed}")
            if (
                posted is not None
                and posted.generation > after
                and not posted.ended
                and posted.assignment is not None
            ):
                self.client.follow(posted.assignment, posted.credential)
                return posted.assignment
            if time.monotonic() >= deadline:
                raise RegroupError(f"no generation after {after} within {timeout:.0f} s")
            time.sleep(_POLL_S)

    def report(self, generation: int, detail: str) -> None:
        """Reports a failed collective of ``generation`` to the coordinator, from a
        thread of its own: the worker goes on to wait for the generation's end, which
        the report may bring sooner, and a coordinator that is slow to answer must not
        delay it."""

        def send() -> None:
            try:
                self.client.report_fault(detail, generation=generation)
            except RallypointError as exc:  # stale already, or unreachable: nothing lost
                log.debug("fault report for generation %d: %s", generation, exc)

        threading.Thread(target=send, name="rallypoint-fault", daemon=True).start()

    def close(self) -> None:
        if self._beats is not None:
            self._beats.stop()


def generations(
    client: ElasticClient,
    *,
    backend: str | None = None,
    timeout: timedelta = timedelta(seconds=60),
    join_timeout: timedelta = timedelta(minutes=10),
    checkpoints: Follower | None = None,
) -> Iterator[Generation]:
    """The generations this process takes part in, each with its process group built.

    Under a Rallypoint agent (``rallypoint run``, ``torchrun --rdzv-backend=rallypoint``)
    the agent keeps the membership: it joins the next generation for the node and
    tells its workers. Without one, this process is the node: the client heartbeats
    and joins again itself.

    Args:
        client: The node's client, joined.
        backend: ``nccl`` with CUDA, else ``gloo`` (the default picks).
        timeout: The process group's timeout: how long a collective waits for a peer
            that vanished without closing its connections.
        join_timeout: How long to wait for the next generation to seal.
        checkpoints: A manager to move along (its saves of an ended generation are
            waited for and its process groups dropped).

    Yields:
        Each :class:`Generation`; the caller breaks out of the loop when training is
        done.

    Raises:
        ValueError: The client has not joined, or torch.distributed is initialized
            already (the generations build their own process groups).
        RegroupError: The next generation did not come (its agent gave up, or it did
            not seal within ``join_timeout``): the process should exit, and its agent
            restarts it.
    """
    assignment = client.assignment
    if assignment is None:
        raise ValueError("join() the job first")
    if dist.is_initialized():
        raise ValueError(
            "generations() builds the process group of each generation: do not call "
            "torch.distributed.init_process_group yourself"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    membership = _Membership(client)
    if membership.board is not None:
        membership.board.register(local_rank, local_world)
    detect = _detect_s(client)
    regrouped = False
    timings: dict[str, float] = {}
    try:
        while True:
            ended = threading.Event()
            generation = Generation(
                assignment,
                assignment.rank * local_world + local_rank,
                assignment.world_size * local_world,
                local_rank,
                regrouped,
                ended,
                detect=detect,
                report=membership.report,
                agree=backend != "nccl",
            )
            _init_group(generation, backend, timeout)
            if regrouped:
                generation.timings = {**timings, "grouped": time.time()}
            if checkpoints is not None:
                checkpoints.follow(assignment)
            else:
                health.follow(assignment.generation)
            left = threading.Event()  # set once the caller is out of the block
            watcher = threading.Thread(
                target=_watch,
                args=(membership, generation, ended, left),
                name="rallypoint-generation",
                daemon=True,
            )
            watcher.start()
            try:
                yield generation
            finally:
                done = ended.is_set()
                ended.set()  # stops the watcher, if the caller broke out
                left.set()
                watcher.join()
            if not done:
                raise RuntimeError(
                    f"the loop asked for the generation after {generation.number} while "
                    "it still runs: break out of the loop when training is done"
                )
            if backend != "nccl":
                # Out of the generation's collectives: a peer still in one (it failed on
                # another connection, or the block was left on an error) is released.
                closed = _shut_gloo()
                log.debug("rank %d: shut %d gloo connections", generation.rank, closed)
            timings = {"ended": generation._ended_at or time.time()}
            if checkpoints is not None:
                checkpoints.leave_generation(timeout.total_seconds())
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            timings["left"] = time.time()
            _release_memory()
            assignment = membership.next(assignment.generation, join_timeout.total_seconds())
            timings["assigned"] = time.time()
            regrouped = True
            log.info(
                "rank %d: into generation %d in place, %.3f s after the end of %d",
                generation.rank,
                assignment.generation,
                timings["assigned"] - timings["ended"],
                generation.number,
            )
    finally:
        membership.close()


def _watch(
    membership: _Membership, generation: Generation, ended: threading.Event, left: threading.Event
) -> None:
    """Sets ``ended`` when the generation ends. Then an NCCL group is aborted, which a
    dead peer can otherwise leave hanging. A gloo group's connections are shut here
    only if the caller has not left the block within a grace: the ranks leave
    together at a :meth:`Generation.check`, and each shuts its connections once out;
    shutting them while a peer is inside a collective can leave that peer waiting the
    group's timeout (a send gloo had begun writing is not failed). The grace, a second
    and twice the last step, covers callers that do not call ``check()``, and a rank
    held in a collective by a peer that failed and left."""
    while not ended.is_set():
        reason = membership.ended(generation.number)
        if reason is not None:
            generation.reason = reason
            generation._ended_at = time.time()
            ended.set()
            if not dist.is_initialized():
                return
            if dist.get_backend() == "nccl":
                with contextlib.suppress(Exception):
                    dist.group.WORLD.abort()  # type: ignore[union-attr]  # untested here
            elif not left.wait(1.0 + 2 * generation._step_s):
                closed = _shut_gloo()
                log.debug(
                    "rank %d: still in generation %d's block; shut %d gloo connections",
                    generation.rank,
                    generation.number,
                    closed,
                )
            return
        ended.wait(_POLL_S)


def _shut_gloo() -> int:
    """Shuts down this process's gloo connections, both ends' sockets of every pair it
    holds; returns how many.

    ``shutdown`` acts on the connection, not on a descriptor: gloo's own descriptor
    stays open (gloo closes it with its group), and a wait on it ends with an error,
    here and at the peer.

    A gloo connection is a socket with both kernel timeouts set: gloo sets them, to the
    group's timeout, on each end of every pair it connects, and nothing else in a
    worker does (Python's sockets and torch's store wait with ``poll``), so the store's
    and HTTP connections stay up. Each process shuts both ends it holds: a peer that
    failed on another connection and left must release the ranks waiting on it,
    whichever side accepted.
    """
    closed = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:["):
                continue
            # A duplicate: closing it leaves gloo's descriptor as it was.
            with socket.socket(fileno=os.dup(int(name))) as sock:
                if sock.family in (socket.AF_INET, socket.AF_INET6) and _timed(sock):
                    sock.getpeername()  # raises unless connected
                    sock.shutdown(socket.SHUT_RDWR)
                    closed += 1
    return closed


def _timed(sock: socket.socket) -> bool:
    """Whether ``sock`` has both kernel timeouts set (``struct timeval``, not zero)."""
    size = struct.calcsize("ll")
    return all(
        any(struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, option, size)))
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO)
    )


def _detect_s(client: ElasticClient) -> float:
    """How long a failed collective waits to hear that the generation ended: twice the
    job's heartbeat timeout, and a second. A peer's loss is usually known within a
    second (its dropped heartbeat watch), but a node killed before its first heartbeat
    of a generation has no watch to drop, and is found at the timeout (a bench run's
    worker gave up at one timeout, 0.4 s before the end came, and was restarted)."""
    with contextlib.suppress(RallypointError):
        return 2 * client.membership().spec.heartbeat_timeout.total_seconds() + 1.0
    return 21.0


def _await_listener(host: str, port: int, timeout: float) -> None:
    """Waits until rank 0's store listens. torch's store client backs off between
    refused connections, by hundreds of ms once it has failed a few times: a rank that
    got the assignment a few ms before rank 0 lost 0.4-0.7 s to it in a bench run. A
    plain connect every 5 ms costs nothing while rank 0 starts its store."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() >= deadline:
                return  # torch's own connect reports it
            time.sleep(_POLL_S)


def _release_memory() -> None:
    """Gives back what a generation's end left behind, while the coordinator seals the
    next one: the heap's free memory (glibc's ``malloc_trim``; a no-op off glibc) and the
    source lines cached for tracebacks.

    - A generation's teardown frees megabytes (its process group, its DDP's buckets) that
      glibc keeps: in the chaos bench what malloc kept free swung between 6.9 and 20.1 MB
      from one regroup to the next without the trim, and n0's worker's RSS with it.
    - An ended generation's failed collectives format tracebacks (DCP wraps every rank's
      exception with ``traceback.extract_tb``), and ``linecache`` keeps the whole text of
      each file named in one for the life of the process: 0.3 MB in a chaos run's worker,
      found with tracemalloc. It is only a cache: a later traceback reads the file again.
    """
    linecache.clearcache()
    trim = _malloc_trim()
    if trim is not None:
        started = time.perf_counter()
        trim(0)
        log.debug("malloc_trim: %.1f ms", (time.perf_counter() - started) * 1e3)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


#: The ``sys.excepthook`` the last :func:`_one_excepthook` block ended with, and the one it
#: started with: (installed, replaced).
_hooks: tuple[object, object] | None = None


@contextlib.contextmanager
def _one_excepthook() -> Iterator[None]:
    """Around ``dist.init_process_group``: uncaught exceptions keep one ``[rankN]:``
    prefix, the current generation's, however many generations the process saw.

    torch's ``init_process_group`` wraps ``sys.excepthook`` in a hook that prefixes each
    line with the rank, at every call, around whatever hook was there. A process that
    regroups in place calls it once per generation: the chaos bench's worker gained one
    such hook per generation (11 from its 2nd to its 13th), each adding the rank of its
    own generation, which may not be the current one. So the hook the previous block
    left is taken off first (unless something replaced it since).
    """
    global _hooks
    if _hooks is not None and sys.excepthook is _hooks[0]:
        sys.excepthook = _hooks[1]  # type: ignore[assignment]
    before = sys.excepthook
    try:
        yield
    finally:
        _hooks = (sys.excepthook, before) if sys.excepthook is not before else None


def _init_group(generation: Generation, backend: str, timeout: timedelta) -> None:
    """The generation's process group: a TCP store at its rank 0's master address."""
    a = generation.assignment
    if backend == "nccl":
        torch.cuda.set_device(generation.local_rank)
    if generation.rank != 0:
        _await_listener(a.master_addr, a.master_port, timeout.total_seconds())
    with _one_excepthook():
        dist.init_process_group(
            backend,
            init_method=f"tcp://{a.master_addr}:{a.master_port}",
            rank=generation.rank,
            world_size=generation.world_size,
            timeout=timeout,
        )
