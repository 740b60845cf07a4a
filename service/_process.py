"""The coordinator process's global settings: one function, each with its measured reason.

Nothing else in the service changes process-wide state: building the app, its storage
adapters or its routers has no global side effect, so tests and embedders that build
an app in their own process keep theirs. The server ``rallypoint serve`` runs
(:func:`~.app.server`) calls :func:`tune` once, when it has started; one built with
``own_process=False`` does not.
"""

from __future__ import annotations

import gc
import logging
import sys

__all__ = ["tune"]

log = logging.getLogger("rallypoint.service")


def tune() -> None:
    """Applies the coordinator's process-wide settings (call once the app has started:
    what exists then lives as long as the process)."""
    # The event loop answers heartbeats while storage calls run in worker threads; by
    # default a thread that wants the GIL waits up to 5 ms for the one holding it, which
    # made that the median heartbeat's latency at 1,024 beats/s on Azurite (8.7 ms; 1 ms
    # here: 3.8 ms).
    sys.setswitchinterval(0.001)
    # azure-core prepares each table transaction's sub-requests in thread pools and
    # writes and parses its body with the email package: a third of the coordinator's
    # samples in a 1,024-node rendezvous on Azurite, and 2.2-2.4x fewer transactions/s
    # than the in-order path (bench/storage.py --parts batch). Only on the azure-core
    # releases it was tested on (service/storage/_azure_batch.py); others keep their own.
    try:
        from .storage import use_batch_path
    except ImportError:  # pragma: no cover - the service extra brings azure-core
        pass
    else:
        use_batch_path()
    # What exists now (modules, the app, storage clients) lives as long as the process:
    # out of the collector's sight, a full collection walks only what requests made. At
    # 1,024 beats/s a full collection ran every ~4.5 s and held the GIL for 100-150 ms,
    # which set the heartbeats' p99.
    gc.freeze()
    # A young collection every 10,000 allocations, not 700: 10,000 held joins keep
    # their coroutines, tasks and futures alive, and at 700 the collector ran 2,233
    # times in a 10,000-node round, 12 of them full (2.68 s of the round's 8.35 s of
    # CPU); at 10,000, 339 times and once full (1.06 s; the round's CPU 6.2-6.8 s).
    # Cycles wait longer to be freed: at most ~10,000 young objects more.
    gc.set_threshold(10_000, *gc.get_threshold()[1:])
    log.debug("process tuned: switch interval 1 ms, batch path, gc frozen, young gc 10,000")
