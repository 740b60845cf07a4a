"""Joining before the process group: what each framework adapter does before its
framework builds the group from torchrun's variables.

A node that joins a running job parks (a hot join, ``rallypoint run``'s default) and
starts its workers at once in a one-node placeholder world whose master port is 65536.
Each worker must reach ``ElasticClient.join()`` before it builds its process group:
there it waits until the node goes in, and ``join()`` then sets ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` to its assignment's, which every
framework reads (``env://``). A worker that builds its group first fails at the
placeholder, and the node goes in cold. For any other worker of an agent, ``join()``
takes the agent's assignment and starts no round.
"""

from __future__ import annotations

import os

from rallypoint.client import GENERATION_ENV, STANDBY_ROUND_ENV, ElasticClient

__all__ = ["join_first", "under_agent"]


def under_agent() -> bool:
    """Whether this process is a worker that a Rallypoint agent started (torchrun's
    rallypoint backend, ``rallypoint run``): its ``join()`` starts no round."""
    return bool(os.environ.get(GENERATION_ENV) or os.environ.get(STANDBY_ROUND_ENV))


def join_first(client: ElasticClient | None = None) -> ElasticClient:
    """``client`` (default ``ElasticClient.from_env()``), joined: on a parked node,
    once the node went in, with torchrun's variables then the assignment's.

    Raises:
        ValueError: No client given and the environment names no job.
        RallypointError: As ``ElasticClient.join``.
    """
    client = client if client is not None else ElasticClient.from_env()
    if client.assignment is None:
        client.join()
    return client
