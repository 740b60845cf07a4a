"""What runs inside a training process (``pip install rallypoint[trainer]``).

Example::

    from rallypoint.client import ElasticClient
    from rallypoint.trainer import CheckpointManager, ElasticSampler

    client = ElasticClient.from_env()
    assignment = client.join()
    checkpoints = CheckpointManager(client)
    sampler = ElasticSampler(dataset, rank=assignment.rank, world_size=assignment.world_size)
    if (restored := checkpoints.load_latest()) is not None:
        model.load_state_dict(restored.state["model"])
        sampler.load_state_dict(restored.state["sampler"])
    ...
    checkpoints.save({"model": model.state_dict(), "sampler": sampler.state_dict()}, step)
"""

from ._checkpoint import CheckpointManager, Restored, SaveHandle
from ._dcp import RallypointReader, RallypointWriter
from ._launch import run, torchrun_argv
from ._preemption import RESTART_EXIT_CODE, Notice, PreemptionWatcher
from ._progress import Progress
from ._regroup import Generation, generations
from ._rendezvous import BACKEND, RallypointRendezvousHandler, RendezvousSettings
from ._sampler import ElasticSampler
from ._store import CoordinatorStore
from ._transfer import download, upload
from .errors import (
    CheckpointCorrupt,
    CheckpointError,
    GenerationEnded,
    RallypointTrainerError,
    RegroupError,
    StateNotReplicated,
    TransferDenied,
    TransferError,
    TransferNotFound,
)

__all__ = [
    "BACKEND",
    "RESTART_EXIT_CODE",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointManager",
    "CoordinatorStore",
    "ElasticSampler",
    "Generation",
    "GenerationEnded",
    "Notice",
    "PreemptionWatcher",
    "Progress",
    "RallypointReader",
    "RallypointRendezvousHandler",
    "RallypointTrainerError",
    "RallypointWriter",
    "RegroupError",
    "RendezvousSettings",
    "Restored",
    "SaveHandle",
    "StateNotReplicated",
    "TransferDenied",
    "TransferError",
    "TransferNotFound",
    "download",
    "generations",
    "run",
    "torchrun_argv",
    "upload",
]
