"""Prometheus metrics: request counts and latency, heartbeats, checkpoint commits and
restores, and each job's generation, membership and versions by durability read at
scrape time.

Every series is bounded: routes are labelled by their template (``/v1/jobs/{job_id}``),
never by the path a caller sent, and jobs by id (a coordinator serves a handful).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rallypoint.client.models import JobStatus, RestoreSource

__all__ = ["Metrics"]

# Held requests (a heartbeat watch, a join, a store wait) last up to their hold time.
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# Every source a restore reads from, each counted even at 0 so the series exist at once.
_SOURCES: tuple[RestoreSource, ...] = ("memory", "peer", "storage")
_DURABILITIES = ("pending", "memory", "durable")


class _Jobs(Collector):
    """Each job's state, read when Prometheus scrapes (no per-request bookkeeping)."""

    def __init__(
        self,
        read: Callable[[], Iterable[JobStatus]],
        versions: Callable[[str], Mapping[str, int]] | None,
    ) -> None:
        self.read = read
        self.versions = versions

    def collect(self) -> Iterator[Metric]:
        gauges = {
            name: GaugeMetricFamily(f"rallypoint_{name}", documentation, labels=["job", *labels])
            for name, (documentation, labels) in _JOB_GAUGES.items()
        }
        hangs = CounterMetricFamily(
            "rallypoint_job_hangs",
            "Ranks found hung in the job so far: each ended its generation (read from the "
            "job's history, so every replica says the same)",
            labels=["job"],
        )
        for job in self.read():
            job_id = job.job_id
            health = job.health
            if health is not None:
                hangs.add_metric([job_id], health.hangs)
                gauges["job_stragglers"].add_metric([job_id], len(health.stragglers))
                if health.hang_limit is not None:
                    gauges["job_hang_limit_seconds"].add_metric([job_id], health.hang_limit)
            gauges["job_blocked"].add_metric([job_id], 1 if job.blocked else 0)
            gauges["nodes_quarantined"].add_metric([job_id], len(job.quarantined_nodes))
            gauges["job_generation"].add_metric([job_id], job.generation)
            gauges["job_world_size"].add_metric([job_id], job.world_size)
            for state in ("alive", "late", "dead", "left"):
                count = sum(m.state == state for m in job.members)
                gauges["job_members"].add_metric([job_id, state], count)
            standbys = sum(1 for w in job.waiting if w.standby)
            gauges["job_waiting_nodes"].add_metric([job_id], len(job.waiting) - standbys)
            gauges["job_standby_nodes"].add_metric([job_id], standbys)
            reasons: dict[str, int] = {}
            for g in job.history:
                if g.ended_reason:
                    kind = _reason_kind(g.ended_reason)
                    reasons[kind] = reasons.get(kind, 0) + 1
            for kind, count in sorted(reasons.items()):
                gauges["job_generations_ended"].add_metric([job_id, kind], count)
            if job.checkpoint is not None:
                gauges["job_checkpoint_step"].add_metric([job_id], job.checkpoint.step)
            if job.durable is not None:
                gauges["job_durable_checkpoint_step"].add_metric([job_id], job.durable.step)
            if self.versions is not None:
                counts = self.versions(job_id)
                for durability in _DURABILITIES:
                    gauges["checkpoint_versions"].add_metric(
                        [job_id, durability], counts.get(durability, 0)
                    )
                for mark in ("quarantined", "unrecoverable"):
                    gauges[f"checkpoint_{mark}"].add_metric([job_id], counts.get(mark, 0))
        yield from gauges.values()
        yield hangs


#: Each job's gauges, in the order they are exposed: the name after ``rallypoint_``, its
#: help, and the labels after ``job``.
_JOB_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "job_generation": ("The job's current generation number", ()),
    "job_world_size": ("Members of the running generation", ()),
    "job_members": ("Members by heartbeat state", ("state",)),
    "job_waiting_nodes": ("Nodes waiting for the next generation", ()),
    "job_standby_nodes": (
        "Nodes parked beside the running generation (standbys, hot joins, nodes waiting "
        "for a world size the job takes)",
        (),
    ),
    "job_generations_ended": (
        "Generations that ended (in the kept history), by reason",
        ("reason",),
    ),
    "job_checkpoint_step": ("Step of the latest committed checkpoint", ()),
    "job_durable_checkpoint_step": (
        "Step of the newest checkpoint whose every file is in blob storage",
        (),
    ),
    "checkpoint_versions": (
        "Checkpoint versions kept, by durability: pending, committed with some files "
        "only in nodes' memory, or all in blob storage",
        ("durability",),
    ),
    "checkpoint_quarantined": (
        "Checkpoint versions kept that an operator quarantined (never resumed from)",
        (),
    ),
    "checkpoint_unrecoverable": (
        "Checkpoint versions kept that a rank could not load when they were named "
        "(never resumed from again)",
        (),
    ),
    "job_blocked": (
        "1 while the job's open round holds back: generations in a row made no progress, "
        "a world size failed to load its checkpoint in the generations before, or its "
        "nodes make no world size the job takes (see the job's status: blocked)",
        (),
    ),
    "job_stragglers": (
        "Ranks of the running generation named stragglers now (their own step time "
        "stayed slow against the fastest rank's; the job's status names them)",
        (),
    ),
    "job_hang_limit_seconds": (
        "Seconds a training rank of the running generation may show no progress before "
        "it is hung (set on the job or learned from its steps; absent while warming or "
        "off)",
        (),
    ),
    "nodes_quarantined": (
        "Nodes the job does not admit (an operator's quarantine, or lost too often)",
        (),
    ),
}


# "node b left: preempted" -> "left": the kind of ending, not the node (bounded labels);
# "checkpoint v7 quarantined: ..." (an operator's restart) -> "quarantined"; a node the
# job's straggler policy replaced or dropped -> "straggler".
_REASON = re.compile(
    r"(?:node|member|checkpoint|rank) \S+ (?:on node \S+ )?"
    r"(joined|re-joined|dropped|missed|left|quarantined: straggler|quarantined|could not load"
    r"|cannot train|hung)"
)


def _reason_kind(reason: str) -> str:
    match = _REASON.match(reason)
    return (
        match.group(1)
        .replace("quarantined: straggler", "straggler")
        .replace("-", "")
        .replace("could not load", "load_failed")
        .replace("cannot train", "world_size")
        if match
        else "other"
    )


class Metrics:
    """The coordinator's metrics, on a registry of its own (one per app).

    Args:
        jobs: Returns every job's status; called at each scrape, from a worker thread.
        versions: Returns a job's checkpoint versions by durability (``pending``,
            ``memory``, ``durable``) and how many are ``quarantined``; called for each
            job at each scrape.
    """

    def __init__(
        self,
        jobs: Callable[[], Iterable[JobStatus]],
        versions: Callable[[str], Mapping[str, int]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "rallypoint_http_requests",
            "HTTP requests by route template and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "rallypoint_http_request_duration_seconds",
            "Time to answer, by route (held requests include their hold)",
            ["method", "route"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.heartbeats = Counter(
            "rallypoint_heartbeats", "Heartbeats received", ["job"], registry=self.registry
        )
        self.faults = Counter(
            "rallypoint_collective_faults",
            "Members' reports of a collective that failed while their generation ran "
            "(each lets a cut heartbeat watch of that generation count at once)",
            ["job"],
            registry=self.registry,
        )
        self.generation_misses = Counter(
            "rallypoint_generation_miss_reads",
            "Reads of a job a request caused by naming a generation newer than this "
            "replica's snapshot (sealed through another replica since its last pass)",
            ["job"],
            registry=self.registry,
        )
        self.commits = Counter(
            "rallypoint_checkpoint_commits",
            "Checkpoint versions committed through this process",
            ["job"],
            registry=self.registry,
        )
        self.committed_bytes = Counter(
            "rallypoint_checkpoint_committed_bytes",
            "Bytes of the checkpoint versions committed through this process",
            ["job"],
            registry=self.registry,
        )
        self.restore_bytes = Counter(
            "rallypoint_checkpoint_restore_bytes",
            "Bytes ranks' restores read, by source: the node's own memory tier, a peer "
            "node's, or blob storage (as the ranks reported them to this process)",
            ["job", "source"],
            registry=self.registry,
        )
        self.registry.register(_Jobs(jobs, versions))

    def generation_missed(self, job_id: str) -> None:
        """Counts a read of the job for a generation newer than this replica's snapshot."""
        self.generation_misses.labels(job_id).inc()

    def committed(self, job_id: str, size: int) -> None:
        """Counts a version this process committed, of ``size`` bytes in all."""
        self.commits.labels(job_id).inc()
        self.committed_bytes.labels(job_id).inc(size)

    def restored(self, job_id: str, bytes_from: Mapping[RestoreSource, int]) -> None:
        """Counts the bytes one rank's restore read, by source."""
        for source in _SOURCES:
            self.restore_bytes.labels(job_id, source).inc(bytes_from.get(source, 0))

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """Wraps ``app`` to count and time every HTTP request."""
        metrics = self

        async def timed(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            started = time.perf_counter()
            status = 500

            async def sending(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            try:
                await app(scope, receive, sending)
            finally:
                route = scope.get("route")
                # Unmatched paths share one label: a scanner must not mint series.
                name = getattr(route, "path", "unmatched")
                method = scope["method"]
                metrics.requests.labels(method, name, str(status)).inc()
                metrics.latency.labels(method, name).observe(time.perf_counter() - started)

        return timed
