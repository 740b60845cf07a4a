"""Helpers the tests share for a coordinator at work: its job specs, nodes joined through
the client, checkpoint managers on them, the CLI, and a job's status.

Test modules import their helpers from here (and from the other ``tests/_*.py``
modules: ``_rules`` for the coordinator's rules in-process, ``_balancer`` for replicas
behind HAProxy), never from one another; ``tests/test_structure.py`` checks that.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx

from rallypoint.cli.processes import Cluster, Coordinator, Event, judge
from rallypoint.client import Assignment, CheckpointInfo, ElasticClient, JobSpec, ShardFile
from rallypoint.tls import ssl_context
from rallypoint.trainer import CheckpointManager, upload

__all__ = [
    "FILE",
    "IMAGE_SIZE",
    "TOKEN",
    "cli",
    "clients",
    "committed",
    "ended",
    "join_all",
    "judged",
    "kept_and_rolled_back",
    "managers",
    "pids_of",
    "run_to_the_end",
    "save_by_hand",
    "saved_since",
    "small_cluster",
    "spec",
    "standing_still",
    "status",
    "tiny_llama_config",
]

#: The side of the example's images in the tests' clusters (``Cluster(image_size=...)``):
#: a step of its small CNN takes 4.3 ms of CPU at 16 against 15.5 ms at 32, and a test
#: runs all of a cluster's workers on this machine's two CPUs. It still learns: the loss
#: fell from 2.31 to 0.08 in 150 steps (0.005 at 32).
IMAGE_SIZE = 16
#: The token of coordinators started with ``--token`` for an operator's calls.
TOKEN = "cli-token"
#: The one file a checkpoint saved by hand holds (DCP's name for a rank's data).
FILE = "data.distcp"
COMMAND = [sys.executable, "-m", "rallypoint"]


def small_cluster(coordinator: Coordinator, job: str, tmp_path: Path, **options: Any) -> Cluster:
    """The example's cluster as the standby and hot-join tests run it: images of
    :data:`IMAGE_SIZE`, and each node with a memory tier of its own under
    ``tmp_path/memory``, as on separate machines. ``options`` are :class:`Cluster`'s."""
    return Cluster(
        coordinator.url,
        job,
        tmp_path,
        memory=tmp_path / "memory",
        image_size=IMAGE_SIZE,
        **options,
    )


def spec(min_nodes: int, max_nodes: int, last_call: float = 0.5, timeout: float = 10) -> JobSpec:
    """A job spec; nodes in these tests heartbeat only where detection is tested, so the
    default timeout is long enough that a slow machine never ends a generation early."""
    return JobSpec(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        last_call=timedelta(seconds=last_call),
        heartbeat_timeout=timedelta(seconds=timeout),
        join_timeout=timedelta(seconds=60),
    )


def clients(url: str, names: list[str], job: str = "job", **kw: object) -> list[ElasticClient]:
    return [ElasticClient(url, job, n, **kw) for n in names]  # type: ignore[arg-type]


def join_all(clients: list[ElasticClient], s: JobSpec | None = None) -> list[Assignment]:
    """Joins every client at once (a generation of them all, if ``s`` lets it seal)."""
    with ThreadPoolExecutor(len(clients)) as pool:
        futures = [
            pool.submit(c.join, "127.0.0.1", 30000 + i, spec=s, timeout=timedelta(seconds=60))
            for i, c in enumerate(clients)
        ]
        return [f.result() for f in futures]


def managers(url: str, names: list[str], lo: int, hi: int) -> list[CheckpointManager]:
    """A generation of ``names`` in a job of ``lo`` to ``hi`` nodes, each node's
    CheckpointManager, in rank order."""
    nodes = clients(url, names)
    join_all(nodes, spec(lo, hi))
    return sorted((CheckpointManager(n, progress=False) for n in nodes), key=lambda m: m.rank)


def save_by_hand(node: ElasticClient, step: int, *, every: int) -> CheckpointInfo:
    """A one-node job's rank saves ``step`` as a trainer under an agent does: its file in
    the node's memory tier, and in storage too if the policy (every ``every``-th
    version) persists the version. Committed in memory, the version is not durable."""
    begun = node.begin_checkpoint(step, [FILE], persist_every=every, memory=True)
    data = f"{node.node_id}@{step}".encode()
    if begun.persist:
        upload(begun.upload_urls[FILE], data)
    shard = ShardFile(name=FILE, size=len(data), checksum="xxh3-128:0")
    return node.report_checkpoint(
        begun.version, [shard], storage=begun.persist, memory=[node.node_id]
    )


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The installed command, with only the environment given (no RALLYPOINT_* leaks in)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RALLYPOINT_")}
    return subprocess.run(
        [*COMMAND, *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def status(coordinator: Coordinator, job: str) -> dict[str, Any]:
    """The job's status as the coordinator serves it (``GET /v1/jobs/{job}``).

    The tests' polls hand httpx the package's TLS context (as the package's own clients
    do): each ``httpx.get`` without one builds its own, loading the CA bundle, 54 ms of
    CPU here against 2.2 ms for the request, so a poll every 50 ms spent about half of
    one of this machine's two CPUs beside the processes under test."""
    reply = httpx.get(f"{coordinator.url}/v1/jobs/{job}", timeout=10, verify=ssl_context())
    reply.raise_for_status()
    body: dict[str, Any] = reply.json()
    return body


def status_until(
    coordinator: Coordinator,
    job: str,
    predicate: Callable[[dict[str, Any]], bool],
    timeout: float = 150,
    what: str = "the condition",
) -> dict[str, Any]:
    """Polls the job's status (every 50 ms) until ``predicate`` holds; that status.

    Raises:
        TimeoutError: Naming ``what`` and the last status, after ``timeout`` s.
    """
    end = time.monotonic() + timeout
    while True:
        body = status(coordinator, job)
        if predicate(body):
            return body
        if time.monotonic() >= end:
            raise TimeoutError(f"{what} not met within {timeout} s: {body}")
        time.sleep(0.05)


def ended(coordinator: Coordinator, job: str, generation: int, timeout: float = 150) -> str:
    """Waits until ``generation`` of the job has ended; the reason."""
    history = status_until(
        coordinator,
        job,
        lambda s: (
            len(s["history"]) >= generation
            and bool(s["history"][generation - 1].get("ended_reason"))
        ),
        timeout,
        f"the end of generation {generation}",
    )["history"]
    return str(history[generation - 1]["ended_reason"])


def _signal_all(pids: Sequence[int], sig: signal.Signals) -> None:
    """Sends ``sig`` to each of ``pids`` that still runs."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@contextlib.contextmanager
def standing_still(pids: Sequence[int]) -> Iterator[None]:
    """Holds the processes ``pids`` stopped (SIGSTOP) for the block, and lets them go on
    (SIGCONT) after it, also when it raises. For a newcomer that must join mid-run: the
    members' workers stand still while its agent starts, so a fast machine cannot finish
    the run first and a loaded one cannot take longer than the run."""
    _signal_all(pids, signal.SIGSTOP)
    try:
        yield
    finally:
        _signal_all(pids, signal.SIGCONT)


def pids_of(cluster: Cluster, generation: int) -> list[int]:
    """The worker processes that resumed in ``generation`` (their ``resumed`` events)."""
    return [
        e["pid"]
        for e in cluster.events()
        if e["event"] == "resumed" and e["generation"] == generation
    ]


def committed(coordinator: Coordinator, job: str, step: int, timeout: float = 150) -> None:
    """Waits until the job has a committed version of ``step``.

    Raises:
        TimeoutError: After ``timeout`` s without one.
    """
    end = time.monotonic() + timeout
    url = f"{coordinator.url}/v1/jobs/{job}/checkpoints"
    while time.monotonic() < end:
        # A request that fails is asked again: a coordinator under load may drop one.
        with contextlib.suppress(httpx.HTTPError):
            answer = httpx.get(url, timeout=5, verify=ssl_context())
            versions = answer.json() if answer.status_code == 200 else []  # 404: no job yet
            if any(v["step"] == step and v["state"] == "committed" for v in versions):
                return
        time.sleep(0.05)
    raise TimeoutError(f"no committed version of step {step} within {timeout} s")


def saved_since(coordinator: Coordinator, job: str, since: float, timeout: float = 150) -> int:
    """Waits until the job has a committed version begun after ``since`` (epoch
    seconds; for one a standby that parked then holds copies of): its step.

    Raises:
        TimeoutError: After ``timeout`` s without one.
    """
    end = time.monotonic() + timeout
    url = f"{coordinator.url}/v1/jobs/{job}/checkpoints"
    while time.monotonic() < end:
        with contextlib.suppress(httpx.HTTPError):  # asked again, as in committed()
            answer = httpx.get(url, timeout=5, verify=ssl_context())
            for v in answer.json() if answer.status_code == 200 else []:
                if v["state"] == "committed" and v["created_at"] > since:
                    return int(v["step"])
        time.sleep(0.05)
    raise TimeoutError(f"no version begun after {since} committed within {timeout} s")


def judged(coordinator: Coordinator, cluster: Cluster, final_step: int) -> list[dict[str, Any]]:
    """The job's generation history, once :func:`judge` found the run consistent (every
    rank of each generation loaded the version the coordinator named for it) and trained
    to ``final_step``."""
    history: list[dict[str, Any]] = status(coordinator, cluster.job)["history"]
    verdict = judge(cluster.events(), history)
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == final_step, verdict
    return history


def kept_and_rolled_back(log: Sequence[Event], kind: str) -> tuple[list[Event], list[Event]]:
    """The ``kind`` events (one per step and rank: the items it trained) of the steps a
    run kept, and those of the steps a restart rolled back: trained at or after the step
    a later generation resumed at."""
    resumed_at = {e["generation"]: e["step"] for e in log if e["event"] == "resumed"}
    kept, lost = [], []
    for e in (e for e in log if e["event"] == kind):
        later = [step for g, step in resumed_at.items() if g > e["generation"]]
        (lost if later and e["step"] >= min(later) else kept).append(e)
    return kept, lost


def run_to_the_end(cluster: Cluster, nodes: Sequence[str] = ("u", "v", "w")) -> None:
    """Starts an agent for each of ``nodes`` and lets the job run to its end, undisturbed
    (the reference a test compares an elastic run with); every agent must exit 0."""
    try:
        for node in nodes:
            cluster.add(node)
        codes = cluster.wait(timeout=200)
    finally:
        cluster.stop()
    assert codes == dict.fromkeys(nodes, 0), codes


def tiny_llama_config(
    vocab: int, hidden: int, layers: int, heads: int, positions: int
) -> dict[str, int]:
    """The keyword arguments of a ``LlamaConfig`` small enough to train on a CPU in a
    test: an MLP twice the hidden size and two key/value heads, built from a config since
    nothing is downloaded here."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=positions,
    )
