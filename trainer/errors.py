"""Errors raised by the trainer-side helpers.

Hierarchy::

    RallypointTrainerError
    ├── TransferError          moving bytes to or from storage failed
    │   ├── TransferDenied     the signed URL is expired, tampered or out of scope
    │   └── TransferNotFound   the object a read URL names does not exist
    └── CheckpointError        a checkpoint could not be saved or loaded
        ├── CheckpointCorrupt  a file is missing, truncated or fails its checksum
        └── StateNotReplicated a plain tensor of ``state`` differs across ranks
"""

from __future__ import annotations

__all__ = [
    "CheckpointCorrupt",
    "CheckpointError",
    "RallypointTrainerError",
    "StateNotReplicated",
    "TransferDenied",
    "TransferError",
    "TransferNotFound",
]


class RallypointTrainerError(Exception):
    """Base of every error the trainer helpers raise; ``code`` is machine-readable."""

    code = "trainer_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


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
