"""Helpers the tests share for a coordinator at work: its job specs, nodes joined through
the client, checkpoint managers on them, the CLI, and a job's status.

Test modules import their helpers from here (and from the other ``tests/_*.py``
modules: ``_rules`` for the coordinator's rules in-process, ``_balancer`` for replicas
behind HAProxy), never from one another; ``tests/test_structure.py`` checks that.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx

from rallypoint.cli.processes import Cluster, Coordinator, Event, descendants, judge
from rallypoint.client import (
    Assignment,
    CheckpointInfo,
    ElasticClient,
    HeartbeatReply,
    JobSpec,
    RankProgress,
    ShardFile,
)
from rallypoint.tls import ssl_context
from rallypoint.trainer import CheckpointManager, upload

__all__ = [
    "FILE",
    "HUNG_B",
    "IMAGE_SIZE",
    "TOKEN",
    "Stepping",
    "cli",
    "clients",
    "committed",
    "ended",
    "gone",
    "hang_report",
    "hung_worker",
    "join_all",
    "joins_hot",
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
    "throttled",
    "tiny_llama_config",
    "workers_of",
]

#: The side of the example's images in the tests' clusters (``Cluster(image_size=...)``):
#: a step of its small CNN takes 4.3 ms of CPU at 16 against 15.5 ms at 32, and a test
#: runs all of a cluster's workers on this machine's two CPUs. It still learns: the loss
#: fell from 2.31 to 0.08 in 150 steps (0.005 at 32).
IMAGE_SIZE = 16
#: How the generation that a hang of node b's one rank ended reads (``hung_worker``).
HUNG_B = r"rank \d+ on node b hung: no progress for [\d.]+ s in train at step \d+ \(limit "
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
    the run first and a loaded one cannot take longer than the run. Stopped workers are
    hung ranks to the coordinator: the job must turn hang detection off
    (``cluster.conf += ",hang_limit=0"``)."""
    _signal_all(pids, signal.SIGSTOP)
    try:
        yield
    finally:
        _signal_all(pids, signal.SIGCONT)


@contextlib.contextmanager
def throttled(pid: int, stopped: float = 0.4, period: float = 0.5) -> Iterator[None]:
    """Stops ``pid`` ``stopped`` of every ``period`` seconds while the block runs: a rank
    five times slower than its peers (a throttled GPU, a noisy neighbour)."""
    done = threading.Event()

    def run() -> None:
        while not done.is_set():
            try:
                os.kill(pid, signal.SIGSTOP)
                done.wait(stopped)
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                return
            done.wait(period - stopped)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if not gone(pid):
            os.kill(pid, signal.SIGCONT)


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


def ends(history: list[dict[str, Any]]) -> list[tuple[int, int, str | None]]:
    """A job's generations as (generation, world size, why it ended): what an assertion
    on the world sizes shows when it fails, in a line (the whole history is cut short in
    a CI log, and the reasons are what tell a false end from a slow run)."""
    return [(g["generation"], g["world_size"], g.get("ended_reason")) for g in history]


def judged(coordinator: Coordinator, cluster: Cluster, final_step: int) -> list[dict[str, Any]]:
    """The job's generation history, once :func:`judge` found the run consistent (every
    rank of each generation loaded the version the coordinator named for it) and trained
    to ``final_step``."""
    history: list[dict[str, Any]] = status(coordinator, cluster.job)["history"]
    verdict = judge(cluster.events(), history)
    assert verdict.consistent, verdict.problems
    assert verdict.final_step == final_step, verdict
    return history


def joins_hot(
    coordinator: Coordinator,
    cluster: Cluster,
    world: int,
    final_step: int,
    env: dict[str, str] | None = None,
    saved: bool = False,
) -> list[Event]:
    """Nodes a and b train; once they have (and, with ``saved``, once they have committed
    a version, for a test of what c restores), c joins under ``rallypoint run``'s defaults
    (it parks, and its workers start in the placeholder world), and the job runs to its
    end. Checks that c went in hot, its workers waiting in a join before their process
    group: its agent logged no cold fallback (a worker that exited while the node
    parked, as one that builds its group at the placeholder master does), the first
    generation ended once, for c, and the world of ``world`` ranks trained, every rank
    from the version the coordinator named, to ``final_step``. The events."""
    try:
        cluster.start("a", "b", env=env or {})
        cluster.wait_for(lambda e: e["event"] == "step" and e["world_size"] < world, timeout=150)
        if saved:
            saved_since(coordinator, cluster.job, 0)
        joiner = cluster.add("c", env=env)
        cluster.wait_for(lambda e: e["event"] == "step" and e["world_size"] == world, timeout=150)
        codes = cluster.wait(timeout=150)
    finally:
        cluster.stop()
    assert codes == {"a": 0, "b": 0, "c": 0}, codes
    log = joiner.log.read_text(errors="replace")
    assert "exited while it parked" not in log  # the agent's word for a cold fallback
    assert "65536" not in log  # the placeholder master's port
    history = judged(coordinator, cluster, final_step)
    assert [g["world_size"] for g in history] == [2, 3], ends(history)
    assert history[0]["ended_reason"] == "node c joined"
    return cluster.events()


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
        cluster.start(*nodes)
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


class Stepping:
    """A generation's members beating as their agents do, each with its one process's
    progress: the ranks step together every ``step`` seconds (a data-parallel job), each
    one's own share of the step ``own[node]`` seconds (a slow one is a straggler), until
    :meth:`freeze` stops one (a hang: its step and its progress stop, and its peers wait
    for it in the all-reduce). Beats go every 0.2 s from a thread (a context manager),
    through the coordinator's real heartbeat route; a node stops beating once a reply
    says ``restart``, which :attr:`restarts` keeps.

    Args:
        nodes: Members of one sealed generation (joined clients).
        own: Each node's own step time (default: ``step``).
        from_step: The step they start at (a generation that resumes).
    """

    def __init__(
        self,
        nodes: Sequence[ElasticClient],
        step: float = 0.1,
        own: dict[str, float] | None = None,
        from_step: int = 0,
    ) -> None:
        self.nodes = list(nodes)
        self.step = step
        self.own = own or {}
        self.from_step = from_step
        self.started = time.monotonic()
        self.frozen: tuple[str, float] | None = None
        self.restarts: dict[str, HeartbeatReply] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stepping", daemon=True)

    def progress(self, node: ElasticClient, now: float) -> RankProgress:
        """What ``node``'s beat says of its process at ``now`` (monotonic)."""
        assert node.assignment is not None
        stopped = self.frozen[1] if self.frozen is not None else now
        done = int((stopped - self.started) / self.step)
        last = self.started + done * self.step
        return RankProgress(
            rank=node.assignment.rank,
            step=self.from_step + done,
            idle=max(0.0, now - last),
            interval=self.step if done >= 5 else None,
            own=self.own.get(node.node_id, self.step),
            # Its peers wait for the frozen one's gradients; it does not.
            waiting=self.frozen is not None and self.frozen[0] != node.node_id,
            process="stopped" if self.frozen and self.frozen[0] == node.node_id else "running",
        )

    def freeze(self, node_id: str) -> None:
        """Stops ``node_id``'s process as a SIGSTOP would, now."""
        self.frozen = (node_id, time.monotonic())

    def _run(self) -> None:
        while not self._stop.is_set():
            for node in self.nodes:
                if node.node_id in self.restarts:
                    continue
                reply = node.heartbeat(progress=[self.progress(node, time.monotonic())])
                if reply.action == "restart":
                    self.restarts[node.node_id] = reply
            if len(self.restarts) == len(self.nodes):
                return
            self._stop.wait(0.2)

    def ended(self, timeout: float = 60) -> dict[str, HeartbeatReply]:
        """Waits until every node was told ``restart``; the replies, by node."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the generation did not end within {timeout} s")
        return self.restarts

    def __enter__(self) -> Stepping:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def workers_of(cluster: Cluster, node: str) -> list[int]:
    """The worker processes of ``node``'s agent now: warm workers are the children of the
    agent's forkserver (the warm server), and an agent without one starts them itself."""
    agent = cluster.agents[node].proc.pid
    out = []
    for pid in descendants(agent):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes()
            mine = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if b"resource_tracker" in mine or (b"forkserver import main" in mine and ppid == agent):
            continue  # the agent's helpers, not its workers
        if ppid == agent or b"forkserver" in parent:
            out.append(pid)
    return out


def hung_worker(
    coordinator: Coordinator, cluster: Cluster, node: str, timeout: float = 60
) -> tuple[int, int, str]:
    """Stops ``node``'s one worker (SIGSTOP: a process stuck in a kernel call or on a
    hung GPU looks so) and waits for the coordinator to end the running generation. The
    generation, the worker's pid, and the reason the generation ended with.

    It stops the worker once the coordinator shows the job's hang limit: one learned
    from the ranks' step intervals (8 of them, not across a save) or set. Before that
    (``warming``) only ``phase_limit`` bounds a rank. A run that stopped b at step 10 of
    an HF job saving every 4 steps met it: 7 intervals, so no limit.
    """
    status_until(
        coordinator,
        cluster.job,
        lambda body: body["health"]["hang_limit"] is not None,
        what="a hang limit for the job",
    )
    generation = status(coordinator, cluster.job)["generation"]
    (pid,) = workers_of(cluster, node)
    os.kill(pid, signal.SIGSTOP)
    return generation, pid, ended(coordinator, cluster.job, generation, timeout)


def b_hangs_and_is_named(
    coordinator: Coordinator, cluster: Cluster, script: str, env: dict[str, str] | None = None
) -> None:
    """Nodes a, b and c train; once the world of 3 stepped 10 times, b's worker stops
    (:func:`hung_worker`). The generation must end naming b's rank, its stacks be taken
    from ``script``'s process, and the others train in a later generation: what a
    framework's integration must give a hang with no code of the script's."""
    try:
        cluster.start("a", "b", "c", env=env or {})
        cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 10 and e["world_size"] > 2)
        generation, pid, reason = hung_worker(coordinator, cluster, "b")
        assert re.match(HUNG_B, reason), reason
        report = hang_report(coordinator, cluster.job, generation)
        assert report["pid"] == pid and script in report["stacks"]
        cluster.wait_for(lambda e: e["event"] == "step" and e["generation"] > generation)
    finally:
        cluster.stop()


def hang_report(coordinator: Coordinator, job: str, generation: int) -> dict[str, Any]:
    """The hang that ended ``generation``, once its agent sent the stacks (or why not)."""
    url = f"{coordinator.url}/v1/jobs/{job}/hangs/{generation}"
    deadline = time.monotonic() + 60
    while True:
        report: dict[str, Any] = httpx.get(url, timeout=10, verify=ssl_context()).json()
        if report.get("taken_by") or report.get("stacks_error"):
            return report
        assert time.monotonic() < deadline, report
        time.sleep(0.1)


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
