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
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import tempfile
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

from rallypoint.client import ElasticClient

from ._pack import pack, unpack
from ._preemption import PreemptionWatcher
from .checkpoint import CheckpointManager, Restored, SaveHandle, SavePolicy

__all__ = ["PreemptionCallback", "RallypointTrainer"]

log = logging.getLogger("rallypoint.trainer")

TRAINER_STATE = "trainer_state.json"
SCHEDULER = "scheduler.pt"


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

    Attributes:
        checkpoints: The manager.
        restored: What the last resume restored (``bytes_from`` says from where).
        emergency: The next save (or the one in progress, while callbacks' ``on_save``
            runs) is the emergency one.
        last_save: The last save's handle (its ``blocked`` time and the version).
    """

    def __init__(
        self,
        *args: Any,
        rallypoint_client: ElasticClient | None = None,
        checkpoint_policy: SavePolicy | None = None,
        watch_preemption: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        client = rallypoint_client or ElasticClient.from_env()
        if client.assignment is None:
            client.join()
        self.checkpoints = CheckpointManager(client, policy=checkpoint_policy)
        self.restored: Restored | None = None
        self.emergency = False
        self.last_save: SaveHandle | None = None
        self._scratch: str | None = None
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
            ours.extra = {TRAINER_STATE: trainer_state}
            if not _deepspeed_scheduler(scheduler):
                ours.extra[SCHEDULER] = scheduler.state_dict()
            ours.extra_rank = {"rng_state.pth": rng}
            ours.step = step
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
            }
            self.last_save = self.checkpoints.save(
                state,
                step,
                rank_state={"rng": pack(rng)},
                metadata={"checkpoint": f"checkpoint-{step}", "framework": "transformers"},
                persist=emergency,
                blocking=emergency,
            )
        if emergency and self.watcher is not None:
            self.checkpoints.wait()
            # The Trainer runs on_save after this method returns, which it never does
            # here: callbacks see the emergency save before this process leaves.
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)
            self.watcher.finish()  # leaves (the notified node) or awaits the restart
        self.emergency = False

    # --- resuming -----------------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """See base class. ``resume_from_checkpoint=True`` resumes from the
        coordinator's version for this generation, or starts afresh if it names none."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._restore()
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
        self._scratch = tempfile.mkdtemp(prefix="rallypoint-trainer-")
        with open(os.path.join(self._scratch, TRAINER_STATE), "w", encoding="utf-8") as f:
            f.write(files[TRAINER_STATE])
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
                "rng": unpack(own[file_key("rng_state.pth")])
                if file_key("rng_state.pth") in own
                else None,
            }
        return {
            TRAINER_STATE: unpack(state["trainer_state"]),
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
            assert self.restored is not None
            optimizer, scheduler = self.optimizer, self.lr_scheduler
            assert optimizer is not None and scheduler is not None
            if ours is not None:
                ours.restore(self.restored)
                folder = ours.stand_in()
                # model_wrapped is annotated as a Module; with DeepSpeed it is the engine.
                engine: Any = self.model_wrapped
                load_path, _ = engine.load_checkpoint(
                    folder, tag=ours.tag, load_optimizer_states=True, load_lr_scheduler_states=True
                )
                if load_path is None:
                    raise RuntimeError(
                        f"DeepSpeed could not load checkpoint v{self.restored.version}"
                    )
                if not _deepspeed_scheduler(scheduler):
                    scheduler.load_state_dict(ours.load(SCHEDULER))
            else:
                optimizer.load_state_dict(unpack(self.restored.state["optimizer"]))
                scheduler.load_state_dict(unpack(self.restored.state["scheduler"]))
        return model, train_dataloader


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
