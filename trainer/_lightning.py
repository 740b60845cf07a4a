"""The Lightning integration: a ``CheckpointIO`` that saves and loads the coordinator's
versions, the strategies that carry it on every rank, the launcher that resumes from the
coordinator (and names its best and latest versions for ``validate``/``test``/``predict``),
the mapping of ``ModelCheckpoint``'s top-k onto the job's ``keep_best`` rule, and the
preemption callback. :mod:`rallypoint.trainer.lightning` exports
them; ``import rallypoint.trainer`` never imports this module or Lightning.

:class:`Session` is the part that knows Rallypoint, not Lightning's classes: one
training process's link to the coordinator, which every rank's ``save``/``load`` goes
through alike (a Lightning checkpoint dict packed by :func:`._pack.pack_checkpoint`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls, has_iterable_dataset
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.progress import _ProcessedTracker
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.data import (
    _get_dataloader_init_args_and_kwargs,
    _update_dataloader,
)
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
)
from typing_extensions import override

from rallypoint.client import Assignment, ElasticClient, KeepBest

from ._batch import BatchPlan, plan_batch
from ._joining import join_first, under_agent
from ._pack import BOOKKEEPING, pack_checkpoint, unpack_checkpoint
from ._preemption import PreemptionWatcher
from ._sampler import ElasticSampler
from .checkpoint import CheckpointManager, Restored, SavePolicy
from .health import phase

__all__ = [
    "RESUME_SCHEME",
    "RallypointCheckpointIO",
    "RallypointDDPStrategy",
    "RallypointModelParallelStrategy",
    "RallypointPreemption",
    "Session",
    "is_resume_path",
    "keep_best_of",
    "version_path",
]

log = logging.getLogger("rallypoint.trainer")


#: The "path" Lightning is given for a coordinator's version: ``rallypoint://JOB/vVERSION``
#: (what ``fit`` resumes from), ``rallypoint://JOB/best`` or ``rallypoint://JOB/latest``
#: (what ``ckpt_path="best"``/``"last"`` of ``validate``/``test``/``predict`` become).
#: Nothing is read from a file of that name; it names the version in Lightning's logs.
RESUME_SCHEME = "rallypoint://"

#: ``KeepBest.count``'s limit: what ``ModelCheckpoint(save_top_k=-1)`` ("all") keeps.
MAX_TOP_K = 100


#: The checkpoint dict's entry for the data position and the job's global batch.
DATA_KEY = "rallypoint_data"


def is_resume_path(path: object) -> bool:
    return str(path).startswith(RESUME_SCHEME)


def version_path(job: str, version: int | Literal["latest", "best"]) -> str:
    """The path Lightning is given for one of ``job``'s versions (:data:`RESUME_SCHEME`)."""
    return f"{RESUME_SCHEME}{job}/{version if isinstance(version, str) else f'v{version}'}"


def _named(path: object) -> int | Literal["latest", "best"]:
    """The version a :func:`version_path` names."""
    name = str(path).rsplit("/", 1)[-1]
    if name in ("latest", "best"):
        return cast(Literal["latest", "best"], name)
    if name.startswith("v") and name[1:].isdigit():
        return int(name[1:])
    raise ValueError(f"{path}: not a version (rallypoint://JOB/vN, /best or /latest)")


def keep_best_of(callbacks: Sequence[object]) -> KeepBest | None:
    """The ``keep_best`` rule a Trainer's first monitoring ``ModelCheckpoint`` asks for:
    its ``monitor``, ``mode`` and ``save_top_k`` (``-1``, all, and anything above
    :data:`MAX_TOP_K` keep :data:`MAX_TOP_K`). None without one, or for ``save_top_k=0``
    (it keeps nothing) or a monitor name the coordinator refuses (logged)."""
    for callback in callbacks:
        if not isinstance(callback, ModelCheckpoint) or callback.monitor is None:
            continue
        if callback.save_top_k == 0:
            return None
        count = callback.save_top_k
        if count < 0 or count > MAX_TOP_K:
            if count > MAX_TOP_K:
                log.warning(
                    "rallypoint: save_top_k=%d: the coordinator pins the %d best", count, MAX_TOP_K
                )
            count = MAX_TOP_K
        try:
            return KeepBest(metric=callback.monitor, mode=callback.mode, count=count)
        except ValueError as exc:  # pydantic's: a name or mode the coordinator refuses
            log.warning(
                "rallypoint: ModelCheckpoint(monitor=%r): no version is pinned: %s",
                callback.monitor,
                exc,
            )
            return None
    return None


class _EpochSampler(ElasticSampler):
    """An :class:`ElasticSampler` whose length also counts the batches of its epoch that
    Lightning's batch counter already holds (``counted``).

    Lightning ends an epoch when its counter reaches the loader's length, and after a
    resume that counter starts at the batches trained before it; a loader whose length
    were only the samples left would end the epoch early. With ``counted`` set to the
    counter, ``len(loader)`` is the counter plus the batches left to yield.
    """

    def __init__(
        self,
        length: int,
        *,
        rank: int,
        world_size: int,
        shuffle: bool,
        seed: int,
        batch_size: int,
    ) -> None:
        super().__init__(
            length,
            rank=rank,
            world_size=world_size,
            shuffle=shuffle,
            seed=seed,
            batch_size=batch_size,
        )
        self.batch_size = batch_size
        self.world_size = world_size
        self.length = length
        #: Batches of this epoch Lightning counted before this sampler's first sample.
        self.counted = 0

    @override
    def __len__(self) -> int:
        return self.counted * self.batch_size + super().__len__()

    @override
    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.counted = 0
        super().set_epoch(epoch)

    def consumed_after(self, batches: int, *, accumulation: int, last: bool) -> int:
        """Samples of this epoch trained, all ranks together, once Lightning's counter
        reads ``batches``: only those that went into an optimizer step count.

        Args:
            batches: Lightning's batch counter in this epoch (``current.ready``).
            accumulation: Batches per optimizer step.
            last: Whether the counter's batch was the epoch's last (Lightning steps on it
                whatever the accumulation).
        """
        if last:
            return self.length
        stepped = batches - batches % accumulation
        trained = max(0, stepped - self.counted) * self.batch_size * self.world_size
        return min(self.length, self.consumed + trained)


def resume_position(
    saved: dict[str, Any], *, length: int, epoch: int, per_batch: int
) -> tuple[int, int, int | None]:
    """Where a resumed epoch starts, from a saved sampler state.

    Args:
        saved: :meth:`ElasticSampler.state_dict` as the save recorded it.
        length: The dataset's length.
        epoch: The epoch Lightning's restored progress says it trains next.
        per_batch: Samples one batch of every rank holds at this world size.

    Returns:
        ``(epoch, consumed, counted)``: the sampler's position, and the batches of the
        epoch Lightning's counter should hold, or None where the saved epoch is over
        (the counter then reads a whole epoch, as Lightning's own end-of-epoch saves do).
    """
    if saved["consumed"] >= length or epoch > saved["epoch"]:
        return max(epoch, saved["epoch"] + 1), 0, None
    return saved["epoch"], saved["consumed"], saved["consumed"] // per_batch


class Session:
    """One training process's link to the coordinator, made when first needed (Lightning
    builds its strategies before torchrun's environment is read).

    Args:
        client: The node's client; defaults to ``ElasticClient.from_env()``, joined.
        policy: How versions are saved (:class:`SavePolicy`); transfers show no progress
            by default.
    """

    def __init__(
        self,
        client: ElasticClient | None = None,
        *,
        policy: SavePolicy | None = None,
    ) -> None:
        self._client = client
        self._manager: CheckpointManager | None = None
        self._reader: CheckpointManager | None = None
        # Lightning draws its own progress; transfers stay quiet unless asked.
        self.policy = policy if policy is not None else SavePolicy(progress=False)
        #: What the last load restored (its ``state`` dropped), for reports.
        self.restored: Restored | None = None
        #: What the last load of a named version (``validate``/``test``/``predict``'s
        #: ``ckpt_path``) read, its ``state`` dropped.
        self.loaded: Restored | None = None
        #: The data position and global batch the last load restored (``DATA_KEY``).
        self.data: dict[str, Any] | None = None
        self._saved: tuple[int, bool] | None = None
        self._resumed = False  # whether the last load was this generation's version

    @property
    def client(self) -> ElasticClient:
        client = self.unjoined
        if client.assignment is None:
            client.join()  # under torchrun: the agent's assignment, no new round
        return client

    def join_first(self, *, fitting: bool) -> None:
        """Joins before the strategy builds its process group, which Lightning builds
        from torchrun's variables (``setup_environment``): a worker of a node that parks
        (a hot join) waits here until the node goes in, with the variables then its
        assignment's; any other worker of an agent takes the agent's assignment, no
        round. A process that is no agent's worker joins only to ``fit``: an evaluation
        in it must not start a round."""
        if fitting or under_agent():
            join_first(self.unjoined)

    @property
    def unjoined(self) -> ElasticClient:
        """The client, joined or not (naming a version needs no membership)."""
        if self._client is None:
            self._client = ElasticClient.from_env()
        return self._client

    @property
    def manager(self) -> CheckpointManager:
        if self._manager is None:
            self._manager = CheckpointManager(self.client, policy=self.policy)
        return self._manager

    def keep_best(self, rule: KeepBest | None) -> None:
        """Saves from now on ask the coordinator to keep the best versions by ``rule``
        (a ``ModelCheckpoint``'s top-k), unless the policy names a rule of its own."""
        if rule is None or self.policy.best == rule:
            return
        if self.policy.best is not None:
            log.info("rallypoint: keep_best=%s of the policy, not %s", self.policy.best, rule)
            return
        self.policy = self.policy.replace(keep_best=rule)
        if self._manager is not None:  # made for the launcher's resume before setup
            self._manager.policy = self.policy
        log.info(
            "rallypoint: the coordinator keeps the %d best version(s) by %s (%s)",
            rule.count,
            rule.metric,
            rule.mode,
        )

    def loading(self) -> contextlib.AbstractContextManager[None]:
        """:meth:`CheckpointManager.loading` once this process restored a version (what
        fails in the block is reported against it); else nothing: a fresh start, a
        strategy that never joined, or a named version loaded for evaluation (no
        generation was named it) has no version to report on."""
        if not self._resumed or self._manager is None:
            return contextlib.nullcontext()
        return self._manager.loading()

    def resume_path(self) -> str | None:
        """The version the coordinator named for this generation, as a path for
        Lightning; None if the job has no checkpoint yet."""
        pointer = self.manager.assignment.checkpoint
        if pointer is None:
            return None
        return version_path(self.client.job_id, pointer.version)

    def save(
        self,
        checkpoint: dict[str, Any],
        path: object,
        *,
        persist: bool = False,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        """Saves Lightning's checkpoint dict as the version of its ``global_step``, with
        ``metrics`` (what ``keep_best`` ranks it by); every rank calls it. Returns once
        the tensors are staged."""
        step = int(checkpoint.get("global_step", 0))
        if self._saved is not None and self._saved[0] == step and (self._saved[1] or not persist):
            # ModelCheckpoint saves the same step twice (top-k, then "last"), and a
            # version becomes latest only if its step is newer: one version per step.
            log.debug("step %d is saved already (as %s)", step, path)
            return
        metadata = {"epoch": int(checkpoint.get("epoch", 0)), "path": str(path)}
        self.manager.save(
            pack_checkpoint(checkpoint),
            step,
            rank_state={"torch_rng": torch.get_rng_state()},
            metadata=metadata,
            metrics=metrics or None,
            persist=persist,
        )
        self._saved = (step, persist)

    def load(
        self,
        path: object,
        template: dict[str, Any] | None = None,
        *,
        weights_only: bool | None = None,
        apply: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Loads the version ``path`` names (:func:`version_path`): ``best`` or
        ``latest``, or a number other than this generation's, as they are now (for
        evaluation); else the version this generation resumes from, whatever ``path``
        says.

        Args:
            path: What Lightning was given (logged if it is not the coordinator's).
            template: The tensors to load into, in place (sharded state): ``state_dict``
                and ``optimizer_states`` as :func:`pack` shapes them.
            weights_only: Lightning's, for the bookkeeping.
            apply: Called with the loaded tensors before the bookkeeping is unpacked.

        Returns:
            Lightning's checkpoint dict, with a ``"rallypoint"`` entry saying what was
            restored (version, step, bytes by source).
        """
        if template is not None:
            template = {**template, BOOKKEEPING: ""}
        named = self._evaluated(path)
        if named is not None:
            return self._load_named(named, template, weights_only, apply)
        expected = self.resume_path()
        if expected is None:
            raise FileNotFoundError(f"{path}: the coordinator names no checkpoint to resume from")
        if str(path) != expected:
            log.warning("loading %s, the coordinator's version, not %s", expected, path)
        # What fails here is reported: a load that cannot succeed at this world size
        # ends the generation with its reason instead of restarting forever.
        with self.manager.loading():
            restored = self.manager.load_latest(template)
            assert restored is not None
            state: dict[str, Any] = restored.state
            if apply is not None:
                apply(state)
            if isinstance(restored.rank_state, dict) and "torch_rng" in restored.rank_state:
                torch.set_rng_state(restored.rank_state["torch_rng"])
            checkpoint = unpack_checkpoint(state, weights_only)
        checkpoint["rallypoint"] = _report(restored)
        self.restored = dataclasses.replace(restored, state=None)
        self._resumed = True
        self.data = checkpoint.get(DATA_KEY)
        # A step to resume from: nothing saved since is this generation's yet.
        self._saved = (restored.step, True)
        return checkpoint

    def _evaluated(self, path: object) -> int | Literal["latest", "best"] | None:
        """The version ``path`` names for evaluation; None for this generation's own."""
        if not is_resume_path(path):
            return None
        named = _named(path)
        if isinstance(named, str):
            return named
        # A number: this generation's (a resume) only in a process that joined for it;
        # an evaluation process must not join (that would start a new round).
        client = self.unjoined
        pointer = client.assignment.checkpoint if client.assignment is not None else None
        return None if pointer is not None and pointer.version == named else named

    def _load_named(
        self,
        version: int | Literal["latest", "best"],
        template: dict[str, Any] | None,
        weights_only: bool | None,
        apply: Callable[[dict[str, Any]], None] | None,
    ) -> dict[str, Any]:
        # Every rank resolves the name itself: nothing saves meanwhile (fit waited for
        # its saves), so all read one version.
        restored = self.reader.load(version, template)
        state: dict[str, Any] = restored.state
        if apply is not None:
            apply(state)
        # Neither the RNG nor the data position: an evaluation resumes nothing.
        checkpoint = unpack_checkpoint(state, weights_only)
        checkpoint["rallypoint"] = _report(restored)
        self.loaded = dataclasses.replace(restored, state=None)
        self._resumed = False
        log.info("rallypoint: loaded %s: v%d (step %d)", version, restored.version, restored.step)
        return checkpoint

    @property
    def reader(self) -> CheckpointManager:
        """The manager to load a named version with: this process's once its client
        joined; else one of its own on a detached assignment. An evaluation process is
        no member of the job's generations (joining would start a round), and loading
        a version needs none: its reports (restores, unreadable copies) are refused and
        logged instead."""
        if self._manager is not None:
            return self._manager
        client = self.unjoined
        if client.assignment is not None:
            return self.manager
        if self._reader is None:
            detached = Assignment(
                job_id=client.job_id,
                node_id=client.node_id,
                generation=1,
                rank=0,
                world_size=1,
                master_addr="",
                master_port=0,
            )
            self._reader = CheckpointManager(client, detached, policy=self.policy)
        return self._reader

    def wait(self) -> None:
        if self._manager is not None:
            self._manager.wait()


def _report(restored: Restored) -> dict[str, Any]:
    """The checkpoint dict's ``"rallypoint"`` entry: what was restored, from where."""
    return {
        "version": restored.version,
        "step": restored.step,
        "generation": restored.generation,
        "saved_by": restored.world_size,
        "bytes_from": dict(restored.bytes_from),
    }


class _CoordinatorKeeps:
    """What the checkpoint I/O and the model-parallel strategy (which saves without one)
    do alike: leave removing versions to the coordinator, and wait at teardown for the
    save in flight. Listed first among a class's bases, so that its teardown runs the
    Lightning base's after its own."""

    session: Session

    def remove_checkpoint(self, path: _PATH) -> None:
        # Versions are the coordinator's to collect (its retention), not ModelCheckpoint's
        # top-k: one still named for a restart must not go.
        log.debug("not removing %s: the coordinator keeps versions", path)

    def teardown(self) -> None:
        self.session.wait()
        super().teardown()  # type: ignore[misc]  # the Lightning base's, next in the MRO


class RallypointCheckpointIO(_CoordinatorKeeps, CheckpointIO):
    """Lightning's checkpoint file I/O, replaced by the coordinator's versions.

    :class:`RallypointDDPStrategy` carries one and calls it on every rank (Lightning's own
    strategies call ``CheckpointIO`` on rank 0 only, and a DCP save is a collective).

    Args:
        client: The node's client; defaults to ``ElasticClient.from_env()``, joined.
        policy: How versions are saved (:class:`~rallypoint.trainer.SavePolicy`: e.g.
            ``persist_every``, the Nth version that also goes to blob storage while the
            rest stay in nodes' memory and their peers').
    """

    def __init__(
        self,
        client: ElasticClient | None = None,
        *,
        policy: SavePolicy | None = None,
    ) -> None:
        self.session = Session(client, policy=policy)
        self._files = TorchCheckpointIO()

    @property
    def restored(self) -> Restored | None:
        """What this process restored (``state`` dropped); ``bytes_from`` by source."""
        return self.session.restored

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        """Saves ``checkpoint`` as the version of its ``global_step`` (``path`` is only
        recorded). ``storage_options``: ``{"persist": True}`` sends it to blob storage
        whatever ``persist_every`` says; ``{"metrics": {...}}`` are the numbers the
        version carries (the strategies add the monitored ones)."""
        persist, metrics = _options(storage_options)
        self.session.save(checkpoint, path, persist=persist, metrics=metrics)

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Loads a coordinator's version (:func:`version_path`); a file path through
        Lightning's own file I/O (the strategies' launcher lets one reach ``fit`` only
        while the job has no version: initial weights)."""
        if not is_resume_path(path):
            return self._files.load_checkpoint(path, map_location, weights_only)
        return self.session.load(path, weights_only=weights_only)


def _options(storage_options: Any) -> tuple[bool, dict[str, float] | None]:
    """``(persist, metrics)`` from a save's ``storage_options``."""
    if not isinstance(storage_options, dict):
        return False, None
    metrics = storage_options.get("metrics")
    return bool(storage_options.get("persist")), dict(metrics) if metrics else None


class RallypointPreemption(pl.Callback):
    """Stops every rank at one step on a preemption notice, with an emergency version.

    The strategies below add it in front of the trainer's callbacks (before
    ``ModelCheckpoint``, so the step's one version is the emergency one). While training
    runs it owns SIGTERM: Lightning's own handler broadcasts from rank 0 inside the
    signal handler, which only works if every rank got the signal.
    """

    def __init__(self, session: Session) -> None:
        self.session = session
        self.watcher: PreemptionWatcher | None = None
        #: The version the emergency save committed as, once it did.
        self.emergency: int | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.watcher = PreemptionWatcher(self.session.client).start()

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.watcher is None or not self.watcher.should_stop():  # a collective
            return
        step = trainer.global_step
        path = os.path.join(trainer.default_root_dir, f"rallypoint-emergency-step={step}")
        trainer.save_checkpoint(path, storage_options={"persist": True})
        info = self.session.manager.wait()
        self.emergency = info.version if info is not None else None
        log.warning("rallypoint: emergency checkpoint of step %d saved; stopping", step)
        # Lightning's own way out of a SIGTERM: on_exception hooks, then the strategy's,
        # where the watcher leaves the job (see _Rallypoint.on_exception).
        raise SIGTERMException

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.session.wait()
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None


#: The entry points whose ``ckpt_path="best"``/``"last"`` name the coordinator's versions.
_EVALUATING = (TrainerFn.VALIDATING, TrainerFn.TESTING, TrainerFn.PREDICTING)


class _ResumeLauncher(_Launcher):
    """Gives ``fit`` the coordinator's version as its ``ckpt_path``, and ``validate``,
    ``test`` and ``predict`` the job's best or latest version for ``"best"``/``"last"``.

    Lightning picks its checkpoint before any strategy or callback hook runs, from
    files (``"last"``: the newest by modification time; ``"best"``: ModelCheckpoint's
    ``best_model_path``); the strategy's launcher is the one part of a strategy that
    sees the entry point's arguments.
    """

    def __init__(self, session: Session, inner: _Launcher | None) -> None:
        self.session = session
        self.inner = inner

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return self.inner.is_interactive_compatible if self.inner is not None else True

    @override
    def launch(
        self,
        function: Callable[..., Any],
        *args: Any,
        trainer: pl.Trainer | None = None,
        **kwargs: Any,
    ) -> Any:
        if trainer is not None and trainer.state.fn in _EVALUATING:
            args, kwargs = self._evaluated(function, trainer, args, kwargs)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            bound = inspect.signature(function).bind(*args, **kwargs)
            given = bound.arguments.get("ckpt_path")
            resume = self.session.resume_path()
            if resume is not None or given in ("last", "hpc", "best"):
                # Never a directory's "latest": the coordinator's version, or none yet.
                if given is not None and given != resume:
                    log.warning(
                        "fit(ckpt_path=%r) ignored: %s",
                        given,
                        f"resuming from {resume}" if resume else "the job has no checkpoint yet",
                    )
                bound.arguments["ckpt_path"] = resume
                args, kwargs = bound.args, bound.kwargs
        if self.inner is not None:
            return self.inner.launch(function, *args, trainer=trainer, **kwargs)
        return function(*args, **kwargs)

    def _evaluated(
        self,
        function: Callable[..., Any],
        trainer: pl.Trainer,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args`` and ``kwargs`` with ``ckpt_path="best"``/``"last"`` as the job's
        versions; a call with neither a model nor a path (Lightning then takes
        ``"best"``) as ``"best"``."""
        bound = inspect.signature(function).bind(*args, **kwargs)
        given = bound.arguments.get("ckpt_path")
        if given is None and bound.arguments.get("model") is None:
            given = "best" if trainer.lightning_module is not None else None
        if given not in ("best", "last"):
            return args, kwargs  # a path, or the model as it is: Lightning's own rules
        name: Literal["best", "latest"] = "best" if given == "best" else "latest"
        bound.arguments["ckpt_path"] = version_path(self.session.unjoined.job_id, name)
        return bound.args, bound.kwargs

    @override
    def kill(self, signum: Any) -> None:
        if self.inner is not None:
            self.inner.kill(signum)


def _order_of(sampler: object, length: int) -> tuple[int, bool, int]:
    """``(length, shuffle, seed)`` of the epoch's order the strategy's sampler deals in
    place of ``sampler``, for a dataset of ``length``. A script's own
    :class:`ElasticSampler` keeps its order: its position, which the script's
    hooks save and load by hand, is taken over by the versions (the script's copy
    counts in its own world's batches, which a new world size or a rolled-back step
    makes wrong)."""
    if isinstance(sampler, ElasticSampler):
        order = sampler.state_dict()
        return int(order["length"]), bool(order["shuffle"]), int(order["seed"])
    if isinstance(sampler, DistributedSampler):
        return length, sampler.shuffle, sampler.seed
    return length, not isinstance(sampler, SequentialSampler), 0


def _rebuilt(loader: DataLoader[Any], sampler: Any, batch_size: int) -> DataLoader[Any]:
    """``loader`` with ``sampler`` and ``batch_size``, rebuilt the way Lightning injects
    its ``DistributedSampler`` (the same class and arguments otherwise)."""
    if sampler is loader.sampler and batch_size == loader.batch_size:
        return loader
    if batch_size == loader.batch_size:
        return _update_dataloader(loader, sampler, RunningStage.TRAINING)
    args, kwargs = _get_dataloader_init_args_and_kwargs(loader, sampler, RunningStage.TRAINING)
    kwargs["batch_size"] = batch_size
    rebuilt: DataLoader[Any] = _reinstantiate_wrapped_cls(loader, *args, **kwargs)
    return rebuilt


# The mixin's methods call the strategy's own through super(): typed as the strategies'
# common base for mypy, a plain object at run time (the MRO puts the real base after it).
if TYPE_CHECKING:
    _StrategyBase = ParallelStrategy
else:
    _StrategyBase = object


class _Rallypoint(_StrategyBase):
    """What both strategies add to their Lightning base class (listed first among the
    bases, so these overrides wrap the base's)."""

    session: Session
    preemption: RallypointPreemption
    #: The evaluation phase while Lightning validates (see ``on_validation_start``).
    _validating: contextlib.ExitStack | None = None

    @property
    def restored(self) -> Restored | None:
        """What this process restored (``state`` dropped); ``bytes_from`` by source."""
        return self.session.restored

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Lightning applies the restored state here: a model that does not take it is
        # reported as a failed load of the version (a fresh start has none to report).
        with self.session.loading():
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        assert self.cluster_environment is not None
        # Under torchrun there is nothing to launch: Lightning's launcher would only check
        # devices x num_nodes == WORLD_SIZE, which nodes with different process counts fail.
        external = self.cluster_environment.creates_processes_externally
        self._launcher = _ResumeLauncher(self.session, None if external else self._launcher)

    @override
    def setup_environment(self) -> None:
        self._join_first()
        super().setup_environment()  # builds the process group

    @override
    def on_validation_start(self) -> None:
        # Validation goes long without an optimizer step, on every rank: a phase of its
        # own, bounded by the job's phase_limit rather than its hang limit.
        super().on_validation_start()
        if self._validating is not None:
            self._validating.close()
        self._validating = contextlib.ExitStack()
        self._validating.enter_context(phase("eval"))

    @override
    def on_validation_end(self) -> None:
        if self._validating is not None:
            self._validating.close()
            self._validating = None
        super().on_validation_end()

    def _join_first(self) -> None:
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        self.session.join_first(fitting=fitting)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        # Set by Lightning's callback connector, so not declared on Trainer for mypy.
        callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(c, RallypointPreemption) for c in callbacks):
            # First: Lightning keeps checkpoint callbacks last, and the emergency save must
            # come before ModelCheckpoint's save of the same step.
            callbacks.insert(0, self.preemption)
        # ModelCheckpoint's top-k becomes the coordinator's rule: its own deletions are
        # no-ops (remove_checkpoint), so the coordinator alone decides what is kept.
        self.session.keep_best(keep_best_of(trainer.checkpoint_callbacks))

    def _storage_options(self, storage_options: Any) -> Any:
        """``storage_options`` with the metrics the version carries: the monitored ones
        (each ``ModelCheckpoint``'s ``monitor`` and the policy's ``keep_best`` metric)
        from ``trainer.callback_metrics`` as they stand at this save, under any given
        in ``storage_options["metrics"]``."""
        module = self.lightning_module
        if module is None or module._trainer is None:
            return storage_options
        trainer = module.trainer
        names = {c.monitor for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)}
        if self.session.policy.best is not None:
            names.add(self.session.policy.best.metric)
        metrics: dict[str, float] = {}
        for name in sorted(n for n in names if n is not None):
            value = trainer.callback_metrics.get(name)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                metrics[name] = float(value.item())
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[name] = float(value)
        options = dict(storage_options) if isinstance(storage_options, dict) else {}
        metrics.update(options.get("metrics") or {})
        if metrics:
            options["metrics"] = metrics
        return options or storage_options

    def _init_data(self, elastic_data: bool, keep_global_batch: bool) -> None:
        self.elastic_data = elastic_data
        self.keep_global_batch = keep_global_batch
        #: How this generation makes the job's global batch, once the loader is set up.
        self.batch_plan: BatchPlan | None = None
        self._global_batch: int | None = None
        self._configured: tuple[int, int] | None = None  # the script's (batch, accumulation)
        self._sampler: _EpochSampler | None = None
        self._position_applied = False
        self._counter_at: int | None = None  # Lightning's batch counter, once restored

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """See base class. The training loader of ``fit`` gets this generation's batch
        plan and, unless ``elastic_data`` is off, the elastic sampler."""
        dataloader = super().process_dataloader(dataloader)
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if (
            trainer is None
            or trainer.state.fn != TrainerFn.FITTING
            or trainer.state.stage != RunningStage.TRAINING
        ):
            return dataloader
        if (
            not isinstance(dataloader, DataLoader)
            or has_iterable_dataset(dataloader)
            or dataloader.batch_size is None
        ):
            log.warning(
                "rallypoint: the training data is not a map-style DataLoader with a batch_size;"
                " neither its position nor the global batch is kept across world changes"
            )
            return dataloader
        return self._elastic_loader(trainer, dataloader)

    def _elastic_loader(self, trainer: pl.Trainer, loader: DataLoader[Any]) -> DataLoader[Any]:
        """``loader`` with this generation's per-device batch and, unless ``elastic_data``
        is off, an :class:`ElasticSampler` at the restored position; sets the Trainer's
        accumulation and, on a resume, Lightning's batch counter to match."""
        assert loader.batch_size is not None
        if self._configured is None:  # the script's values, before a plan changed them
            self._configured = (loader.batch_size, trainer.accumulate_grad_batches)
        micro, accumulation = self._configured
        # A reloaded loader (reload_dataloaders_every_n_epochs) starts its epoch afresh.
        resumed = self.session.restored is not None and not self._position_applied
        saved = self.session.data if resumed else None
        ranks = self.distributed_sampler_kwargs
        world, rank = int(ranks["num_replicas"]), int(ranks["rank"])
        plan = self._plan(saved, world, micro, accumulation)
        trainer.accumulate_grad_batches = plan.accumulation
        self._position_applied = True

        old = loader.sampler
        known = isinstance(
            old, (ElasticSampler, DistributedSampler, RandomSampler, SequentialSampler)
        )
        if not self.elastic_data or not known or type(loader.batch_sampler) is not BatchSampler:
            if self.elastic_data:
                log.warning(
                    "rallypoint: the training loader's %s is kept, and Rallypoint does not"
                    " know its position: at a new world size, samples of the epoch may be"
                    " trained twice or skipped (a plain DataLoader, or one with an"
                    " ElasticSampler, resumes exactly)",
                    type(old).__name__,
                )
            return _rebuilt(loader, old, plan.micro_batch)

        length, shuffle, seed = _order_of(old, len(loader.dataset))  # type: ignore[arg-type]
        if isinstance(old, ElasticSampler):
            log.info(
                "rallypoint: the training loader's ElasticSampler is taken over: its order"
                " (seed %d, shuffle %s) is kept, and every version saves its position",
                seed,
                shuffle,
            )
        sampler = _EpochSampler(
            length,
            rank=rank,
            world_size=world,
            shuffle=shuffle,
            seed=seed,
            batch_size=plan.micro_batch,
        )
        self._sampler = sampler
        epoch = cast(_ProcessedTracker, trainer.fit_loop.epoch_progress.current).processed
        state = saved.get("sampler") if saved is not None else None
        if state is None:
            if resumed:
                log.warning(
                    "rallypoint: the version holds no data position (saved with another"
                    " sampler); epoch %d starts its order over",
                    epoch,
                )
            sampler.set_epoch(epoch)
            return _rebuilt(loader, sampler, plan.micro_batch)
        epoch, consumed, counted = resume_position(
            state, length=length, epoch=epoch, per_batch=plan.micro_batch * world
        )
        sampler.load_state_dict({**state, "epoch": epoch, "consumed": consumed})
        sampler.counted = counted or 0
        rebuilt = _rebuilt(loader, sampler, plan.micro_batch)
        # Lightning's counter is in the saving world's batches: on_train_start puts it in
        # this world's, at the same sample, so that the epoch ends when the data does.
        self._counter_at = len(rebuilt) if counted is None else counted
        log.info(
            "rallypoint: epoch %d resumes at sample %d of %d (%d of this world's batches in)",
            epoch,
            consumed,
            length,
            sampler.counted,
        )
        return rebuilt

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # Here, not where the loader is set up: a configure_optimizers that reads
        # trainer.estimated_stepping_batches sets it up before the loops are restored,
        # and the epoch loop reads its counter only after this hook.
        if self._counter_at is None or self.lightning_module is None:
            return
        progress = self.lightning_module.trainer.fit_loop.epoch_loop.batch_progress
        shift = self._counter_at - progress.current.ready
        for tracker in cast(list[_ProcessedTracker], [progress.current, progress.total]):
            tracker.ready += shift
            tracker.started += shift
            tracker.processed += shift
            tracker.completed += shift
        self._counter_at = None

    def _plan(
        self, saved: dict[str, Any] | None, world: int, micro: int, accumulation: int
    ) -> BatchPlan:
        if self.batch_plan is not None:  # the loader reloaded: same generation, same plan
            return self.batch_plan
        mine = BatchPlan(micro * accumulation * world, world, micro, accumulation)
        if saved is not None and "global_batch" in saved:
            self._global_batch = int(saved["global_batch"])
        else:  # the first generation fixes the job's global batch
            self._global_batch = mine.global_batch
        if self.keep_global_batch:
            # A world that cannot split the job's global batch cannot resume it: reported
            # with the sizes that can, which the coordinator then seals alone, no loop.
            with self.session.loading():
                plan = plan_batch(self._global_batch, world, micro_batch=micro)
        else:
            plan = mine
            if plan.global_batch != self._global_batch:
                log.warning(
                    "rallypoint: keep_global_batch=False: %d samples per step, not the job's %d;"
                    " an epoch takes %.4gx the steps it did, and max_steps and step-based"
                    " schedules count these steps",
                    plan.global_batch,
                    self._global_batch,
                    self._global_batch / plan.global_batch,
                )
        log.info("rallypoint: %s", plan.describe())
        self.batch_plan = plan
        return plan

    def _with_data(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint`` with the job's global batch and the data position."""
        data: dict[str, Any] = {}
        if self._global_batch is not None and self.batch_plan is not None:
            data["global_batch"] = self._global_batch
            data["plan"] = dataclasses.asdict(self.batch_plan)
        module = self.lightning_module
        if self._sampler is not None and module is not None:
            trainer = module.trainer
            progress = trainer.fit_loop.epoch_loop.batch_progress
            consumed = self._sampler.consumed_after(
                progress.current.ready,
                accumulation=trainer.accumulate_grad_batches,
                last=progress.is_last_batch,
            )
            data["sampler"] = {**self._sampler.state_dict(), "consumed": consumed}
        return {**checkpoint, DATA_KEY: data} if data else checkpoint

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        trainer = self.lightning_module.trainer if self.lightning_module else None
        watcher = self.preemption.watcher
        if isinstance(exception, SIGTERMException) and watcher is not None and watcher.stopping:
            for logger in trainer.loggers if trainer is not None else []:
                logger.finalize("finished")  # as Lightning's SLURM requeue does
            watcher.finish()  # leaves (the notified node) or awaits the restart; exits


class RallypointDDPStrategy(_Rallypoint, DDPStrategy):
    """Lightning's ``DDPStrategy``, saving and resuming through the coordinator.

    Args:
        client, policy: See :class:`RallypointCheckpointIO`.
        elastic_data: Replace the ``DistributedSampler`` Lightning would install with an
            :class:`~rallypoint.trainer.ElasticSampler` whose position (epoch, samples
            trained) is saved in every version and resumed exactly at any world size.
            False: Lightning's sampler, and its own (world-dependent) batch counter.
        keep_global_batch: Keep the job's global batch (per-device batch x accumulation x
            ranks, fixed by the first generation) at every world size, through
            :func:`~rallypoint.trainer.plan_batch`; a world that cannot split it raises
            :class:`~rallypoint.trainer.errors.WorldSizeError` before training. False: the
            per-device batch and accumulation as the script set them.
        **kwargs: ``DDPStrategy``'s.
    """

    def __init__(
        self,
        client: ElasticClient | None = None,
        *,
        policy: SavePolicy | None = None,
        elastic_data: bool = True,
        keep_global_batch: bool = True,
        **kwargs: Any,
    ) -> None:
        io = RallypointCheckpointIO(client, policy=policy)
        super().__init__(checkpoint_io=io, **kwargs)
        self.session = io.session
        self.preemption = RallypointPreemption(self.session)
        self._init_data(elastic_data, keep_global_batch)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The job's processes, not devices x num_nodes: nodes may run different numbers.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        # Every rank: DCP plans the save together (and writes replicated tensors once).
        checkpoint = self._with_data(checkpoint)
        options = self._storage_options(storage_options)
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=options)


class RallypointModelParallelStrategy(_CoordinatorKeeps, _Rallypoint, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallel), whose sharded saves
    and loads go through Rallypoint's DCP writer and reader: one file per rank, each rank
    loading its own shards (resharded to today's mesh).

    Lightning's ``ModelParallelStrategy`` writes DCP folders itself and never calls a
    ``CheckpointIO``; this subclass replaces its ``save_checkpoint`` and
    ``load_checkpoint``.

    Args:
        data_parallel_size: ``"auto"``: the job's processes over ``tensor_parallel_size``
            (the world changes from one generation to the next).
        tensor_parallel_size: 1 unless the model is tensor-parallel.
        client, policy: See :class:`RallypointCheckpointIO`.
        elastic_data, keep_global_batch: See :class:`RallypointDDPStrategy` (ranks are
            the data-parallel ones).
        **kwargs: ``ModelParallelStrategy``'s.
    """

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: int = 1,
        client: ElasticClient | None = None,
        *,
        policy: SavePolicy | None = None,
        elastic_data: bool = True,
        keep_global_batch: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(data_parallel_size, tensor_parallel_size, **kwargs)
        self.session = Session(client, policy=policy)
        self.preemption = RallypointPreemption(self.session)
        self._init_data(elastic_data, keep_global_batch)

    @override
    def setup_environment(self) -> None:
        self._join_first()  # a parked worker's world size is a placeholder until then
        if self._data_parallel_size == "auto":
            assert isinstance(self._tensor_parallel_size, int)
            self._data_parallel_size = self.world_size // self._tensor_parallel_size
        super().setup_environment()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        persist, metrics = _options(self._storage_options(storage_options))
        self.session.save(self._with_data(checkpoint), filepath, persist=persist, metrics=metrics)

    @override
    def load_checkpoint(
        self, checkpoint_path: _PATH, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if not is_resume_path(checkpoint_path):  # see RallypointCheckpointIO.load_checkpoint
            return super().load_checkpoint(checkpoint_path, weights_only)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        assert self.model is not None and self.lightning_module is not None
        model = self.model
        optimizers = list(self.optimizers)
        # This run's shards to load into, in place; Adam's state initialized (an empty
        # template would load none of it).
        template = {
            "state_dict": get_model_state_dict(model),
            "optimizer_states": [
                {"state": get_optimizer_state_dict(model, o)["state"]} for o in optimizers
            ],
        }
        strict = self.lightning_module.strict_loading

        def apply(state: dict[str, Any]) -> None:
            model.load_state_dict(state["state_dict"], strict=strict)

        checkpoint = self.session.load(
            checkpoint_path, template, weights_only=weights_only, apply=apply
        )
        options = StateDictOptions(cpu_offload=True)
        # validate/test/predict have no optimizers: their template asked for none.
        for optimizer, saved in zip(optimizers, checkpoint["optimizer_states"], strict=True):
            set_optimizer_state_dict(model, optimizer, optim_state_dict=saved, options=options)
        return checkpoint
