"""A world the job cannot take, told to the coordinator: :func:`report_world_sizes`.

A world that cannot split the job's global batch raises
:class:`~rallypoint.trainer.errors.WorldSizeError` before anything trains
(:func:`~rallypoint.trainer.plan_batch`), naming the rank counts that can. Restarting
would seal the same world again. Reported, the coordinator keeps the sizes (in nodes: the
valid rank counts over this node's processes) and ends the generation; from then on it
seals only a size the job takes, the largest its nodes make, and nodes beyond it wait as
standbys.

Who reports: ``CheckpointManager.loading()`` (which the integrations wrap their batch
planning in) and the HF Trainer's planning; under the rallypoint agent, a worker whose
uncaught exception is a ``WorldSizeError`` (its excepthook, :mod:`.agent._quiet`); a
hand-written loop calls this where it catches one. An error is reported once, however
many of these see it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from rallypoint.client import (
    GENERATION_ENV,
    JOB_ENV,
    URL_ENV,
    ElasticClient,
    RallypointError,
    StaleGeneration,
)
from rallypoint.client.models import MAX_NODES_LIMIT, MAX_WORLD_SIZES

from .errors import WorldSizeError

__all__ = ["node_sizes", "report_world_sizes"]

log = logging.getLogger("rallypoint.trainer")


def node_sizes(valid: Iterable[int], local_world_size: int) -> list[int]:
    """The world sizes in nodes, for nodes of ``local_world_size`` processes each: the
    valid rank counts that are whole nodes, ascending (at most
    :data:`~rallypoint.client.models.MAX_WORLD_SIZES`, the smallest)."""
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
    nodes = {r // local_world_size for r in valid if r >= 1 and r % local_world_size == 0}
    return sorted(n for n in nodes if n <= MAX_NODES_LIMIT)[:MAX_WORLD_SIZES]


def report_world_sizes(
    error: WorldSizeError,
    client: ElasticClient | None = None,
    *,
    rank: int | None = None,
    local_world_size: int | None = None,
    generation: int | None = None,
) -> list[int] | None:
    """Tells the coordinator that this generation's world cannot train the job, and
    which world sizes can (:meth:`ElasticClient.report_world_sizes
    <rallypoint.client.ElasticClient.report_world_sizes>`): the generation ends, and the
    next one seals a size the job takes. Every rank may call it; the first report counts.
    Never raises: a report that comes too late (another rank's ended the generation) or
    a coordinator out of reach is logged, and the restart that follows goes on as before.

    Args:
        error: What :func:`~rallypoint.trainer.plan_batch` raised (its ``valid`` rank
            counts). Reported once: a second call with it does nothing.
        client: The node's client; default: ``ElasticClient.from_env()`` (a worker
            under torchrun's rallypoint backend), or nothing is reported outside a job.
        rank: This process's global rank; default ``RANK``, else 0.
        local_world_size: Processes per node; default ``LOCAL_WORLD_SIZE``, else 1.
        generation: The generation it failed in; default: the client's.

    Returns:
        The world sizes, in nodes, the job takes now (None: nothing was reported, or the
        job takes any).
    """
    if error.reported:
        return None
    error.reported = True
    own = client is None
    if client is None:
        if not (os.environ.get(URL_ENV) and os.environ.get(JOB_ENV)):
            return None  # not a worker of a job: nobody to tell
        try:
            client = ElasticClient.from_env()
        except ValueError as exc:
            log.warning("rallypoint: could not report the world sizes: %s", exc)
            return None
    try:
        local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
        sizes = node_sizes(error.valid, local)
        if generation is None and client.assignment is None and os.environ.get(GENERATION_ENV):
            generation = int(os.environ[GENERATION_ENV])
        job = client.report_world_sizes(
            sizes,
            f"{type(error).__name__}: {error}",
            rank=int(os.environ.get("RANK") or 0) if rank is None else rank,
            generation=generation,
        )
    except StaleGeneration:
        return None  # another rank's report (or another end) came first
    except (RallypointError, ValueError) as exc:
        log.warning("rallypoint: could not report the world sizes: %s", exc)
        return None
    finally:
        if own:
            client.close()
    log.warning(
        "rallypoint: a world of %d ranks cannot train this job (%s); the coordinator now "
        "seals worlds of %s nodes",
        error.world_size,
        error,
        ", ".join(map(str, job.world_sizes or [])) or "no size",
    )
    return job.world_sizes
