"""Errors raised by the trainer-side helpers.

Hierarchy::

    RallypointTrainerError
    ├── TransferError          moving bytes to or from storage failed
    │   ├── TransferDenied     the signed URL is expired, tampered or out of scope
    │   └── TransferNotFound   the object a read URL names does not exist
    ├── CheckpointError        a checkpoint could not be saved or loaded
    │   ├── CheckpointCorrupt  a file is missing, truncated or fails its checksum
    │   └── StateNotReplicated a plain tensor of ``state`` differs across ranks
    └── WorldSizeError         this world size cannot keep the job's global batch
"""

from __future__ import annotations

from rallypoint.coded import CodedError

__all__ = [
    "CheckpointCorrupt",
    "CheckpointError",
    "GenerationEnded",
    "RallypointTrainerError",
    "RegroupError",
    "StateNotReplicated",
    "TransferDenied",
    "TransferError",
    "TransferNotFound",
    "WorldSizeError",
]


class RallypointTrainerError(CodedError):
    """Base of every error the trainer helpers raise; ``code`` is machine-readable."""

    code = "trainer_error"


class TransferError(RallypointTrainerError):
    code = "transfer_failed"


class TransferDenied(TransferError):
    code = "access_denied"


class TransferNotFound(TransferError):
    code = "not_found"


class CheckpointError(RallypointTrainerError):
    """A checkpoint could not be saved or loaded; the message says which and why."""

    code = "checkpoint_failed"


class CheckpointCorrupt(CheckpointError):
    """A shard is missing, truncated, or its bytes do not match the manifest's checksum."""

    code = "checkpoint_corrupt"


class StateNotReplicated(CheckpointError):
    """A plain (non-DTensor) tensor of ``state`` differs across ranks: it would be saved
    from one rank only. Per-rank values belong in ``rank_state``; sharded ones in DTensors.
    Raised by ``verify_replicated=True``, before a byte is uploaded."""

    code = "state_not_replicated"


class RegroupError(RallypointTrainerError):
    """A worker could not go into the next generation in place (the next generation did
    not come, or a save of the ended one did not finish): it exits, and its agent
    restarts it."""

    code = "regroup_failed"


class GenerationEnded(RallypointTrainerError):
    """Raised by :meth:`Generation.check <rallypoint.trainer.Generation.check>` once the
    generation ended (a member died or left, or a node joined); the ``with generation:``
    block swallows it."""

    code = "generation_ended"


class WorldSizeError(RallypointTrainerError):
    """This generation's world size cannot split the job's global batch exactly, so the
    data position and the learning-rate schedule would not carry over; raised before
    training, naming the sizes that can (``valid``, in ranks). Reported to the
    coordinator (:func:`~rallypoint.trainer.report_world_sizes`), it ends the generation
    and the job takes only those sizes from then on; ``reported`` says it was."""

    code = "world_size_unsupported"

    def __init__(
        self, message: str, *, world_size: int, global_batch: int, valid: list[int]
    ) -> None:
        super().__init__(message)
        self.world_size = world_size
        self.global_batch = global_batch
        self.valid = valid
        self.reported = False
