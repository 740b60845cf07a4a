"""The parts of the Lightning integration that know Rallypoint, not Lightning's classes.

A Lightning checkpoint is one dict: tensors (``state_dict``, each optimizer's ``state``)
and the trainer's bookkeeping (loops, callbacks, hyperparameters, schedulers, optimizer
``param_groups``). The tensors go through DCP as they are (DTensors sharded, DDP's
replicated ones written once); the bookkeeping, which may hold any picklable object, goes
as one string item that DCP writes once. Every rank calls :meth:`Session.save` and
:meth:`Session.load` alike.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch

from rallypoint.client import ElasticClient

from ._checkpoint import CheckpointManager, Restored

__all__ = ["RESUME_SCHEME", "Session", "is_resume_path", "pack", "unpack"]

log = logging.getLogger("rallypoint.trainer")

#: The "path" Lightning is given to resume from: ``rallypoint://JOB/vVERSION``. Nothing
#: is read from it; it names the coordinator's version in Lightning's own log lines.
RESUME_SCHEME = "rallypoint://"
_TENSORS = ("state_dict", "optimizer_states")
_BOOKKEEPING = "lightning"


def is_resume_path(path: object) -> bool:
    return str(path).startswith(RESUME_SCHEME)


def pack(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The state CheckpointManager saves for a Lightning checkpoint dict."""
    rest = {k: v for k, v in checkpoint.items() if k not in _TENSORS}
    optimizers = checkpoint.get("optimizer_states", [])
    # param_groups hold whatever an optimizer keeps (tuples, None, its own objects):
    # they go pickled with the bookkeeping; only the tensors go through DCP.
    rest["__param_groups__"] = [o.get("param_groups") for o in optimizers]
    buffer = io.BytesIO()
    torch.save(rest, buffer)
    return {
        "state_dict": checkpoint.get("state_dict", {}),
        "optimizer_states": [{"state": o.get("state", {})} for o in optimizers],
        _BOOKKEEPING: base64.b64encode(buffer.getvalue()).decode("ascii"),
    }


def unpack(state: dict[str, Any], weights_only: bool | None = None) -> dict[str, Any]:
    """The Lightning checkpoint dict from what :func:`pack` saved."""
    raw = base64.b64decode(state[_BOOKKEEPING])
    # The bookkeeping is Lightning's own dict (loops, callbacks, hyperparameters), checked
    # against its checksum on read: trusted as a .ckpt file Lightning wrote would be.
    rest: dict[str, Any] = torch.load(
        io.BytesIO(raw), weights_only=bool(weights_only), map_location="cpu"
    )
    groups = rest.pop("__param_groups__", [])
    checkpoint = dict(rest)
    checkpoint["state_dict"] = state["state_dict"]
    checkpoint["optimizer_states"] = [
        {"state": o["state"], "param_groups": g}
        for o, g in zip(state["optimizer_states"], groups, strict=True)
    ]
    return checkpoint


class Session:
    """One training process's link to the coordinator, made when first needed (Lightning
    builds its strategies before torchrun's environment is read).

    Args:
        client: The node's client; defaults to ``ElasticClient.from_env()``, joined.
        persist_every, persist_after, if_busy: See :class:`CheckpointManager`.
    """

    def __init__(
        self,
        client: ElasticClient | None = None,
        *,
        persist_every: int = 1,
        persist_after: float | timedelta | None = None,
        if_busy: Literal["wait", "skip"] = "wait",
    ) -> None:
        self._client = client
        self._manager: CheckpointManager | None = None
        self._options: dict[str, Any] = {
            "persist_every": persist_every,
            "persist_after": persist_after,
            "if_busy": if_busy,
        }
        #: What the last load restored (its ``state`` dropped), for reports.
        self.restored: Restored | None = None
        self._saved: tuple[int, bool] | None = None

    @property
    def client(self) -> ElasticClient:
        if self._client is None:
            self._client = ElasticClient.from_env()
        if self._client.assignment is None:
            self._client.join()  # under torchrun: the agent's assignment, no new round
        return self._client

    @property
    def manager(self) -> CheckpointManager:
        if self._manager is None:
            self._manager = CheckpointManager(self.client, progress=False, **self._options)
        return self._manager

    def resume_path(self) -> str | None:
        """The version the coordinator named for this generation, as a path for
        Lightning; None if the job has no checkpoint yet."""
        pointer = self.manager.assignment.checkpoint
        if pointer is None:
            return None
        return f"{RESUME_SCHEME}{self.client.job_id}/v{pointer.version}"

    def save(self, checkpoint: dict[str, Any], path: object, *, persist: bool = False) -> None:
        """Saves Lightning's checkpoint dict as the version of its ``global_step``; every
        rank calls it. Returns once the tensors are staged."""
        step = int(checkpoint.get("global_step", 0))
        if self._saved is not None and self._saved[0] == step and (self._saved[1] or not persist):
            # ModelCheckpoint saves the same step twice (top-k, then "last"), and a
            # version becomes latest only if its step is newer: one version per step.
            log.debug("step %d is saved already (as %s)", step, path)
            return
        metadata = {"epoch": int(checkpoint.get("epoch", 0)), "path": str(path)}
        self.manager.save(
            pack(checkpoint),
            step,
            rank_state={"torch_rng": torch.get_rng_state()},
            metadata=metadata,
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
        """Loads the version this generation resumes from, whatever ``path`` says.

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
        expected = self.resume_path()
        if expected is None:
            raise FileNotFoundError(f"{path}: the coordinator names no checkpoint to resume from")
        if str(path) != expected:
            log.warning("loading %s, the coordinator's version, not %s", expected, path)
        if template is not None:
            template = {**template, _BOOKKEEPING: ""}
        restored = self.manager.load_latest(template)
        assert restored is not None
        state: dict[str, Any] = restored.state
        if apply is not None:
            apply(state)
        if isinstance(restored.rank_state, dict) and "torch_rng" in restored.rank_state:
            torch.set_rng_state(restored.rank_state["torch_rng"])
        checkpoint = unpack(state, weights_only)
        checkpoint["rallypoint"] = {
            "version": restored.version,
            "step": restored.step,
            "generation": restored.generation,
            "saved_by": restored.world_size,
            "bytes_from": dict(restored.bytes_from),
        }
        self.restored = dataclasses.replace(restored, state=None)
        # A step to resume from: nothing saved since is this generation's yet.
        self._saved = (restored.step, True)
        return checkpoint

    def wait(self) -> None:
        if self._manager is not None:
            self._manager.wait()
