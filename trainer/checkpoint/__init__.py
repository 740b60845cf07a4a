"""The worker's checkpoint path: :class:`CheckpointManager` over DCP, with Rallypoint's
storage writer and reader (scoped URLs, the fenced commit), the staging of the state
(the copy that overlaps training), and the transfers to and from blob storage.

Runs in every training process. The memory tier it writes through is
:mod:`rallypoint.trainer.memory`; the coordinator it reports to is reached through
:class:`rallypoint.client.ElasticClient`.
"""

from ._dcp import RallypointReader, RallypointWriter
from ._export import Exported, ExportFormat, export
from ._manager import CheckpointManager, Restored, SaveHandle
from ._policy import SavePolicy
from ._transfer import download, upload

__all__ = [
    "CheckpointManager",
    "ExportFormat",
    "Exported",
    "RallypointReader",
    "RallypointWriter",
    "Restored",
    "SaveHandle",
    "SavePolicy",
    "download",
    "export",
    "upload",
]
