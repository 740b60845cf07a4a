"""The agent's side: what runs in torchrun's agent process (or ``rallypoint run``), not
in the workers. The rendezvous handler torchrun's ``--rdzv-backend=rallypoint`` loads
(through the ``torchrun.handlers`` entry point, ``_plugin``), the store torchrun's agents
share through the coordinator, the launcher, and the board on which the agent posts a
generation's assignment for the workers that regroup in place (they read it through
:mod:`rallypoint.trainer`'s ``generations``).
"""

from ._board import REGROUP_ENV, Board, Posted
from ._launch import (
    FLIGHT_RECORDER_ENTRIES,
    MALLOC_ARENAS,
    RUN_ENV,
    WARM_MODULES,
    WARM_MODULES_ENV,
    run,
    torchrun_argv,
    warm_modules,
    worker_defaults,
)
from ._quiet import QUIET_ENV, QUIET_WAIT_ENV, generation_end, install_excepthook
from ._rendezvous import BACKEND, START_GATE_ENV, RallypointRendezvousHandler, RendezvousSettings
from ._store import CoordinatorStore

__all__ = [
    "BACKEND",
    "FLIGHT_RECORDER_ENTRIES",
    "MALLOC_ARENAS",
    "QUIET_ENV",
    "QUIET_WAIT_ENV",
    "REGROUP_ENV",
    "RUN_ENV",
    "START_GATE_ENV",
    "WARM_MODULES",
    "WARM_MODULES_ENV",
    "Board",
    "CoordinatorStore",
    "Posted",
    "RallypointRendezvousHandler",
    "RendezvousSettings",
    "generation_end",
    "install_excepthook",
    "run",
    "torchrun_argv",
    "warm_modules",
    "worker_defaults",
]
