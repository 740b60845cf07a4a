"""CheckpointManager: async saves of sharded state to the version the coordinator names.

Saving, on every process (global rank) of the job::

    lay out the copy of this rank's tensors, and schedule it   <- what save() costs
    ---- copy thread (CUDA: a side stream) ----
    copy the tensors into the memory tier's file (else reused buffers); the optimizer's
    next step, a load_state_dict and the next save wait for it (the fence)
    ---- background thread, on a gloo group of its own ----
    dcp.save through RallypointWriter: plan (one copy of each replicated tensor), begin
    the version (fenced), then, once the copy is in, put this rank's file in memory, on
    a peer, in storage, and report it; rank 0 writes DCP's metadata and reports last,
    which commits the version

Loading reads the version this generation resumes from through RallypointReader, in
place into the caller's tensors and DTensors (another mesh, placement or world size
reshards), or, without a template, as the state that was saved.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import pickle
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from rallypoint.client import Assignment, CheckpointInfo, ElasticClient, KeepBest, RallypointError
from rallypoint.closing import Closing

from .._bytes import tensor_bytes
from .._regroup import Generation, generations
from .._worlds import report_world_sizes
from ..agent import generation_end, install_excepthook
from ..errors import (
    CheckpointCorrupt,
    CheckpointError,
    RegroupError,
    StateNotReplicated,
    TransferError,
    WorldSizeError,
)
from ..health import report_steps
from ..memory import NodeMemory
from ._dcp import (
    METADATA,
    RallypointReader,
    RallypointWriter,
    check_metadata,
    global_rank,
)
from ._faults import reached as fault_point
from ._policy import SavePolicy
from ._staging import Staged, StagedPlanner, Staging

__all__ = ["RESERVED", "CheckpointManager", "Restored", "SaveHandle"]

log = logging.getLogger("rallypoint.trainer")

#: The top-level key under which the manager keeps, beside the caller's state, each
#: rank's ``rank_state`` and what DCP's flattening loses (int dict keys, empty dicts).
RESERVED = "__rallypoint__"
_JSON_SCALARS = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class Restored:
    """What :meth:`CheckpointManager.load_latest` restored.

    Attributes:
        version: The checkpoint version.
        step: The training step it was saved at.
        generation: The generation that saved it.
        world_size: The number of processes that saved it (may differ from today's).
        state: The state: the caller's own dict, loaded in place, if one was passed;
            else the state as saved, tensors on the CPU.
        rank_state: This global rank's ``rank_state``; None if no process of this rank
            saved one (the world grew).
        metadata: The ``metadata`` passed to ``save``.
        bytes_from: Bytes read, by source: ``"memory"`` (this node's memory tier),
            ``"peer"`` (another node's) and ``"storage"`` (blob storage, Azure or
            local).
        rank_states: With ``every_rank=True``, every saving rank's ``rank_state`` by
            global rank (DeepSpeed's ZeRO partitions, resharded at another world
            size); else None.
    """

    version: int
    step: int
    generation: int
    world_size: int
    state: Any
    rank_state: Any
    metadata: dict[str, Any] | None
    bytes_from: dict[str, int] = field(default_factory=dict)
    rank_states: dict[int, Any] | None = None


class SaveHandle:
    """A save in flight; :meth:`result` waits for it and raises what it raised.

    Attributes:
        step: The step saved.
        blocked: Seconds ``save()`` took before it returned.
    """

    def __init__(
        self, step: int, future: Future[CheckpointInfo], blocked: float, staged: Staged
    ) -> None:
        self.step = step
        self.blocked = blocked
        self._future = future
        self._staged = staged

    @property
    def waited(self) -> float:
        """Seconds training waited for this save's copy after ``save()`` returned: in the
        fences (the optimizer's step, ``wait_staged()``, the next save). With
        ``overlap=False``, 0: ``blocked`` holds the copy."""
        return self._staged.waited

    @property
    def copy_seconds(self) -> float:
        """How long the copy of the state took (0 until it is done)."""
        return self._staged.copy_seconds

    def staged(self) -> bool:
        """Whether the copy is done: the saved tensors may change without a fence."""
        return self._staged.done()

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        """The version, as this rank's report left it: ``"committed"`` on rank 0 (its
        report is the last), ``"pending"`` or ``"committed"`` elsewhere. Once every rank's
        ``result`` returned, the version is committed.

        Raises:
            StaleGeneration: The generation ended before the save completed; the
                version will never become latest.
            TransferError, CheckpointError: Storage failed after retries.
        """
        return self._future.result(timeout)


def _report_failure(step: int, exc: BaseException) -> None:
    """Logs a save that failed, as an error unless the generation ended under it (a peer
    lost mid-save: the agent says so in one line, and the next generation resumes from
    the last committed version)."""
    reason = generation_end(exc)
    if reason is None:
        log.error("checkpoint of step %d failed: %s", step, exc)
    else:
        log.info("checkpoint of step %d stopped: the generation ended (%s)", step, reason)


class CheckpointManager(Closing):
    """Saves and restores a training process's state through the coordinator.

    Every process of the job (each of torchrun's ``--nproc-per-node`` workers) has its
    own manager and calls :meth:`save` and :meth:`load_latest` with the others. With
    more than one process, ``torch.distributed`` must be initialized before the first
    save; the manager makes a gloo group of its own for the saves in the background.

    Args:
        client: The node's client, joined (its assignment names the generation and the
            checkpoint to resume from).
        assignment: Overrides ``client.assignment``.
        policy: When versions reach blob storage and how a save treats training
            (:class:`SavePolicy`); the same fields may be given one by one instead:
        if_busy, progress, attempts, verify_replicated, persist_every, persist_after,
            overlap, keep_best, keep_last: :class:`SavePolicy`'s fields, when no ``policy`` is
            given (``persist_after`` may be seconds; ``keep_best`` a
            ``(metric, "min"|"max"[, count])`` tuple).
        fence: Modules and optimizers whose state the saves hold: their
            ``load_state_dict`` waits for the copy too (every optimizer's ``step`` and
            ``load_state_dict`` wait anyway, once it has stepped).

    Raises:
        ValueError: The client has not joined and no assignment was given, or a policy
            field is out of range.
        TypeError: Both ``policy`` and some of its fields were given.
    """

    def __init__(
        self,
        client: ElasticClient,
        assignment: Assignment | None = None,
        *,
        policy: SavePolicy | None = None,
        if_busy: Literal["wait", "skip"] | None = None,
        progress: bool | None = None,
        attempts: int | None = None,
        verify_replicated: bool | None = None,
        persist_every: int | None = None,
        persist_after: float | timedelta | None = None,
        overlap: bool | None = None,
        keep_best: KeepBest | tuple[Any, ...] | None = None,
        keep_last: int | None = None,
        fence: Iterable[torch.nn.Module | torch.optim.Optimizer] = (),
    ) -> None:
        fields = {
            "keep_best": keep_best,
            "keep_last": keep_last,
            "if_busy": if_busy,
            "progress": progress,
            "attempts": attempts,
            "verify_replicated": verify_replicated,
            "persist_every": persist_every,
            "persist_after": persist_after,
            "overlap": overlap,
        }
        given: dict[str, Any] = {k: v for k, v in fields.items() if v is not None}
        if policy is not None and given:
            raise TypeError(f"pass either policy= or its fields, not both: {sorted(given)}")
        #: When versions reach blob storage and how a save treats training.
        self.policy = policy if policy is not None else SavePolicy(**given)
        assignment = assignment or client.assignment
        if assignment is None:
            raise ValueError("join() the job first, or pass its assignment")
        self.client = client
        self.assignment = assignment
        self.generation = assignment.generation
        #: This node's memory tier, when a Rallypoint agent runs it.
        self.memory = NodeMemory.from_env(client.job_id, client.node_id)
        # Under the agent, a worker that fails as its generation ends says one line.
        install_excepthook()
        # Into the memory tier's files, else buffers allocated at the first save and
        # reused (pinned for CUDA): fresh memory costs a page fault per 4 KiB on first
        # touch.
        self._staging = Staging(self.memory, lambda: self.rank)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rallypoint-save")
        self._inflight: SaveHandle | None = None
        self._staged: Staged | None = None
        self._group: dist.ProcessGroup | None = None
        self._control: dist.ProcessGroup | None = None
        self._hooks: list[Any] = []
        self._stepped: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        for owner in fence:
            self._watch(owner)
        #: This process's progress, which its node's heartbeats carry (every optimizer's
        #: steps, its saves and loads as phases of their own).
        self.progress = report_steps(client)
        if self.progress.generation != self.generation:
            self.progress.follow(self.generation)

    @property
    def rank(self) -> int:
        """This process's global rank: torch.distributed's, else the node's."""
        return global_rank()[0] if _distributed() else self.assignment.rank

    @property
    def world_size(self) -> int:
        """The job's processes: torch.distributed's world, else the generation's nodes."""
        return global_rank()[1] if _distributed() else self.assignment.world_size

    # --- saving -------------------------------------------------------------------------

    def save(
        self,
        state: Mapping[str, Any],
        step: int,
        *,
        rank_state: Any = None,
        metadata: dict[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
        blocking: bool = False,
        persist: bool = False,
    ) -> SaveHandle | None:
        """Saves ``state`` as the checkpoint of ``step``; every process must call it.

        Returns once the copy of the tensors is scheduled (with ``overlap=False``, once
        it is done; if ``blocking``, once the save is complete). The copy runs while
        training goes on, and the optimizer's next ``step()`` waits for it if it has not
        finished (see :meth:`wait_staged`); the upload runs in the background.

        Args:
            state: The job's state: DTensors of any mesh and placement (FSDP2, tensor
                parallel), tensors replicated on every rank (DDP), optimizer state from
                ``torch.distributed.checkpoint.state_dict.get_state_dict``, and plain
                values, in nested dicts and lists. A plain tensor is saved from one rank:
                one that differs across ranks belongs in ``rank_state``.
            step: The training step; a version becomes latest only if its step is
                newer than the latest's.
            rank_state: This process's own state (RNG states, an iterator position),
                restored to the process of the same global rank.
            metadata: Small JSON values to keep in the manifest (loss, epoch).
            metrics: Numbers the version carries (rank 0's are kept): an evaluation's
                ``eval_loss``, which the policy's ``keep_best`` ranks versions by. A
                value that is not finite is left out (a NaN loss is no candidate for
                best), with a warning.
            blocking: Wait for the upload and the commit.
            persist: Send this version to blob storage whatever ``persist_every``
                says (on a preemption notice: the node's copies are about to go).

        Returns:
            A handle on the save, or None if ``if_busy="skip"`` skipped it.

        Raises:
            TypeError: A value cannot be checkpointed (the message says where), or
                ``metadata`` is not JSON.
            ValueError: ``metadata`` is over its limit.
            StateNotReplicated: With ``verify_replicated``, a plain tensor differs
                across ranks.
            CheckpointError: The job has several processes and torch.distributed is
                not initialized.
            Anything the save raised, if ``blocking``.
        """
        with self.progress.phase("save"):
            return self._save(state, step, rank_state, metadata, metrics, blocking, persist)

    def _save(
        self,
        state: Mapping[str, Any],
        step: int,
        rank_state: Any,
        metadata: dict[str, Any] | None,
        metrics: Mapping[str, float] | None,
        blocking: bool,
        persist: bool,
    ) -> SaveHandle | None:
        rank, world = self.rank, self.world_size
        self._fence()  # the previous copy's buffers or file: it must be done
        busy = self._inflight is not None and not self._inflight.done()
        if self.policy.if_busy == "skip":
            # Every rank must skip alike: a rank that went on would wait in DCP's
            # collectives for the others forever.
            if self._anyone(busy, world):
                log.info("step %d: skipped, the previous save is still running", step)
                return None
        elif busy:
            self._settle()
        started = time.perf_counter()
        if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
            raise TypeError("state must be a dict with str keys")
        if RESERVED in state:
            raise TypeError(f"state must not hold the key {RESERVED!r}: the manager's own")
        fixups = _check(state, "state")
        own = (RESERVED, "rank", str(rank))
        rank_fixups = _check(rank_state, "rank_state", (*own, "state"))
        check_metadata(metadata)
        group = self._save_group(world)
        if self.policy.verify_replicated and group is not None:
            _verify_replicated(state, group)
        mine = {"state": rank_state, "fixups": rank_fixups}
        full = {**state, RESERVED: {"fixups": fixups, "rank": {str(rank): mine}}}
        if self.policy.overlap and not self._hooks:
            # Every optimizer's step waits for the copy (its state, and the parameters
            # it changes, may be in the checkpoint).
            self._hooks.append(register_optimizer_step_pre_hook(self._on_step))
        staged = self._staging.stage(full, overlap=self.policy.overlap)
        self._staged = staged
        blocked = time.perf_counter() - started
        fault_point("staged", step, rank)
        writer = RallypointWriter(
            self.client,
            step,
            generation=self.generation,
            metadata=metadata,
            metrics=_finite(metrics, step) if rank == 0 else None,
            keep_best=self.policy.best,
            keep_last=self.policy.keep_last,
            progress=self.policy.progress,
            attempts=self.policy.attempts,
            memory=self.memory,
            persist=persist,
            persist_every=self.policy.persist_every,
            persist_after=self.policy.persist_after_s,
        )
        future = self._executor.submit(self._persist, staged, writer, group)
        handle = SaveHandle(step, future, blocked, staged)
        self._inflight = handle
        if blocking:
            handle.result()
        return handle

    def _save_group(self, world: int) -> dist.ProcessGroup | None:
        """The group the background saves plan on (None: one process, no collectives).

        Its own gloo group: collectives of the training thread and of the save thread on
        one group could interleave in a different order on different ranks.
        """
        if world == 1:
            return None
        if not _distributed():
            raise CheckpointError(
                f"the job has {world} processes: call torch.distributed.init_process_group "
                "before saving, so that they plan the checkpoint together"
            )
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
            self._control = dist.new_group(backend="gloo")
        return self._group

    def _anyone(self, flag: bool, world: int) -> bool:
        """Whether ``flag`` holds on any rank: a collective of the training thread, on
        a group of its own (the save group may be busy in the background)."""
        if world == 1:
            return flag
        self._save_group(world)
        votes = torch.tensor([int(flag)])
        with self.progress.waiting():  # for its peers: if one hangs, it is not this one
            dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self._control)
        return bool(votes.item())

    def _persist(
        self, staged: Staged, writer: RallypointWriter, group: dist.ProcessGroup | None
    ) -> CheckpointInfo:
        # Imported here: torchrun imports this package (the rendezvous plugin) while
        # torch.distributed.checkpoint is itself half imported.
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        try:
            with _single_process_quiet():
                metadata = dcp_save(
                    staged.state,
                    storage_writer=writer,
                    planner=StagedPlanner(staged),
                    process_group=group,
                    no_dist=group is None,
                )
        except CheckpointException as exc:
            cause = _cause(exc, writer.rank)
            _report_failure(writer.step, cause)
            raise cause from exc
        except Exception as exc:
            _report_failure(writer.step, exc)
            raise
        finally:
            staged.close(self.memory)
        assert writer.info is not None
        fault_point("returned", writer.step, writer.rank)
        if self.memory is not None and writer.version and writer.rank != 0:
            # Every process of the node holds DCP's metadata (dcp.save returned it to
            # each), so a restarted one needs nothing from storage to find its items.
            # (Rank 0 wrote it before its report; the index went before each report.)
            self.memory.write(writer.version, METADATA, [pickle.dumps(metadata)])
        return writer.info

    def wait_staged(self) -> float:
        """Waits until the last save's copy of the state is done: after it, the saved
        tensors may change in any way.

        The manager fences what it can see: every ``torch.optim.Optimizer``'s ``step``
        and ``load_state_dict``, the ``load_state_dict`` of the modules and optimizers
        named in ``fence``, :meth:`load` and the next :meth:`save`. Tensors under
        64 KiB are copied before ``save()`` returns (batch norm's running statistics).
        Code that changes a larger saved tensor some other way before the next
        optimizer step calls this first: an update by hand (an EMA of the weights, a
        ``copy_`` into a parameter), an optimizer that is not a
        ``torch.optim.Optimizer``, a forward pass that changes a large buffer in place.

        Returns:
            The seconds it waited.
        """
        staged = self._staged
        if staged is None:
            return 0.0
        started = time.perf_counter()
        staged.fence()
        with contextlib.suppress(Exception):  # the save raises the copy's errors
            staged.ready()
        return time.perf_counter() - started

    def _fence(self) -> None:
        if self._staged is not None:
            self._staged.fence()

    def _on_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        self._fence()
        if optimizer not in self._stepped:
            self._stepped.add(optimizer)
            self._hooks.append(optimizer.register_load_state_dict_pre_hook(self._on_load))

    def _on_load(self, *args: Any) -> None:
        self._fence()

    def _watch(self, owner: torch.nn.Module | torch.optim.Optimizer) -> None:
        if isinstance(owner, torch.optim.Optimizer):
            self._stepped.add(owner)
            self._hooks.append(owner.register_step_pre_hook(self._on_step))
            self._hooks.append(owner.register_load_state_dict_pre_hook(self._on_load))
        elif isinstance(owner, torch.nn.Module):
            hook = owner.register_load_state_dict_pre_hook
            self._hooks.append(hook(self._on_load))  # type: ignore[no-untyped-call]
        else:
            raise TypeError(f"fence takes modules and optimizers, not a {type(owner).__name__}")

    # --- regrouping in place ------------------------------------------------------------

    def generations(
        self,
        *,
        backend: str | None = None,
        timeout: timedelta = timedelta(seconds=60),
        join_timeout: timedelta = timedelta(minutes=10),
    ) -> Iterator[Generation]:
        """The generations this process takes part in, without restarting it: each
        with its process group built, and this manager moved along (its saves and
        loads are the generation's). See :func:`rallypoint.trainer.generations`.

        Example::

            for generation in checkpoints.generations():
                ddp = DistributedDataParallel(model)  # on the generation's group
                restored = checkpoints.load_latest()  # in place: memory, then peers
                ...
                with generation:  # a membership change ends the block quietly
                    while step < steps:
                        train_step(ddp)
                        generation.check()
                if step >= steps:
                    break

        Raises:
            ValueError, RegroupError: As :func:`~rallypoint.trainer.generations` does.
        """
        return generations(
            self.client,
            backend=backend,
            timeout=timeout,
            join_timeout=join_timeout,
            checkpoints=self,
        )

    def follow(self, assignment: Assignment) -> None:
        """Saves and loads from here on are ``assignment``'s generation's (what
        :meth:`generations` does at each new generation; see
        :class:`~rallypoint.trainer.Follower`)."""
        self.assignment = assignment
        self.generation = assignment.generation
        self.progress.follow(assignment.generation)

    def leave_generation(self, timeout: float) -> None:
        """Settles the saves of a generation that ended, before its groups go: the copy
        must be done (the tensors are about to be loaded over), and the save's thread
        out of its collectives (the coordinator refuses its report, which is right).

        Raises:
            RegroupError: The save in flight did not finish within ``timeout`` seconds.
        """
        with contextlib.suppress(Exception):
            self.wait_staged()
        if self._inflight is not None:
            try:
                self._inflight._future.result(timeout)
            except FuturesTimeout:
                raise RegroupError(
                    f"the save of step {self._inflight.step} did not finish within "
                    f"{timeout:.0f} s of its generation's end"
                ) from None
            except Exception as exc:
                step = self._inflight.step
                log.info("the save of step %d ended with its generation: %s", step, exc)
            self._inflight = None
        self._group = None  # destroyed with the default group
        self._control = None

    def wait(self) -> CheckpointInfo | None:
        """Waits for the save in flight, if any.

        Raises:
            What the save raised.
        """
        if self._inflight is None:
            return None
        with self.progress.phase("save"):
            return self._inflight.result()

    def _settle(self) -> None:
        with contextlib.suppress(Exception):  # logged by _persist; the next save goes on
            self.wait()

    # --- loading ------------------------------------------------------------------------

    def load_latest(
        self, state: dict[str, Any] | None = None, *, every_rank: bool = False
    ) -> Restored | None:
        """Restores the checkpoint this generation resumes from: the one the coordinator
        named when it sealed the generation, the same for every rank, whatever older or
        newer files any cache holds.

        Args:
            state: A state dict to load into, in place: its tensors and DTensors define
                the layout (another mesh, placement or world size than the saver's
                reshards), and each process reads only what its tensors need. Without
                one, the whole state as saved, on the CPU (DDP's replicated state).
            every_rank: Also read every saving rank's ``rank_state`` (its
                ``rank_states``), not only this rank's.

        Returns:
            The restored state, or None if the job has no checkpoint yet.

        Raises:
            CheckpointCorrupt: A file is missing, truncated or fails its checksum.
            CheckpointException: ``state`` asks for what the version does not hold.
            TransferError: Storage failed after retries.
        """
        pointer = self.assignment.checkpoint
        if pointer is None:
            self.progress.resume_at(0)
            return None
        restored = self.load(pointer.version, state, every_rank=every_rank)
        self.progress.resume_at(restored.step)
        return restored

    @contextlib.contextmanager
    def resuming(self, state: dict[str, Any] | None = None) -> Iterator[Restored | None]:
        """Restores this generation's version (:meth:`load_latest`) for the block to load
        into the model, and tells the coordinator if that fails, so a job never loops on
        a load that cannot succeed::

            with checkpoints.resuming() as restored:
                if restored is not None:
                    model.load_state_dict(restored.state["model"])
                    optimizer.load_state_dict(restored.state["optimizer"])

        An exception raised by the block, or by the restore for a reason other than
        storage (a ``state`` the version does not fit), is reported
        (:meth:`report_load_failure`) and raised on: the process exits, the generation
        ends with the error's first line, and after two generations in a row fail so at
        one world size the coordinator waits for a world of another size instead of
        sealing a third. A version no copy of can be read is reported as unreadable by
        :meth:`load` instead, and storage errors not at all (they pass).

        Args:
            state: As for :meth:`load_latest`.

        Yields:
            The restored version, or None if the job has no checkpoint yet.
        """
        with self.loading():
            yield self.load_latest(state)

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Reports what the block raises as a failure to load the version this
        generation was named (:meth:`report_load_failure`), then raises it on: wrap a
        framework's own load of it in this (the integrations do). A version no copy of
        can be read (``CheckpointCorrupt``, reported by :meth:`load` as unreadable) and
        storage errors (``TransferError``) are not reported. A world that cannot split
        the job's global batch (``WorldSizeError``, from the batch planning the
        integrations do in here) is reported as the sizes the job takes
        (:meth:`report_world_sizes`), with or without a version."""
        pointer = self.assignment.checkpoint
        try:
            yield
        except (CheckpointCorrupt, TransferError):
            raise  # the version's copies (reported by load) or storage: not the loader
        except WorldSizeError as exc:
            self.report_world_sizes(exc)  # not the version's fault: the world's
            raise
        except Exception as exc:
            if pointer is not None:
                self.report_load_failure(pointer.version, exc)
            raise

    def report_world_sizes(self, error: WorldSizeError) -> list[int] | None:
        """Tells the coordinator that this generation's world cannot train the job
        (``error``, from :func:`~rallypoint.trainer.plan_batch`) and which sizes can: the
        generation ends, and the coordinator seals only those sizes from then on. A
        hand-written loop calls this where it catches the error (or plans inside
        :meth:`loading`). Never raises (see :func:`~rallypoint.trainer.
        report_world_sizes`).

        Returns:
            The world sizes, in nodes, the job takes now (None: not reported).
        """
        return report_world_sizes(error, self.client, rank=self.rank, generation=self.generation)

    def report_load_failure(self, version: int, error: BaseException | str) -> None:
        """Tells the coordinator that this rank could not load ``version``, the one its
        generation was named (see :meth:`resuming`, which calls this). Never raises: a
        generation that another rank's report ended already, or a coordinator out of
        reach, is logged; the restart that follows asks again.

        Args:
            version: The version that failed to load.
            error: The exception (reported as ``Type: message``) or a message.
        """
        reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        first = reason.strip().splitlines()[0] if reason.strip() else "unknown"
        log.error("could not load checkpoint v%d: %s", version, first)
        try:
            self.client.report_load_failure(
                version, first, rank=self.rank, generation=self.generation
            )
        except RallypointError as exc:
            log.warning("could not report v%d's load failure: %s", version, exc)

    def load(
        self,
        version: int | Literal["latest", "best"],
        state: dict[str, Any] | None = None,
        *,
        every_rank: bool = False,
    ) -> Restored:
        """Restores one version (see :meth:`load_latest`), at any world size: by number,
        the job's authoritative ``"latest"``, or its ``"best"`` (by the ``keep_best`` rule
        it saves under).

        A version that no copy of can be read (every holder the coordinator named and
        blob storage tried) is reported to the coordinator before this raises: it marks
        the version unrecoverable and ends the generation, and the next generation
        resumes from the newest version still recoverable, so a job never loops on a
        checkpoint that cannot load.

        Raises:
            UnknownCheckpoint: No such version (or it was collected), or no best.
            CheckpointCorrupt: A file is missing, truncated or fails its checksum in
                every copy (reported).
            CheckpointError: ``state``'s tensors do not fit what was saved, or the
                version was saved by a release before 0.2 (not reported: the version is
                not at fault).
        """
        self._fence()  # a copy still reading the tensors this loads into
        if not isinstance(version, int):
            version = self.client.checkpoint(version).version
        try:
            with self.progress.phase("load"):
                return self._load(version, state, every_rank)
        except CheckpointCorrupt as exc:
            log.error("checkpoint v%d cannot be loaded: %s", version, exc)
            try:
                self.client.report_unreadable(
                    version, str(exc), rank=self.rank, generation=self.generation
                )
            except RallypointError as report_exc:
                # A generation that ended meanwhile, a coordinator out of reach: the
                # restart that follows asks again, and the next failure reports again.
                log.warning("could not report v%d as unreadable: %s", version, report_exc)
            raise

    def _load(self, version: int, state: dict[str, Any] | None, every_rank: bool) -> Restored:
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        reader = RallypointReader(
            self.client,
            version,
            progress=self.policy.progress,
            attempts=self.policy.attempts,
            memory=self.memory,
        )
        metadata = reader.read_metadata()
        assert reader.summary is not None
        summary = reader.summary
        saved = metadata.state_dict_metadata
        own = f"{RESERVED}.rank.{self.rank}"
        fixups_key = f"{RESERVED}.fixups"
        ranks = f"{RESERVED}.rank." if every_rank else own + "."
        extra = {k: _template(md) for k, md in saved.items() if k == own or k.startswith(ranks)}
        if fixups_key in saved:
            extra[fixups_key] = None
        whole: dict[str, torch.Tensor] = {}
        if state is None:
            names = [k for k in saved if not k.startswith(RESERVED + ".")]
            # Replicated tensors come as views of what was read (nothing copied); the
            # rest (sharded, non-tensor) DCP loads into templates made from the metadata.
            whole = reader.read_whole(names)
            mine = {k: _template(saved[k]) for k in names if k not in whole}
        else:
            if RESERVED in state:
                raise TypeError(f"state must not hold the key {RESERVED!r}")
            mine = dict(state)
        target = {**mine, **extra}
        try:
            # Each process plans its own reads: loading needs no collective.
            with _single_process_quiet():
                dcp_load(target, storage_reader=reader, no_dist=True)
        except CheckpointException as exc:
            raise _cause(exc, 0) from exc
        paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        fixups = target.get(fixups_key) or []
        if state is None:
            restored = _unflatten({**whole, **{k: target[k] for k in mine}}, paths, fixups)
        else:
            for key in state:  # top-level plain values were replaced in the copy
                state[key] = target[key]
            restored = state
        rank_state = None
        if f"{own}.fixups" in target:  # this rank saved a rank_state (None too)
            rank_fixups = target[f"{own}.fixups"] or []
            ranked = _unflatten(
                {k: target[k] for k in extra if k != fixups_key}, paths, rank_fixups
            )
            rank_state = ranked[RESERVED]["rank"][str(self.rank)].get("state")
        rank_states = None
        if every_rank:
            # Each rank's fixups name paths under its own key: together they fix all.
            savers = {k.split(".")[2] for k in extra if k != fixups_key}
            all_fixups = [
                f for r in savers for f in target.get(f"{RESERVED}.rank.{r}.fixups") or []
            ]
            flat = {k: target[k] for k in extra if k != fixups_key}
            by_rank = _unflatten(flat, paths, all_fixups).get(RESERVED, {}).get("rank", {})
            rank_states = {int(r): v.get("state") for r, v in by_rank.items()}
        log.info(
            "restored checkpoint v%d (step %d, saved by %d ranks) as rank %d of %d: "
            "%d bytes from this node's memory, %d from peers', %d from storage",
            summary.version,
            summary.step,
            summary.world_size,
            self.rank,
            self.world_size,
            reader.bytes_from["memory"],
            reader.bytes_from["peer"],
            reader.bytes_from["storage"],
        )
        try:
            self.client.report_restore(
                summary.version, reader.bytes_from, rank=self.rank, generation=self.generation
            )
        except RallypointError as exc:
            # Only the coordinator's metrics miss it: the state is restored already.
            log.debug("could not report the restore of v%d: %s", summary.version, exc)
        return Restored(
            version=summary.version,
            step=summary.step,
            generation=summary.generation,
            world_size=summary.world_size,
            state=restored,
            rank_state=rank_state,
            metadata=summary.metadata,
            bytes_from=dict(reader.bytes_from),
            rank_states=rank_states,
        )

    # --- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Waits for the save in flight, stops the background thread, frees the staging
        buffers and stops reporting this process's progress."""
        self._settle()
        self._executor.shutdown(wait=True)
        self._staging.close()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.progress.close()  # done training: a slow exit is not a hang


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silences DCP's warning that it "assumes" one process: without a group, it is the
    manager's choice, not a guess."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _finite(metrics: Mapping[str, float] | None, step: int) -> dict[str, float] | None:
    """``metrics`` as floats, without the values that are not finite (a NaN loss is no
    candidate for best; the coordinator takes finite values only)."""
    if metrics is None:
        return None
    kept: dict[str, float] = {}
    for name, value in metrics.items():
        number = float(value)
        if math.isfinite(number):
            kept[name] = number
        else:
            log.warning("step %d: metric %r is %s, left out of the version", step, name, number)
    return kept


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _cause(exc: CheckpointException, rank: int) -> BaseException:
    """The error behind DCP's wrapper: this rank's own if it failed, else the first."""
    failures = exc.failures
    if not failures:
        return exc
    chosen = failures.get(rank) or next(iter(failures.values()))
    cause = chosen[0] if isinstance(chosen, tuple) else chosen
    return cause if isinstance(cause, BaseException) else exc


def _check(
    value: Any, where: str, prefix: tuple[str | int, ...] = ()
) -> list[tuple[tuple[str | int, ...], str]]:
    """Refuses what cannot be checkpointed, before a byte is copied or uploaded.

    Returns:
        What DCP's flattening would lose, to be put back on load: the paths (as DCP
        names them, after ``prefix``) of dicts with int keys and of empty dicts.

    Raises:
        TypeError: The message names the offending value's place.
    """
    fixups: list[tuple[tuple[str | int, ...], str]] = []

    def walk(v: Any, path: tuple[str | int, ...], label: str) -> None:
        if isinstance(v, torch.Tensor):
            if not isinstance(v, DTensor) and v.layout != torch.strided:
                raise TypeError(f"{label}: only dense (strided) tensors can be saved")
            if v.is_quantized:
                raise TypeError(f"{label}: quantized tensors cannot be saved")
            return
        if isinstance(v, Mapping):
            keys = list(v)
            if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in keys):
                raise TypeError(f"{label}: dict keys must be str or int")
            if not keys:
                fixups.append((path, "empty"))
            elif any(isinstance(k, int) for k in keys):
                if any(isinstance(k, str) for k in keys):
                    raise TypeError(f"{label}: a dict's keys must be all str or all int")
                fixups.append((path, "int"))
            for k, item in v.items():
                walk(item, (*path, str(k)), f"{label}[{k!r}]")
            return
        if isinstance(v, (list, tuple)):
            for i, item in enumerate(v):
                walk(item, (*path, i), f"{label}[{i}]")
            return
        if not isinstance(v, _JSON_SCALARS):
            raise TypeError(
                f"{label}: cannot checkpoint a {type(v).__name__}; use tensors, DTensors, "
                "dicts, lists, tuples, str, int, float, bool or None"
            )

    walk(value, prefix, where)
    return fixups


def _plain_tensors(value: Any, path: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(value, DTensor):
        return
    if isinstance(value, torch.Tensor):
        out[path] = value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _plain_tensors(v, f"{path}.{k}" if path else str(k), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _plain_tensors(v, f"{path}.{i}", out)


def _verify_replicated(state: Mapping[str, Any], group: dist.ProcessGroup) -> None:
    tensors: dict[str, torch.Tensor] = {}
    _plain_tensors(state, "", tensors)
    digests = {}
    for name, t in tensors.items():
        h = xxhash.xxh3_64()
        h.update(tensor_bytes(t.detach().cpu()))
        digests[name] = (str(t.dtype), tuple(t.shape), h.intdigest())
    gathered: list[dict[str, Any] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, digests, group=group)
    differ = sorted(
        name
        for name in digests
        if len({d[name] for d in gathered if d is not None and name in d}) > 1
    )
    if differ:
        shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
        raise StateNotReplicated(
            f"state holds plain tensors that differ across ranks: {shown}. A plain tensor "
            "is saved from one rank; per-rank values belong in rank_state, sharded ones "
            "in DTensors"
        )


def _template(md: Any) -> Any:
    """An empty value DCP can load the saved item described by ``md`` into."""
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype)
    if isinstance(md, BytesStorageMetadata):
        return None
    raise TypeError(f"unknown item metadata {type(md).__name__}")


def _unflatten(
    flat: dict[str, Any],
    paths: Mapping[str, tuple[str | int, ...]],
    fixups: list[tuple[tuple[str | int, ...], str]],
) -> dict[str, Any]:
    """Rebuilds the nested state DCP flattened (``paths``: its FQN to path mapping), with
    int dict keys and empty dicts put back."""
    nested: dict[str, Any] = {}
    order = [k for k in paths if k in flat] + [k for k in flat if k not in paths]
    for fqn in order:
        path = paths.get(fqn, (fqn,))
        node: Any = nested
        for key, following in itertools.pairwise(path):
            node = _child(node, key, [] if isinstance(following, int) else {})
        _put(node, path[-1], flat[fqn])
    for path, kind in sorted(fixups, key=lambda f: -len(f[0])):
        node = nested
        # A list on the way holds the empty dict (an optimizer with no state yet, in a
        # list of optimizers): an int in a path is a list's index, as above.
        for key, following in itertools.pairwise(path):
            node = _child(node, key, [] if isinstance(following, int) else {})
        if kind == "empty":
            _child(node, path[-1], {})
        else:
            held = _child(node, path[-1], {})
            _put(node, path[-1], {int(k): v for k, v in held.items()})
    return nested


def _child(node: Any, key: str | int, empty: Any) -> Any:
    if isinstance(node, list):
        assert isinstance(key, int)
        node.extend([None] * (key + 1 - len(node)))
        if node[key] is None:
            node[key] = empty
        return node[key]
    return node.setdefault(key, empty)


def _put(node: Any, key: str | int, value: Any) -> None:
    if isinstance(node, list):
        assert isinstance(key, int)
        node.extend([None] * (key + 1 - len(node)))
    node[key] = value
