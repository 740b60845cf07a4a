"""Trainer-side helpers: what runs inside a training process (``rallypoint[trainer]``)."""

from ._transfer import download, upload
from .errors import RallypointTrainerError, TransferDenied, TransferError, TransferNotFound

__all__ = [
    "RallypointTrainerError",
    "TransferDenied",
    "TransferError",
    "TransferNotFound",
    "download",
    "upload",
]
