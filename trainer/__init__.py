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

import importlib
from typing import TYPE_CHECKING, Any

from ._batch import BatchPlan, plan_batch, world_sizes
from ._preemption import RESTART_EXIT_CODE, Notice, PreemptionWatcher
from ._progress import Progress
from ._regroup import Follower, Generation, generations
from ._sampler import ElasticSampler
from ._worlds import report_world_sizes
from .agent import (
    BACKEND,
    CoordinatorStore,
    RallypointRendezvousHandler,
    RendezvousSettings,
    run,
    torchrun_argv,
)
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
    WorldSizeError,
)
from .health import StepReporter, phase, report_steps

if TYPE_CHECKING:
    from .checkpoint import (
        CheckpointManager,
        Exported,
        ExportFormat,
        RallypointReader,
        RallypointWriter,
        Restored,
        SaveHandle,
        SavePolicy,
        download,
        export,
        upload,
    )


# The checkpoint path's names (the rest of __all__, unbound until asked for) load on first
# use. torchrun's agent reaches its plugin (rallypoint.trainer.agent) through this
# package, and DCP's import (torch.distributed.tensor, sympy) cost every agent 1.4 s of
# CPU at start-up for a path only workers run.
def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".checkpoint", __name__), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "BACKEND",
    "RESTART_EXIT_CODE",
    "BatchPlan",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointManager",
    "CoordinatorStore",
    "ElasticSampler",
    "ExportFormat",
    "Exported",
    "Follower",
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
    "SavePolicy",
    "StateNotReplicated",
    "StepReporter",
    "TransferDenied",
    "TransferError",
    "TransferNotFound",
    "WorldSizeError",
    "download",
    "export",
    "generations",
    "phase",
    "plan_batch",
    "report_steps",
    "report_world_sizes",
    "run",
    "torchrun_argv",
    "upload",
    "world_sizes",
]
