"""The Hugging Face Trainer through Rallypoint: ``RallypointTrainer``.

``Trainer._save_checkpoint`` writes a ``checkpoint-N`` folder synchronously (safetensors,
``torch.save`` of the optimizer, the scheduler and each rank's RNG, ``trainer_state.json``)
and ``train(resume_from_checkpoint=True)`` takes the highest ``checkpoint-N`` in
``output_dir``. Here the save is one :class:`CheckpointManager` version (model, optimizer
and scheduler in the shared state, each rank's RNG in its ``rank_state``, the trainer
state beside them), and ``resume_from_checkpoint=True`` restores the version the
coordinator named for this generation. With ``deepspeed=`` the engine's own
``save_checkpoint``/``load_checkpoint`` go through :mod:`rallypoint.trainer.deepspeed`,
in the same version.

The Trainer's own loaders still read two small files, so a restore writes them into a
scratch folder it then names as the checkpoint: ``trainer_state.json`` and this rank's
``rng_state_R.pth``, both from the version.

The data position and the global batch are part of the version too (issue 33). The
Trainer resumes data by skipping ``global_step`` batches per rank of the *new* world
(``skip_first_batches``, which iterates them), so a job that resumes on fewer nodes
trains samples twice and moves ``max_steps`` and the schedule with the world. Here the
Trainer's sampler is a global :class:`ElasticSampler` over whole global batches, which
starts at the saved sample position (accelerate deals its batches round-robin to the
ranks, so every optimizer step takes the next ``global_batch`` samples of the epoch's
order at any world size), and the per-device batch and accumulation steps are planned
(:func:`plan_batch`) so that the global batch, the steps per epoch and ``max_steps``
stay what the job started with.

The best model (issue 34) is the coordinator's: with ``metric_for_best_model`` every
version carries that evaluation metric (when the evaluation was at its step) and the
manager's policy keeps the best version by it (``keep_best``), so collection never takes
it; ``load_best_model_at_end`` loads ``best`` from the coordinator where the Trainer
would read ``checkpoint-N``. ``save_total_limit`` is the job's ``keep_last``. Each version
records the model's config (``hf_config``, ``hf_generation_config``) so that an export
of it in ``hf`` format is a folder ``from_pretrained`` loads; :meth:`save_model` writes
such a folder through :func:`~rallypoint.trainer.export` when the model in memory is a
version's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import random
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any, Literal, cast

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.utils.data import IterableDataset, Sampler
from transformers import PreTrainedModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import ExportableState

from rallypoint.client import ElasticClient, RallypointError, UnknownCheckpoint

from ._batch import BatchPlan, plan_batch
from ._joining import join_first, under_agent
from ._pack import pack, unpack
from ._preemption import PreemptionWatcher
from ._sampler import ElasticSampler
from .checkpoint import CheckpointManager, RallypointReader, Restored, SaveHandle, SavePolicy
from .checkpoint import export as export_version
from .errors import RallypointTrainerError, WorldSizeError
from .health import phase

__all__ = [
    "EpochSampler",
    "PreemptionCallback",
    "RallypointTrainer",
    "RallypointTrainingArguments",
    "horizon_steps",
    "job_batch_plan",
    "monitored_metric",
    "trainer_policy",
]

log = logging.getLogger("rallypoint.trainer")

TRAINER_STATE = "trainer_state.json"
SCHEDULER = "scheduler.pt"
#: The version's data part: the sampler's position, the job's global batch, the samples
#: trained and the job's horizon in samples (JSON).
DATA = "rallypoint_data.json"
#: The Trainer's sampling strategies the elastic sampler replaces; the others
#: (``group_by_length``, ``batch_rebalance``) order batches by length and keep theirs.
_ELASTIC_STRATEGIES = ("random", "sequential")
#: The version metadata keys holding the model's ``config.json`` and
#: ``generation_config.json`` (as JSON values): ``export(format="hf")`` writes the files
#: from exactly these.
HF_CONFIG = "hf_config"
HF_GENERATION_CONFIG = "hf_generation_config"
#: Most bytes of the configs a version records; past it they are left out (a warning):
#: the manifest's metadata is for small values.
_CONFIG_BYTES = 64 * 1024
#: ``state.best_model_checkpoint`` while the best is whichever version the coordinator
#: ranks first; ``rallypoint:v<N>`` once loaded.
BEST_CHECKPOINT = "rallypoint:best"
_VERSION_PREFIX = "rallypoint:"
#: A DeepSpeed model's dtype, as ``export`` casts its fp32 master weights to it.
_EXPORT_DTYPES: dict[torch.dtype, Literal["bf16", "fp16"]] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}


class EpochSampler(Sampler[int]):
    """The Trainer's *global* sampler: an epoch's order, from a saved position, in
    whole global batches.

    Wraps ``ElasticSampler(length, rank=0, world_size=1, batch_size=global_batch)``:
    accelerate's ``BatchSamplerShard`` cuts what it yields into per-device batches and
    deals them round-robin to the ranks, so the ``k``-th optimizer step at any world size
    trains samples ``[k * global_batch, (k + 1) * global_batch)`` of what remains, and
    :meth:`advance` after each step keeps the position in samples, world-independent.

    An epoch is ``length // global_batch`` steps of exactly ``global_batch`` samples:
    the last ``length % global_batch`` samples of each epoch's order are not trained (as
    ``drop_last``), so the steps per epoch do not depend on how the world splits the
    batch. ``len()`` is the whole epoch's, wherever the position is, because the Trainer
    derives the steps per epoch and ``max_steps`` from it.

    Args:
        length: The dataset's length.
        global_batch: Samples per optimizer step, all ranks together.
        shuffle: A seeded permutation per epoch rather than ``0, 1, ...``.
        seed: The shuffle seed (epoch ``e`` uses ``seed + e``).

    Raises:
        ValueError: The dataset is smaller than one global batch.
    """

    def __init__(self, length: int, *, global_batch: int, shuffle: bool, seed: int) -> None:
        super().__init__()
        if length < global_batch:
            raise ValueError(
                f"the training set has {length} samples, fewer than one global batch "
                f"({global_batch})"
            )
        self.global_batch = global_batch
        self.epoch_samples = length // global_batch * global_batch
        self.position = ElasticSampler(
            length, rank=0, world_size=1, shuffle=shuffle, seed=seed, batch_size=global_batch
        )

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self.position.epoch

    @property
    def consumed(self) -> int:
        """Samples of this epoch's order trained, all ranks together."""
        return self.position.consumed

    @property
    def finished(self) -> bool:
        """Whether this epoch has no whole global batch left."""
        return self.position.consumed + self.global_batch > self.epoch_samples

    def __len__(self) -> int:
        """The whole epoch's samples (what the Trainer counts steps per epoch from)."""
        return self.epoch_samples

    def __iter__(self) -> Iterator[int]:
        """Yields the epoch's whole global batches from the position."""
        # Whole batches from the position: with keep_global_batch=False the position
        # was counted in another world's global batch.
        left = max(0, self.epoch_samples - self.position.consumed)
        left -= left % self.global_batch
        # ElasticSampler slices the permutation at the position: O(1) in it.
        return itertools.islice(iter(self.position), left)

    def set_epoch(self, epoch: int) -> None:
        """Moves to ``epoch``'s start, or keeps the position if it is the current one."""
        self.position.set_epoch(epoch)

    def advance(self) -> None:
        """Records one optimizer step: ``global_batch`` more samples trained."""
        self.position.advance(1)

    def state_dict(self) -> dict[str, Any]:
        """The position (:meth:`ElasticSampler.state_dict`), the same at any world."""
        return self.position.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a position saved at any world size; moves past a finished epoch.

        Raises:
            ValueError: ``state`` is of another dataset, seed or order.
        """
        self.position.load_state_dict(state)
        if self.finished:
            self.position.set_epoch(self.position.epoch + 1)


def job_batch_plan(
    world_size: int,
    *,
    micro_batch: int,
    accumulation: int,
    keep_global_batch: bool = True,
    global_batch: int | None = None,
    saved_global_batch: int | None = None,
) -> BatchPlan:
    """The batch plan of one generation of a job.

    The job's global batch is ``global_batch`` if given, else the one saved in the
    version being resumed, else the configuration's at this (the first) generation:
    ``micro_batch x accumulation x world_size``.

    Args:
        world_size: Data-parallel ranks of this generation.
        micro_batch: The configured per-device batch: the most a device takes.
        accumulation: The configured accumulation steps.
        keep_global_batch: Keep the job's global batch (:func:`plan_batch`); False:
            keep ``micro_batch`` and ``accumulation``, and the global batch follows
            the world.
        global_batch: An explicit global batch.
        saved_global_batch: The global batch of the version being resumed.

    Returns:
        The plan.

    Raises:
        WorldSizeError: ``keep_global_batch`` and ``world_size`` cannot split the
            job's global batch.
    """
    if not keep_global_batch:
        return BatchPlan(
            micro_batch * accumulation * world_size, world_size, micro_batch, accumulation
        )
    target = global_batch or saved_global_batch or micro_batch * accumulation * world_size
    if global_batch and saved_global_batch and global_batch != saved_global_batch:
        log.warning(
            "global_batch_size=%d, but the job was training with %d: the schedule's "
            "steps per epoch change",
            global_batch,
            saved_global_batch,
        )
    return plan_batch(target, world_size, micro_batch=micro_batch)


def horizon_steps(step: int, *, samples: int, horizon: int, global_batch: int) -> int:
    """``max_steps`` that trains at most the job's ``horizon`` samples, ``samples`` of
    them done by ``step``, at ``global_batch`` samples a step from here on."""
    return step + max(0, (horizon - samples) // global_batch)


def monitored_metric(args: Any) -> str | None:
    """The evaluation metric ``metric_for_best_model`` names, as the Trainer's
    ``_determine_best_metric`` looks it up (``eval_`` prefixed), or None."""
    metric = getattr(args, "metric_for_best_model", None)
    if not metric:
        return None
    return metric if metric.startswith("eval_") else f"eval_{metric}"


def trainer_policy(args: Any, policy: SavePolicy | None = None) -> SavePolicy:
    """``policy`` with what the Trainer's arguments ask of retention: ``keep_best`` by
    :func:`monitored_metric` (``max`` if ``greater_is_better``) and ``keep_last`` =
    ``save_total_limit``, each unless ``policy`` sets it.

    Args:
        args: The ``TrainingArguments``.
        policy: The user's policy; default: ``SavePolicy()``.

    Returns:
        The policy the trainer's manager saves under.
    """
    policy = policy if policy is not None else SavePolicy()
    changes: dict[str, Any] = {}
    metric = monitored_metric(args)
    if metric is not None and policy.keep_best is None:
        changes["keep_best"] = (metric, "max" if args.greater_is_better else "min")
    limit = getattr(args, "save_total_limit", None)
    # The Trainer deletes nothing for a limit of 0 or less.
    if limit is not None and limit > 0 and policy.keep_last is None:
        changes["keep_last"] = min(int(limit), 1000)
    return dataclasses.replace(policy, **changes) if changes else policy


class PreemptionCallback(TrainerCallback):
    """Stops every rank at the same step on a preemption notice and has the Trainer
    save: the Trainer's own ``should_save``/``should_training_stop`` controls, which
    :class:`RallypointTrainer` turns into the emergency version (``persist=True``),
    then the departure (:meth:`PreemptionWatcher.finish`)."""

    def __init__(self, trainer: RallypointTrainer, watcher: PreemptionWatcher) -> None:
        self.trainer = trainer
        self.watcher = watcher

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.watcher.start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # A collective: every rank asks at every step, so all stop at the same one.
        if self.watcher.should_stop():
            self.trainer.emergency = True
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.watcher.stop()


@dataclasses.dataclass
class RallypointTrainingArguments(TrainingArguments):
    """``TrainingArguments`` that join the job before they build the process group.

    ``TrainingArguments(...)`` builds the process group as it is made (accelerate's
    ``PartialState``, from torchrun's variables, also for ``deepspeed=``). In a worker of
    a node that joins a running job (a hot join, ``rallypoint run``'s default) those
    are a placeholder world's until it has joined: these arguments join first, so the
    worker waits there until its node goes in, and the group is built from its
    assignment's rank, world size and master. In any other worker of an agent the join
    takes the agent's assignment (no round); a process that is no agent's worker joins
    nothing here. The fields are ``TrainingArguments``'.
    """

    def __post_init__(self) -> None:
        if under_agent():
            join_first()
        super().__post_init__()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated


class RallypointTrainer(Trainer):
    """``transformers.Trainer`` whose checkpoints are the coordinator's versions.

    A drop-in for ``Trainer``; ``train(resume_from_checkpoint=True)`` resumes from the
    version the coordinator named for this generation (a fresh start if there is none,
    where the Trainer would raise), never from the highest ``checkpoint-N`` in
    ``output_dir``. ``save_steps``/``save_strategy`` still decide when to save.

    Args:
        *args, **kwargs: ``Trainer``'s.
        rallypoint_client: The node's client; defaults to ``ElasticClient.from_env()``,
            joined (the agent's assignment under torchrun).
        checkpoint_policy: How versions are saved (:class:`~rallypoint.trainer.SavePolicy`:
            ``persist_every``, ``if_busy``, ...).
        watch_preemption: Watch for a preemption notice (Scheduled Events, SIGTERM) and
            take an emergency version at the next step, then leave.
        elastic_data: Install the elastic sampler (:class:`EpochSampler`): the data
            position is saved in samples and a resume at any world size trains the
            rest of the epoch, in its order, once. False: the Trainer's own sampler
            and its batch skipping (exact only at the same world size).
        keep_global_batch: Keep the job's global batch at every world size, planning
            ``per_device_train_batch_size`` (at most the configured one) and
            ``gradient_accumulation_steps`` per generation; a world that cannot split
            it raises :class:`~rallypoint.trainer.errors.WorldSizeError` before
            training. False: keep the per-device batch; the global batch follows the
            world and ``max_steps`` is recomputed at a resume to train the same number
            of samples (logged as a warning).
        global_batch_size: The job's global batch; default: the configuration's at the
            first generation (per-device batch x accumulation x world), saved in every
            version and read back at a resume.

    Attributes:
        checkpoints: The manager.
        restored: What the last resume restored (``bytes_from`` says from where).
        emergency: The next save (or the one in progress, while callbacks' ``on_save``
            runs) is the emergency one.
        last_save: The last save's handle (its ``blocked`` time and the version).
        batch_plan: This generation's plan (set by ``train()``).
        sampler: The elastic sampler of this generation's loader; None with
            ``elastic_data=False`` or a dataset it does not fit.
    """

    def __init__(
        self,
        *args: Any,
        rallypoint_client: ElasticClient | None = None,
        checkpoint_policy: SavePolicy | None = None,
        watch_preemption: bool = True,
        elastic_data: bool = True,
        keep_global_batch: bool = True,
        global_batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        # Joined before the Trainer makes its default arguments (no args=), which build
        # the process group (see RallypointTrainingArguments).
        client = join_first(rallypoint_client)
        super().__init__(*args, **kwargs)
        self.checkpoints = CheckpointManager(
            client, policy=trainer_policy(self.args, checkpoint_policy)
        )
        self.restored: Restored | None = None
        self.emergency = False
        self.last_save: SaveHandle | None = None
        self._scratch: str | None = None
        self.elastic_data = elastic_data
        self.keep_global_batch = keep_global_batch
        self.global_batch_size = global_batch_size
        # The configured batch: each generation plans from it, not from the args the
        # last generation's plan wrote.
        self._micro_batch = self.args.per_device_train_batch_size
        self._accumulation = self.args.gradient_accumulation_steps
        self.batch_plan: BatchPlan | None = None
        self.sampler: EpochSampler | None = None
        self._data: dict[str, Any] | None = None  # the restored version's DATA
        self._samples = 0  # samples the job trained, all generations
        self._horizon: int | None = None  # samples the job trains in all
        self._rng_from: str | None = None  # the deferred RNG restore's folder
        self._foreign = False  # resuming from a Trainer folder, not a version
        self._hf_metadata: dict[str, Any] | None = None  # the model's configs, once
        self._best_checkpoint: str | None = None  # the resumed state's, until it is set
        # The version the model in memory holds, and the step it was at then: a save's
        # handle (its version once committed) or a loaded version's number.
        self._model_version: SaveHandle | int | None = None
        self._model_step: int | None = None
        self.add_callback(_DataCallback(self))
        self.watcher: PreemptionWatcher | None = None
        if watch_preemption:
            if self.args.enable_jit_checkpoint:
                log.warning(
                    "enable_jit_checkpoint saves on each rank's own SIGTERM, at steps that "
                    "may differ across ranks; Rallypoint's notice handling agrees on one"
                )
            self.watcher = PreemptionWatcher(client)
            self.add_callback(PreemptionCallback(self, self.watcher))

    # --- saving -------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """See base class. One version instead of a ``checkpoint-N`` folder."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        step = int(self.state.global_step)
        metrics = self._evaluation(step)
        config = self._config_metadata()
        if self.checkpoints.policy.best is not None and self.state.best_global_step:
            # As the Trainer names its best checkpoint-N folder before it writes the
            # state; which version is best the coordinator says when it is loaded.
            self.state.best_model_checkpoint = BEST_CHECKPOINT
        # TrainerState annotates stateful_callbacks as a list, but __post_init__ turns it
        # into the dict by callback name that the Trainer's own save indexes.
        stateful = cast(dict[str, Any], self.state.stateful_callbacks)
        for cb in [*self.callback_handler.callbacks, self.control]:
            if isinstance(cb, ExportableState):  # as the Trainer records them
                name = cb.__class__.__name__
                if isinstance(stateful.get(name), list):
                    stateful[name].append(cb.state())
                else:
                    stateful[name] = cb.state()
        trainer_state = json.dumps(dataclasses.asdict(self.state), sort_keys=True)
        rng = _rng_state()
        emergency = self.emergency
        # Both exist once training runs: _prepare_for_training made them.
        optimizer, scheduler = self.optimizer, self.lr_scheduler
        assert optimizer is not None and scheduler is not None
        if self.is_deepspeed_enabled:
            from ._deepspeed import install

            ours = install(self.model_wrapped, checkpoints=self.checkpoints)
            ours.extra = {TRAINER_STATE: trainer_state, DATA: self._data_state()}
            if not _deepspeed_scheduler(scheduler):
                ours.extra[SCHEDULER] = scheduler.state_dict()
            ours.extra_rank = {"rng_state.pth": rng}
            ours.step = step
            ours.metadata = dict(config)
            ours.metrics = metrics
            # DeepSpeed makes this folder (and copies zero_to_fp32.py there); no
            # checkpoint file is written to it.
            assert self.args.output_dir is not None  # TrainingArguments defaults it
            self.last_save = ours.save_checkpoint(
                os.path.join(self.args.output_dir, "deepspeed"),
                f"global_step{step}",
                persist=emergency,
                blocking=emergency,
                # Nothing reads it (resuming asks the coordinator), and a `latest` left
                # in output_dir is what a stale mount shows the next job.
                save_latest=False,
            )
        else:
            unwrapped = self.accelerator.unwrap_model(model)
            state = {
                "model": pack(unwrapped.state_dict()),
                "optimizer": pack(optimizer.state_dict()),
                "scheduler": pack(scheduler.state_dict()),
                "trainer_state": pack(trainer_state),
                "data": pack(self._data_state()),
            }
            self.last_save = self.checkpoints.save(
                state,
                step,
                rank_state={"rng": pack(rng)},
                metadata={
                    "checkpoint": f"checkpoint-{step}",
                    "framework": "transformers",
                    **config,
                },
                metrics=metrics,
                persist=emergency,
                blocking=emergency,
            )
        self._model_version, self._model_step = self.last_save, step
        if emergency and self.watcher is not None:
            self.checkpoints.wait()
            # The Trainer runs on_save after this method returns, which it never does
            # here: callbacks see the emergency save before this process leaves.
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)
            self.watcher.finish()  # leaves (the notified node) or awaits the restart
        self.emergency = False

    def _evaluation(self, step: int) -> dict[str, float] | None:
        """The ``eval_*`` numbers of the evaluation logged at ``step``, for the version
        of ``step`` to carry; None if the last evaluation was at another step (its
        numbers describe another model, and must not rank this one)."""
        for entry in reversed(self.state.log_history):
            if any(k.startswith("eval_") for k in entry):
                if entry.get("step") != step:
                    return None
                return {
                    k: float(v)
                    for k, v in entry.items()
                    if k.startswith("eval_")
                    and isinstance(v, (int, float))
                    and not isinstance(v, bool)
                }
        return None

    def _config_metadata(self) -> dict[str, Any]:
        """The model's config and generation config as version metadata
        (:data:`HF_CONFIG`, :data:`HF_GENERATION_CONFIG`), made at the first save."""
        if self._hf_metadata is None:
            model = self.accelerator.unwrap_model(self.model)
            found: dict[str, Any] = {}
            for key, attr in ((HF_CONFIG, "config"), (HF_GENERATION_CONFIG, "generation_config")):
                config = getattr(model, attr, None)
                if config is not None and hasattr(config, "to_json_string"):
                    found[key] = json.loads(config.to_json_string(use_diff=False))
            size = len(json.dumps(found))
            if size > _CONFIG_BYTES:
                log.warning(
                    "the model's config is %d bytes as JSON, over %d: versions do not record "
                    "it, and an hf export of one has no config.json",
                    size,
                    _CONFIG_BYTES,
                )
                found = {}
            self._hf_metadata = found
        return self._hf_metadata

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """See base class. Marked as an evaluation for the hang rule: every rank goes
        long without an optimizer step, bounded by the job's ``phase_limit`` rather than
        its hang limit."""
        with phase("eval"):
            result: dict[str, float] = super().evaluate(*args, **kwargs)
        return result

    # --- resuming -----------------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """See base class. ``resume_from_checkpoint=True`` resumes from the
        coordinator's version for this generation, or starts afresh if it names none.

        Raises:
            WorldSizeError: This generation's world cannot split the job's global
                batch (``keep_global_batch``); raised before anything trains, once
                reported to the coordinator (the sizes that can), which ends the
                generation and from then on seals only those sizes.
        """
        ours = resume_from_checkpoint is True
        # What fails while resuming the coordinator's version (its restore, a world that
        # cannot split the job's global batch) is reported: no restart loop.
        with self.checkpoints.loading() if ours else contextlib.nullcontext():
            if resume_from_checkpoint is True:
                resume_from_checkpoint = self._restore()
            # A Trainer folder holds no sample position: the Trainer's own sampler and
            # skipping for it.
            self._foreign = bool(resume_from_checkpoint) and resume_from_checkpoint != self._scratch
            if self._foreign:
                self._data = None
            self._plan(resumed=bool(resume_from_checkpoint))
        return super().train(
            resume_from_checkpoint=resume_from_checkpoint,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
            **kwargs,
        )

    def _restore(self) -> str | None:
        """Reads the coordinator's version; the scratch folder the Trainer's own loaders
        then read ``trainer_state.json`` and this rank's RNG file from."""
        self.restored = self.checkpoints.load_latest()
        if self.restored is None:
            return None
        files = self._files()
        self._data = json.loads(files[DATA]) if files.get(DATA) else None
        self._scratch = tempfile.mkdtemp(prefix="rallypoint-trainer-")
        trainer_state = json.loads(files[TRAINER_STATE])
        best = trainer_state.get("best_model_checkpoint")
        if isinstance(best, str) and best.startswith(_VERSION_PREFIX):
            # Not a folder: the Trainer would drop it with a warning as it loads the
            # state. Set again once it has (_init_training_state).
            self._best_checkpoint = best
            trainer_state["best_model_checkpoint"] = None
        with open(os.path.join(self._scratch, TRAINER_STATE), "w", encoding="utf-8") as f:
            json.dump(trainer_state, f)
        rng = files.get("rng")
        if rng is not None:
            name = (
                f"rng_state_{self.args.process_index}.pth"
                if self.args.world_size > 1
                else "rng_state.pth"
            )
            torch.save(rng, os.path.join(self._scratch, name))
        return self._scratch

    def _files(self) -> dict[str, Any]:
        """The restored version's parts: trainer state, RNG, and (without DeepSpeed)
        model, optimizer and scheduler states."""
        assert self.restored is not None
        state, own = self.restored.state, self.restored.rank_state or {}
        if self.is_deepspeed_enabled:
            from ._pack import file_key

            return {
                TRAINER_STATE: unpack(state[file_key(TRAINER_STATE)]),
                DATA: unpack(state[file_key(DATA)]) if file_key(DATA) in state else None,
                "rng": unpack(own[file_key("rng_state.pth")])
                if file_key("rng_state.pth") in own
                else None,
            }
        return {
            TRAINER_STATE: unpack(state["trainer_state"]),
            # Versions saved before the data position was: the Trainer's own skipping.
            DATA: unpack(state["data"]) if "data" in state else None,
            "rng": unpack(own["rng"]) if "rng" in own else None,
        }

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """See base class. From the restored version if it is the one being resumed."""
        if self._scratch is None or resume_from_checkpoint != self._scratch:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        assert self.restored is not None
        target = model if model is not None else self.model
        assert target is not None
        with self.checkpoints.loading():  # a model that does not take it: reported
            target.load_state_dict(unpack(self.restored.state["model"]))

    def _prepare_for_training(
        self, max_steps: Any, train_dataloader: Any, resume_from_checkpoint: Any
    ) -> Any:
        """See base class. Installs the DeepSpeed engine's checkpoint engine once the
        engine exists, and loads the restored optimizer and scheduler (and, with
        DeepSpeed, everything) where the Trainer would load its folder's."""
        ours_to_load = self._scratch is not None and resume_from_checkpoint == self._scratch
        # transformers leaves this method unannotated; it returns (model, dataloader).
        prepare = cast(Callable[..., tuple[Any, Any]], super()._prepare_for_training)
        model, train_dataloader = prepare(
            max_steps, train_dataloader, None if ours_to_load else resume_from_checkpoint
        )
        ours = None
        if self.is_deepspeed_enabled:
            from ._deepspeed import install

            ours = install(self.model_wrapped, checkpoints=self.checkpoints)
        if ours_to_load:
            with self.checkpoints.loading():  # a ZeRO reshard, DeepSpeed's checks: reported
                self._load_rest(ours)
        return model, train_dataloader

    def _load_rest(self, ours: Any) -> None:
        """Loads the restored optimizer and scheduler, or with DeepSpeed everything."""
        assert self.restored is not None
        optimizer, scheduler = self.optimizer, self.lr_scheduler
        assert optimizer is not None and scheduler is not None
        if ours is None:
            optimizer.load_state_dict(unpack(self.restored.state["optimizer"]))
            scheduler.load_state_dict(unpack(self.restored.state["scheduler"]))
            return
        ours.restore(self.restored)
        folder = ours.stand_in()
        # model_wrapped is annotated as a Module; with DeepSpeed it is the engine.
        engine: Any = self.model_wrapped
        load_path, _ = engine.load_checkpoint(
            folder, tag=ours.tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint v{self.restored.version}")
        if not _deepspeed_scheduler(scheduler):
            scheduler.load_state_dict(ours.load(SCHEDULER))

    # --- the best model and the model out --------------------------------------------

    def _load_best_model(self) -> None:
        """See base class. Loads the coordinator's ``best`` version into the model on
        every rank (the Trainer calls this at the end of ``train()`` with
        ``load_best_model_at_end``) and sets ``best_model_checkpoint`` to
        ``rallypoint:v<N>``, ``best_metric`` and ``best_global_step`` to that version's."""
        named = self.state.best_model_checkpoint
        if named is None or not named.startswith(_VERSION_PREFIX):
            super()._load_best_model()  # a Trainer folder of a resume from one
            return
        try:
            self.checkpoints.wait()  # the last save may be the best
        except Exception as exc:  # logged by the save; an older best may do
            log.warning("the last save failed (%s); loading the best committed version", exc)
        try:
            info = self.checkpoints.client.checkpoint("best")
        except UnknownCheckpoint as exc:
            log.warning("load_best_model_at_end: no best version (%s); the last model stays", exc)
            return
        metric = monitored_metric(self.args)
        log.info(
            "loading the best model: v%d (step %d, %s)",
            info.version,
            info.step,
            ", ".join(f"{k}={v}" for k, v in sorted(info.metrics.items())) or "-",
        )
        if self.is_deepspeed_enabled:
            self._load_best_deepspeed(info.version)
        else:
            self._load_best_weights(info.version)
        self._model_version, self._model_step = info.version, int(self.state.global_step)
        self.state.best_model_checkpoint = f"{_VERSION_PREFIX}v{info.version}"
        self.state.best_global_step = info.step
        if metric is not None and metric in info.metrics:
            self.state.best_metric = info.metrics[metric]

    def _load_best_weights(self, version: int) -> None:
        """The version's model state into the model: only its ``model`` part is read
        (templates from the version's metadata), not the optimizer's."""
        reader = RallypointReader(
            self.checkpoints.client, version, progress=False, memory=self.checkpoints.memory
        )
        saved = reader.read_metadata().state_dict_metadata
        template = {
            key[len("model.") :]: torch.empty(m.size, dtype=m.properties.dtype)
            for key, m in saved.items()
            if key.startswith("model.") and isinstance(m, TensorStorageMetadata)
        }
        restored = self.checkpoints.load(version, {"model": template})
        assert self.model is not None
        self.model.load_state_dict(unpack(restored.state["model"]))

    def _load_best_deepspeed(self, version: int) -> None:
        """The version's weights through the engine's own load, as a resume loads them
        (a ZeRO reshard too): the module and the optimizer, as the Trainer's own
        ``deepspeed_load_checkpoint`` of its best folder loads both; the scheduler stays.

        Not ``load_module_only``: under ZeRO-3 DeepSpeed then builds the module's state
        with ``get_fp32_state_dict_from_zero_checkpoint``, which ``torch.load``s every
        rank's files from the folder itself, past the checkpoint engine, and the stand-in
        folder's files are empty. The optimizer load reads this rank's partitions through
        the engine (the fp32 master weights, which become the module's)."""
        from ._deepspeed import install

        engine: Any = self.model_wrapped
        ours = install(engine, checkpoints=self.checkpoints)
        ours.restored = None  # the engine reads the version restore() names next
        ours.restore(self.checkpoints.load(version))
        folder = ours.stand_in()
        load_path, _ = engine.load_checkpoint(
            folder,
            tag=ours.tag,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load the best checkpoint v{version}")

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """See base class. A folder ``from_pretrained`` loads: when the model in memory is
        a version's (the last save's, with no step since, or the best one
        ``load_best_model_at_end`` loaded), that version exported in ``hf`` format
        (:func:`~rallypoint.trainer.export`: ``model.safetensors`` or shards, the
        config the version recorded), with the processing class and the training
        arguments as the Trainer writes them; otherwise, and with FSDP (whose gathers
        the Trainer's own save does), the Trainer's own save of the model in memory.
        ``push_to_hub`` uploads what this wrote.

        With DeepSpeed every rank calls this, as for the Trainer's own save (ZeRO-3
        gathers there); a version's ZeRO partitions are put together by DeepSpeed's
        ``zero_to_fp32`` in the export, on the process that saves, in the model's
        dtype. A model in memory that no version holds (steps trained since the last
        save) is saved as a version of its step first, on every rank: the Trainer's own
        save under ZeRO-3 without ``stage3_gather_16bit_weights_on_model_save`` writes
        no weights, only ``engine.save_checkpoint``, which here is a Rallypoint save."""
        version = self._version_in_memory()
        if self.is_deepspeed_enabled:
            version = self._agreed(version)
            if version is None and self.optimizer is not None and self.lr_scheduler is not None:
                # The Trainer's own save would end in engine.save_checkpoint (a Rallypoint
                # save here) and, under ZeRO-3 without the gather flag, write no weights:
                # the model in memory becomes a version of this step first, every rank
                # with the others, and that version is exported.
                self._save_checkpoint(self.model_wrapped, None)
                self.checkpoints.wait()
                version = self._agreed(self._version_in_memory())
        unwrapped = self.accelerator.unwrap_model(self.model)
        if version is None or self.is_fsdp_enabled or not isinstance(unwrapped, PreTrainedModel):
            super().save_model(output_dir, _internal_call)
            return
        out = output_dir if output_dir is not None else self.args.output_dir
        assert out is not None  # TrainingArguments defaults it
        if self.args.should_save:
            self._export(version, out, unwrapped)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _agreed(self, version: int | None) -> int | None:
        """``version`` if every rank holds it, else None on every rank: the Trainer's own
        save, which the ranks then take together, gathers under ZeRO-3."""
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return version
        every: list[int | None] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, version)
        return version if all(v == version for v in every) else None

    def _version_in_memory(self) -> int | None:
        """The committed version the model in memory holds, or None."""
        held, at = self._model_version, self._model_step
        if held is None or at != self.state.global_step:
            return None
        if isinstance(held, int):
            return held
        try:
            return held.result().version
        except Exception as exc:  # the save logged it; the model is here
            log.warning("save_model: the last save failed (%s); saving the model in memory", exc)
            return None

    def _export(self, version: int, out: str, model: PreTrainedModel) -> None:
        """Writes ``version``'s model to ``out`` in ``hf`` format, as the Trainer's
        ``_save`` would have written the model in memory, which it equals."""
        deepspeed = self.is_deepspeed_enabled
        try:
            export_version(
                self.checkpoints.client,
                out,
                version,
                format="hf",
                # A DeepSpeed version's tensors are the module's own state_dict names
                # (a Llama's lm_head.weight too); the others' are under model.
                only=None if deepspeed else "model.",
                # DeepSpeed's consolidation gives its fp32 master weights; the model in
                # memory (and the Trainer's save of it) is their bf16/fp16 copy.
                dtype=_EXPORT_DTYPES.get(model.dtype, "keep") if deepspeed else "keep",
                progress=self.checkpoints.policy.progress,
            )
        except (RallypointError, RallypointTrainerError) as exc:
            if deepspeed:
                # The other ranks have gone on: no gather of the model in memory.
                raise
            # The model in memory is that version: the Trainer's save of it is the same.
            log.warning(
                "save_model: exporting v%d failed (%s); saving the model in memory", version, exc
            )
            super()._save(out)
            return
        log.info("save_model: v%d exported to %s", version, out)
        # An export writes the configs the version recorded; a version that recorded
        # none (over the size limit, or saved before it did) gets the model's.
        if not os.path.exists(os.path.join(out, "config.json")):
            model.config.save_pretrained(out)
        generation = getattr(model, "generation_config", None)
        if generation is not None and not os.path.exists(
            os.path.join(out, "generation_config.json")
        ):
            generation.save_pretrained(out)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(out)
        elif getattr(self.data_collator, "tokenizer", None) is not None:
            self.data_collator.tokenizer.save_pretrained(out)  # type: ignore[union-attr]
        torch.save(self.args, os.path.join(out, "training_args.bin"))

    # --- data and batch -----------------------------------------------------------------

    def _plan(self, *, resumed: bool) -> None:
        """Sets this generation's per-device batch and accumulation steps in the args,
        before the Trainer builds its loader and computes ``max_steps`` from them."""
        args, saved = self.args, self._data if resumed else None
        try:
            plan = job_batch_plan(
                args.world_size,
                micro_batch=self._micro_batch,
                accumulation=self._accumulation,
                keep_global_batch=self.keep_global_batch,
                global_batch=self.global_batch_size,
                saved_global_batch=saved["global_batch"] if saved else None,
            )
        except WorldSizeError as exc:
            # The coordinator learns the sizes that can, and seals only those: no loop,
            # and the nodes beyond them wait as standbys.
            self.checkpoints.report_world_sizes(exc)
            raise
        self.batch_plan = plan
        args.per_device_train_batch_size = plan.micro_batch
        args.gradient_accumulation_steps = plan.accumulation
        # The Trainer copied the per-device batch at __init__.
        self._train_batch_size = args.train_batch_size
        if self.is_deepspeed_enabled:
            # TrainingArguments filled DeepSpeed's batch keys at their creation, and
            # the engine checks micro x accumulation x world against train_batch_size.
            config = self.accelerator.state.deepspeed_plugin.hf_ds_config.config
            config["train_micro_batch_size_per_gpu"] = plan.micro_batch
            config["gradient_accumulation_steps"] = plan.accumulation
            config["train_batch_size"] = plan.global_batch
        self._samples = int(saved["samples"]) if saved else 0
        self._horizon = saved.get("horizon") if saved else None
        if saved and self._horizon and plan.global_batch != saved["global_batch"]:
            state = json.loads(cast(str, self._files()[TRAINER_STATE]))
            new = horizon_steps(
                int(state["global_step"]),
                samples=self._samples,
                horizon=int(self._horizon),
                global_batch=plan.global_batch,
            )
            log.warning(
                "keep_global_batch=False: the global batch changes from %d to %d samples "
                "with the world; max_steps (the schedule's horizon) changes from %d to %d "
                "to train the job's %d samples",
                saved["global_batch"],
                plan.global_batch,
                state["max_steps"],
                new,
                self._horizon,
            )
            args.max_steps = new

    def _data_state(self) -> str:
        """The version's :data:`DATA` part."""
        assert self.batch_plan is not None
        return json.dumps(
            {
                "sampler": self.sampler.state_dict() if self.sampler is not None else None,
                "global_batch": self.batch_plan.global_batch,
                "samples": self._samples,
                "horizon": self._horizon,
            }
        )

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        """See base class. The elastic sampler, at the restored position."""
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        strategy = self.args.train_sampling_strategy
        self.sampler = None
        if not self.elastic_data or self._foreign or self.batch_plan is None:
            return super()._get_train_sampler(train_dataset)
        if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized):
            log.warning(
                "elastic_data: the training set has no length; the Trainer's own data order"
            )
            return super()._get_train_sampler(train_dataset)
        if strategy not in _ELASTIC_STRATEGIES:
            log.warning(
                "elastic_data: train_sampling_strategy=%r keeps the Trainer's sampler, which "
                "resumes exactly only at the same world size",
                strategy,
            )
            return super()._get_train_sampler(train_dataset)
        args = self.args
        self.sampler = EpochSampler(
            len(dataset),
            global_batch=self.batch_plan.global_batch,
            shuffle=strategy == "random",
            seed=args.data_seed if args.data_seed is not None else args.seed,
        )
        saved = self._data["sampler"] if self._data else None
        if saved is not None:
            self.sampler.load_state_dict(saved)
        return self.sampler

    def _init_training_state(
        self,
        max_steps: Any,
        num_update_steps_per_epoch: Any,
        num_train_epochs: Any,
        resume_from_checkpoint: Any,
        trial: Any,
    ) -> tuple[int, int]:
        """See base class. With the elastic sampler, the epoch is the sampler's and no
        batch is skipped: the sampler starts at the position."""
        init = cast(Callable[..., tuple[int, int]], super()._init_training_state)
        epochs, skipped = init(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if self._horizon is None and self.batch_plan is not None:
            self._horizon = int(max_steps) * self.batch_plan.global_batch
        if self._best_checkpoint is not None:
            self.state.best_model_checkpoint, self._best_checkpoint = self._best_checkpoint, None
        if self.sampler is None:
            return epochs, skipped
        return self.sampler.epoch, 0

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """See base class. With the elastic sampler the Trainer restores the RNG before
        it creates the epoch's iterator, which draws its seed from the global RNG; the
        uninterrupted run drew it at the epoch's start. Mid-epoch, deferred to
        :meth:`get_batch_samples`, so the next step starts from the saved RNG; at an
        epoch's start the uninterrupted run draws after it too."""
        if (
            self.sampler is not None
            and self.sampler.consumed > 0
            and checkpoint is not None
            and checkpoint == self._scratch
        ):
            self._rng_from = checkpoint
            return
        super()._load_rng_state(checkpoint)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        """See base class. Restores a deferred RNG state once the loader has drawn."""
        batches = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._rng_from is not None:
            folder, self._rng_from = self._rng_from, None
            super()._load_rng_state(folder)
        return batches


class _DataCallback(TrainerCallback):
    """Counts each optimizer step's samples into the position, before the Trainer
    decides to save after the step."""

    def __init__(self, trainer: RallypointTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        plan = self.trainer.batch_plan
        if plan is not None:
            log.info("%s; %d optimizer steps in all", plan.describe(), state.max_steps)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        plan, sampler = self.trainer.batch_plan, self.trainer.sampler
        if plan is not None:
            self.trainer._samples += plan.global_batch
        if sampler is not None:
            sampler.advance()
            # The Trainer counts the epoch from this generation's first batch.
            state.epoch = sampler.epoch + sampler.consumed / sampler.epoch_samples


def _deepspeed_scheduler(scheduler: Any) -> bool:
    return type(scheduler).__name__ == "DeepSpeedSchedulerWrapper"


def _rng_state() -> dict[str, Any]:
    """This process's RNG states, as the Trainer's ``_save_rng_state`` gathers them."""
    rng: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.random.get_rng_state_all()
    return rng
