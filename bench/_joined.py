"""The one node of a one-node job, joined and beating: what the checkpoint benches save
through (a trainer beats while it saves; so do they)."""

from __future__ import annotations

from datetime import timedelta

from rallypoint.client import ElasticClient, Heartbeats, JobSpec


def joined(url: str, job: str) -> tuple[ElasticClient, Heartbeats]:
    """Joins ``job`` at ``url`` as node ``n0`` of one; the client and its heartbeats
    (``stop()`` them before the coordinator goes)."""
    client = ElasticClient(url, job, "n0")
    spec = JobSpec(min_nodes=1, max_nodes=1, last_call=timedelta(0))
    client.join("127.0.0.1", 29500, spec=spec, timeout=timedelta(seconds=60))
    return client, client.heartbeats(timedelta(seconds=1))
