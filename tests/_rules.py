"""Helpers the tests share for the coordinator's rules in-process: a ``Rendezvous`` and its
``Checkpoints`` on a storage backend, no HTTP, on the clock the test advances (the
``rdzv``, ``ckpts`` and ``clock`` fixtures of ``conftest.py``).

Every job here is ``"job"``; nodes register at ``host-{node}``. A coordinator at work
(HTTP, clients, the CLI) has its helpers in ``tests/_support.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Literal, TypedDict

from typing_extensions import Unpack

from rallypoint.client.models import (
    Assignment,
    BeginCheckpoint,
    JobSpec,
    KeepBest,
    ReportShard,
    ShardFile,
)
from rallypoint.service._checkpoints import Checkpoints
from rallypoint.service._rendezvous import Job, Rendezvous
from rallypoint.service.storage import BlobStore

from ._support import FILE
from .conftest import Clock

__all__ = [
    "Reported",
    "assignment",
    "begin_all",
    "commit",
    "end",
    "join",
    "named",
    "peer",
    "pointers",
    "register_all",
    "report",
    "save",
    "save_tiered",
    "seal",
    "seal_and_save",
    "seal_with_peers",
    "spec",
]


def spec(min_nodes: int, max_nodes: int, last_call: float = 5, timeout: float = 3) -> JobSpec:
    """A job spec on the rules' clock (the test advances it: short timeouts cost nothing)."""
    return JobSpec(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        last_call=timedelta(seconds=last_call),
        heartbeat_timeout=timedelta(seconds=timeout),
    )


def join(
    rdzv: Rendezvous,
    job_id: str,
    node_id: str,
    addr: str,
    port: int,
    s: JobSpec | None = None,
    join_id: str | None = None,
) -> int:
    """Registers a node: the round it waits for."""
    return rdzv.register(job_id, node_id, addr, port, s, join_id).round


def assignment(
    rdzv: Rendezvous, job: Job, node_id: str, round: int
) -> Assignment | Literal["missed"] | None:
    """A node's :meth:`~Rendezvous.outcome` for ``round``, a sealed one as the assignment
    the coordinator sends (parsed from the same JSON)."""
    sealed = rdzv.outcome(job, node_id, round)
    if sealed is None or sealed == "missed":
        return sealed
    return Assignment.model_validate_json(sealed.assignment_json(job.job_id, node_id))


def register_all(
    rdzv: Rendezvous, nodes: list[str], s: JobSpec | None = None
) -> tuple[int, dict[str, str]]:
    """Registers ``nodes`` for one round: the round and each node's credential."""
    registered = [rdzv.register("job", n, f"host-{n}", 29500 + i, s) for i, n in enumerate(nodes)]
    rounds = {r.round for r in registered}
    assert len(rounds) == 1
    credentials = {r.node_id: r.credential for r in registered}
    assert all(credentials.values())
    return rounds.pop(), {n: c for n, c in credentials.items() if c}


def seal(rdzv: Rendezvous, nodes: list[str]) -> tuple[int, dict[str, str]]:
    """Seals a generation of ``nodes`` (in rank order): its number and each member's
    credential."""
    _, creds = register_all(rdzv, nodes, spec(1, 8, last_call=1))
    return _sealed_after_last_call(rdzv, len(nodes)), creds


def _sealed_after_last_call(rdzv: Rendezvous, world_size: int) -> int:
    """Lets the 1 s last call of :func:`spec` ``(1, 8, last_call=1)`` pass: the round
    seals with every node registered; the new generation's number."""
    clock = rdzv.clock
    assert isinstance(clock, Clock)
    clock.advance(1)
    job, _ = rdzv.tick("job")
    assert job.status == "sealed" and job.world_size == world_size
    return job.generation


def save(
    ckpts: Checkpoints,
    blobs: BlobStore,
    nodes: list[str],
    generation: int,
    step: int,
    creds: dict[str, str],
) -> int:
    """Every rank begins, uploads one file and reports; returns the version."""
    version = 0
    for node in nodes:
        begun = ckpts.begin(
            "job", BeginCheckpoint(node_id=node, generation=generation, step=step), creds[node]
        )
        version = begun.version
        data = f"{node}@{step}".encode()
        blobs.put(f"job/v{version:010d}/rank-{begun.rank:05d}/shard.safetensors", data)
        info = ckpts.report(
            "job",
            version,
            ReportShard(
                node_id=node,
                generation=generation,
                files=[ShardFile(name="shard.safetensors", size=len(data), checksum="x:1")],
                metadata={"step": step},
                rank_metadata={"node": node},
            ),
            creds[node],
        )
    assert info.state == "committed"
    return version


def peer(node: str, agent: int = 1) -> str:
    """The replica server of ``node``'s ``agent``-th agent (a new URL per start)."""
    return f"http://host-{node}:7000/a{agent}"


def seal_with_peers(
    rdzv: Rendezvous, nodes: list[str], agents: dict[str, int] | None = None
) -> tuple[int, dict[str, str]]:
    """Seals a generation of ``nodes``, each under an agent whose replica server
    (:func:`peer`; ``agents`` numbers a node's restarted agents) holds its memory tier:
    the generation's number and each member's credential."""
    creds: dict[str, str] = {}
    for i, n in enumerate(nodes):
        node = rdzv.register(
            "job",
            n,
            f"host-{n}",
            29500 + i,
            spec(1, 8, last_call=1),
            None,
            peer(n, (agents or {}).get(n, 1)),
        )
        assert node.credential
        creds[n] = node.credential
    return _sealed_after_last_call(rdzv, len(nodes)), creds


def end(rdzv: Rendezvous, gen: int, gone: list[str], creds: dict[str, str]) -> None:
    """The ``gone`` members leave: the generation ends."""
    for i, node in enumerate(gone):  # the first departure ends the generation
        rdzv.leave("job", node, gen if i == 0 else None, "test", creds[node])


def save_tiered(
    ckpts: Checkpoints,
    blobs: BlobStore,
    nodes: list[str],
    gen: int,
    step: int,
    creds: dict[str, str],
    *,
    every: int = 1,
    force: bool = False,
) -> tuple[int, bool]:
    """Every node's one rank saves as the trainer does: memory on its own node, its
    replica's and its standby's, storage if the version is persisted. Returns (version,
    persisted)."""
    version, persisted = 0, False
    for node in nodes:
        begun = ckpts.begin(
            "job",
            BeginCheckpoint(
                node_id=node,
                generation=gen,
                step=step,
                files=[FILE],
                persist=force,
                persist_every=every,
                memory=True,
            ),
            creds[node],
        )
        version, persisted = begun.version, begun.persist
        data = f"{node}@{step}".encode()
        if persisted:
            blobs.put(f"job/v{version:010d}/rank-{begun.rank:05d}/{FILE}", data)
        holders = [node] + [g.node_id for g in (begun.replica, begun.standby) if g is not None]
        info = ckpts.report(
            "job",
            version,
            ReportShard(
                node_id=node,
                generation=gen,
                files=[ShardFile(name=FILE, size=len(data), checksum="x:1")],
                storage=persisted,
                memory=holders,
            ),
            creds[node],
        )
    assert info.state == "committed"
    return version, persisted


def begin_all(
    ckpts: Checkpoints, nodes: list[str], gen: int, step: int, creds: dict[str, str]
) -> int:
    """Every node's rank begins ``step`` and uploads its file to storage; none reports."""
    version = 0
    for node in nodes:
        begun = ckpts.begin(
            "job",
            BeginCheckpoint(node_id=node, generation=gen, step=step, files=[FILE]),
            creds[node],
        )
        version = begun.version
        ckpts.blobs.put(f"job/v{version:010d}/rank-{begun.rank:05d}/{FILE}", node.encode())
    return version


class Reported(TypedDict, total=False):
    """What a rank's report may add to its files, as the trainer sends it: the version's
    ``metrics`` and the job's retention rules (``ReportShard``'s fields of those names)."""

    metrics: dict[str, float] | None
    keep_best: KeepBest | None
    keep_last: int | None


def report(
    ckpts: Checkpoints,
    node: str,
    gen: int,
    version: int,
    creds: dict[str, str],
    **reported: Unpack[Reported],
) -> str:
    """``node``'s rank reports its file (in storage), with the version's ``metrics`` and
    retention rules if given; the version's state after it."""
    shard = ShardFile(name=FILE, size=len(node), checksum="x:1")
    request = ReportShard(node_id=node, generation=gen, files=[shard], storage=True, **reported)
    return ckpts.report("job", version, request, creds[node]).state


def commit(
    ckpts: Checkpoints,
    nodes: list[str],
    gen: int,
    step: int,
    creds: dict[str, str],
    **reported: Unpack[Reported],
) -> int:
    """A durable version of ``step``, committed by every node's rank (each reports the
    ``metrics`` and retention rules, as the trainer does)."""
    version = begin_all(ckpts, nodes, gen, step, creds)
    states = [report(ckpts, n, gen, version, creds, **reported) for n in nodes]
    assert states[-1] == "committed"
    return version


def seal_and_save(
    ckpts: Checkpoints,
    rdzv: Rendezvous,
    nodes: list[str],
    steps: Iterable[int],
    *,
    every: int | None = None,
) -> tuple[int, dict[str, str], list[int]]:
    """Seals a generation of ``nodes`` (:func:`seal_with_peers`) and saves a version of
    each of ``steps`` in turn: durable ones (:func:`commit`), or with ``every`` as the
    trainer saves in tiers (:func:`save_tiered`). Returns the generation, each member's
    credential and the versions."""
    gen, creds = seal_with_peers(rdzv, nodes)
    if every is None:
        versions = [commit(ckpts, nodes, gen, step, creds) for step in steps]
    else:
        versions = [
            save_tiered(ckpts, ckpts.blobs, nodes, gen, step, creds, every=every)[0]
            for step in steps
        ]
    return gen, creds, versions


def pointers(rdzv: Rendezvous) -> tuple[int | None, int | None]:
    """The job's latest and durable versions."""
    job = rdzv.get_job("job")
    return (
        job.checkpoint.version if job.checkpoint else None,
        job.durable.version if job.durable else None,
    )


def named(rdzv: Rendezvous, gen: int) -> int | None:
    """The version generation ``gen`` was told to resume from."""
    pointer = rdzv.sealed("job", gen).checkpoint
    return None if pointer is None else pointer.version
