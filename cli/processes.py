"""The processes of an elastic job on one machine, for the demo, the end-to-end tests and
the benchmarks: a ``rallypoint serve`` coordinator (:class:`Coordinator`), torchrun
agents running the DDP example or any script (:class:`Cluster`), and :func:`judge`,
which checks from the example's events that every rank resumed from the checkpoint the
coordinator named. :func:`kill_processes` SIGKILLs processes as a vanished machine loses
them, without leaving behind on this one what they held in ``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import httpx

from rallypoint.tls import ssl_context

#: The agent's test start gate (``rallypoint.trainer.agent``'s ``START_GATE_ENV``): named
#: here, as the CLI needs no torch to import.
START_GATE_ENV = "RALLYPOINT_TEST_START_GATE"

__all__ = [
    "CLUSTER_MARK",
    "FINISHING_STEP_TIME",
    "START_GATE_ENV",
    "Agent",
    "Cluster",
    "Coordinator",
    "Event",
    "Verdict",
    "descendants",
    "example_script",
    "free_port",
    "judge",
    "kill_processes",
    "leftover_semaphores",
    "stop_process",
]

# One line of the example's ``--events`` file, or a mark the demo adds to its timeline.
Event = dict[str, Any]


def free_port() -> int:
    """A loopback port free when asked (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen[Any] | None, grace_s: float) -> None:
    """Stops ``proc`` if it still runs: SIGTERM, and SIGKILL if it has not exited
    ``grace_s`` seconds later."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def example_script() -> Path:
    """The DDP example, wherever the package is installed."""
    return Path(str(files("rallypoint.trainer").joinpath("examples/train_ddp.py")))


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``): torchrun starts its workers in
    sessions of their own, so killing the agent's group leaves them running."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


# What multiprocessing's resource tracker runs as (in its command line).
_TRACKER = b"multiprocessing.resource_tracker"
# Where glibc keeps POSIX named semaphores (``sem.NAME``) and shared memory.
_SHM = Path("/dev/shm")
# The named semaphores that processes kill_processes() stopped had open: (file, inode).
_killed_held: list[tuple[Path, int]] = []


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has exited: its files are closed, its maps gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _until_gone(pids: Collection[int], timeout: float) -> list[int]:
    """Waits up to ``timeout`` s for ``pids`` to exit; those still running."""
    end = time.monotonic() + timeout
    while (left := [p for p in pids if _running(p)]) and time.monotonic() < end:
        time.sleep(0.01)
    return left


def _semaphore_inodes(pids: Collection[int] | None = None) -> set[int]:
    """The inodes of the named semaphores ``pids`` (None: every process) have open. A
    process maps each semaphore it opened, its creator under the temporary name the
    file had before glibc linked it as ``sem.NAME``: the inode is what is the same."""
    found: set[int] = set()
    if pids is None:
        pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(f"{_SHM}/sem."):
                found.add(int(fields[4]))
    return found


def _semaphores(inodes: Collection[int]) -> list[tuple[Path, int]]:
    """The semaphores in ``/dev/shm`` with these inodes."""
    out = []
    for path in _SHM.glob("sem.*"):
        with contextlib.suppress(OSError):
            if (inode := path.stat().st_ino) in inodes:
                out.append((path, inode))
    return out


def kill_processes(pids: Collection[int], grace_s: float = 5) -> None:
    """SIGKILLs ``pids``, as a machine that vanishes loses them, and removes the named
    semaphores that leaves behind in ``/dev/shm``, which outlive this machine's processes
    as they would not outlive a machine.

    Those are multiprocessing's (``sem.mp-*``: torchrun's agent makes some for each
    worker, and so does any process that starts others by spawn or forkserver). Each
    process that made them registered them with its resource tracker, a process of its
    own, which unlinks the ones left when the last process it serves has exited: so the
    trackers among ``pids`` are spared until the others are gone (killed with them, they
    left thousands of semaphores after a week of test runs). A tracker still running
    ``grace_s`` later (another process holds it open) is killed too; then what ``pids``
    had open and no process has open any more is unlinked here.
    """
    pids = [p for p in pids if _running(p)]
    held = _semaphores(_semaphore_inodes(pids))
    trackers = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            if _TRACKER in Path(f"/proc/{pid}/cmdline").read_bytes():
                trackers.add(pid)
    others = [p for p in pids if p not in trackers]
    for pid in others:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _until_gone(others, grace_s)
    for pid in _until_gone(trackers, grace_s):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _until_gone(trackers, grace_s)
    _killed_held.extend(held)
    if left := [(path, inode) for path, inode in held if _exists(path, inode)]:
        opened = _semaphore_inodes()
        for path, inode in left:
            if inode not in opened:
                path.unlink(missing_ok=True)


def _exists(path: Path, inode: int) -> bool:
    try:
        return path.stat().st_ino == inode
    except OSError:
        return False


def leftover_semaphores() -> list[str]:
    """The named semaphores that processes :func:`kill_processes` stopped in this process
    had open and that are still in ``/dev/shm`` (none, unless a process that did not
    exit holds one): what a test run checks at its end."""
    return [str(path) for path, inode in _killed_held if _exists(path, inode)]


#: Set in the environment of each :class:`Cluster`'s agents, which every process they
#: start inherits: the way to find those that outlive their agent (reparented to init,
#: or in sessions of their own, they are no one's descendants then).
CLUSTER_MARK = "RP_CLUSTER_MARK"


def _marked(mark: str) -> list[tuple[int, str]]:
    """The live processes whose environment has ``CLUSTER_MARK=mark``, with their
    command lines (Linux ``/proc``; zombies have no environment left to read)."""
    needle = f"{CLUSTER_MARK}={mark}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out.append((int(entry.name), command.strip()))
    return out


@dataclass
class Coordinator:
    """A ``rallypoint serve`` process on loopback; ``start`` again after ``kill`` brings it
    back on the same port.

    Args:
        args: ``rallypoint serve`` flags, e.g. ``["--storage", "local:/tmp/s"]``.
        env: Variables added to this process's environment.
    """

    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    # A file, not a pipe: nobody reads a pipe, and a full one would block the server.
    log: Path = field(default_factory=lambda: Path(tempfile.mkstemp(suffix=".log")[1]))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def start(self, deadline_s: float = 30) -> Coordinator:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rallypoint", "serve", "--port", str(self.port), *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                # Not the working directory first on sys.path: run from a checkout, its
                # rallypoint/ folder (the package's top modules, without the
                # subpackages) hid an installed, non-editable package ("No module named
                # 'rallypoint.cli'", on the H200). The server runs no code of the user's.
                env={**os.environ, "PYTHONSAFEPATH": "1", **self.env},
            )
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"coordinator exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.TransportError):
                if (
                    httpx.get(f"{self.url}/healthz", timeout=1, verify=ssl_context()).status_code
                    == 200
                ):
                    return self
            time.sleep(0.05)
        raise RuntimeError("the coordinator did not answer /healthz in time")

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs, nothing is flushed."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        stop_process(self.proc, grace_s=15)


@dataclass
class Agent:
    """A torchrun agent :meth:`Cluster.add` started, and its log."""

    node_id: str
    proc: subprocess.Popen[bytes]
    log: Path


#: The example's extra seconds per step once a test waits for its job's end
#: (:meth:`Cluster.wait`): not none, so that a rank's step still leaves the machine's
#: other processes (agents' heartbeats, the coordinator) time on a loaded machine.
FINISHING_STEP_TIME = 0.01


class Cluster:
    """torchrun agents (``--rdzv-backend=rallypoint``) running the example, one per node.

    Args:
        url: The coordinator.
        job: The job id.
        workdir: Logs and the event file go here.
        nnodes: torchrun's ``--nnodes``.
        steps: Train until this step.
        step_time: Extra seconds per step (the example is tiny; this paces it).
        heartbeat_timeout: Seconds (``--rdzv-conf``).
        last_call: Seconds (``--rdzv-conf``).
        join_timeout: Seconds (``--rdzv-conf``); None: the plugin's default.
        imds_url: The metadata service the workers' PreemptionWatcher polls.
        checkpoint_every: Steps between asynchronous checkpoints.
        persist_every: Every Nth checkpoint goes to blob storage, the others stay in the
            nodes' memory tiers (and their peers').
        script: The training script and its arguments, instead of the example.
        rdzv: torchrun's rendezvous flags, instead of the rallypoint backend's.
        nproc: Worker processes per node (torchrun's ``--nproc-per-node``).
        memory: A folder in which each node gets a memory tier of its own
            (``memory/NODE``), as on separate machines; None: the agents' default
            (``/dev/shm``, shared by the agents of this machine).
        in_place: The example's workers regroup in place (``--in-place``).
        standbys: Nodes that park beyond ``MAX`` (``--rdzv-conf standbys``).
        hot_standby: A node that parks starts its workers at once
            (``--rdzv-conf hot_standby=1``).
        hot_join: A node joining a running generation parks and starts its workers,
            and the generation ends for it once they are ready (the backend's default);
            False: it ends as soon as the node joins (``--rdzv-conf hot_join=0``).
        image_size: The side of the example's synthetic images (``--image-size``):
            smaller is a cheaper step, for a machine that runs the whole cluster; None:
            the example's own default.
    """

    def __init__(
        self,
        url: str,
        job: str,
        workdir: Path,
        *,
        nnodes: str = "1:3",
        steps: int = 200,
        step_time: float = 0.05,
        heartbeat_timeout: int = 3,
        last_call: int = 2,
        join_timeout: int | None = None,
        imds_url: str | None = None,
        checkpoint_every: int = 10,
        persist_every: int = 1,
        script: Sequence[str] | None = None,
        rdzv: Sequence[str] | None = None,
        nproc: int = 1,
        memory: Path | None = None,
        in_place: bool = False,
        standbys: int = 0,
        hot_standby: bool = False,
        hot_join: bool = True,
        image_size: int | None = None,
    ) -> None:
        self.url, self.job, self.workdir = url, job, workdir
        self.nproc = nproc
        self.memory = memory
        self.events_file = workdir / f"{job}.events.jsonl"
        #: The example's ``--step-time-file``: :meth:`pace` writes it.
        self.step_time_file = workdir / f"{job}.step-time"
        #: Which file events() read (its path and inode), and how far.
        self._read_from: tuple[tuple[Path, int] | None, int] = (None, 0)
        self._events: list[Event] = []
        self.nnodes = nnodes
        #: The ``--rdzv-conf`` its agents start with (keys may be added before they do).
        self.conf = f"heartbeat_timeout={heartbeat_timeout},last_call={last_call}"
        if join_timeout is not None:
            self.conf += f",join_timeout={join_timeout}"
        if standbys:
            self.conf += f",standbys={standbys}"
        if hot_standby:
            self.conf += ",hot_standby=1"
        if not hot_join:
            self.conf += ",hot_join=0"
        self.imds_url = imds_url
        self.script = (
            list(script)
            if script is not None
            else [
                str(example_script()),
                "--steps",
                str(steps),
                "--step-time",
                str(step_time),
                "--checkpoint-every",
                str(checkpoint_every),
                "--persist-every",
                str(persist_every),
                "--events",
                str(self.events_file),
                "--step-time-file",
                str(self.step_time_file),
                *(["--in-place"] if in_place else []),
                *(["--image-size", str(image_size)] if image_size is not None else []),
            ]
        )
        self.rallypoint = rdzv is None
        self.rdzv = (
            list(rdzv)
            if rdzv is not None
            else [
                "--rdzv-backend=rallypoint",
                f"--rdzv-endpoint={self.url}",
                f"--rdzv-id={self.job}",
                f"--rdzv-conf={self.conf}",
            ]
        )
        self.agents: dict[str, Agent] = {}
        self._mark = uuid.uuid4().hex

    def add(
        self, node_id: str, *, nproc: int | None = None, env: Mapping[str, str] | None = None
    ) -> Agent:
        """Starts a torchrun agent as node ``node_id`` (its VM name too).

        Args:
            nproc: Its worker processes, if not the cluster's ``nproc``.
            env: Variables added to its environment (and its workers').
        """
        env = {
            **os.environ,
            **(env or {}),
            "RALLYPOINT_NODE": node_id,
            "RALLYPOINT_VM_NAME": node_id,
            "PYTHONWARNINGS": "ignore",
            CLUSTER_MARK: self._mark,
        }
        if self.imds_url:
            env["RALLYPOINT_IMDS_URL"] = self.imds_url
        if self.memory is not None:
            env["RALLYPOINT_MEMORY_DIR"] = str(self.memory / node_id)
        log = self.workdir / f"{self.job}.{node_id}.log"
        # The rallypoint backend through `rallypoint run` (workers start warm); any
        # other rendezvous through stock torchrun.
        launcher = ["rallypoint", "run"] if self.rallypoint else ["torch.distributed.run"]
        command = [
            sys.executable,
            "-m",
            *launcher,
            # ``conf`` as it is now: a test may add keys after the cluster was made.
            *(
                [
                    f"--rdzv-conf={self.conf}" if a.startswith("--rdzv-conf=") else a
                    for a in self.rdzv
                ]
                if self.rallypoint
                else self.rdzv
            ),
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={nproc or self.nproc}",
            "--max-restarts=100",
            "--monitor-interval=0.1",
            "--local-addr=127.0.0.1",
            *self.script,
        ]
        with log.open("ab") as out:
            proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.agents[node_id] = Agent(node_id, proc, log)
        return self.agents[node_id]

    def start(self, *nodes: str | tuple[str, Mapping[str, Any]], **options: Any) -> list[Agent]:
        """Starts the agents of ``nodes`` as one: each waits, before its first join,
        until all of them started (the agent's test start gate), so that they reach the
        coordinator milliseconds apart however loaded the machine is, and a first round
        holds them all (a round seals ``last_call`` after ``MIN`` nodes joined: agents
        started one by one on a busy machine reached it seconds apart).

        Args:
            nodes: Node ids, or ``(node_id, options)`` for a node with :meth:`add`'s
                options of its own (they win over ``options``).
            options: :meth:`add`'s, for every node.
        """
        gate = self.workdir / f"{self.job}.gate-{uuid.uuid4().hex[:8]}"
        agents, node_ids = [], []
        for node in nodes:
            node_id, own = (node, {}) if isinstance(node, str) else node
            chosen = {**options, **own}
            env = {**(chosen.pop("env", None) or {}), START_GATE_ENV: str(gate)}
            agents.append(self.add(node_id, env=env, **chosen))
            node_ids.append(node_id)
        end = time.monotonic() + 300
        while not all(Path(f"{gate}.{n}").exists() for n in node_ids):
            if any(a.proc.poll() is not None for a in agents):
                raise RuntimeError(f"an agent exited before it joined; logs in {self.workdir}")
            if time.monotonic() >= end:
                raise TimeoutError(
                    f"the agents did not start within 300 s\n{self.stacks()}\n{self.said()}"
                )
            time.sleep(0.02)
        gate.touch()
        return agents

    def kill(self, node_id: str) -> None:
        """SIGKILL of the whole node: the agent and its workers, as when a VM vanishes
        (by :func:`kill_processes`: what they held in ``/dev/shm`` goes with them)."""
        agent = self.agents[node_id]
        kill_processes([agent.proc.pid, *descendants(agent.proc.pid)])
        agent.proc.wait()

    def terminate(self, node_id: str) -> None:
        """SIGTERM to the agent, as a platform evicting the node sends it."""
        self.agents[node_id].proc.send_signal(signal.SIGTERM)

    def events(self) -> list[Event]:
        """The events the workers wrote to :attr:`events_file` so far, in its order.

        Read on from where the last call stopped (a whole line at a time): tests poll
        this every 50 ms while a run writes an event per rank and step, and parsing the
        whole file at each poll grows with the run."""
        try:
            with open(self.events_file, "rb") as f:
                stat = os.fstat(f.fileno())
                read = (self.events_file, stat.st_ino)
                if self._read_from[0] != read or stat.st_size < self._read_from[1]:
                    self._read_from, self._events = (read, 0), []  # another file
                f.seek(self._read_from[1])
                chunk = f.read()
        except FileNotFoundError:
            return []
        whole = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits
        self._events += [json.loads(line) for line in whole.splitlines() if line.endswith(b"}")]
        self._read_from = (read, self._read_from[1] + len(whole))
        return list(self._events)

    def wait_for(self, predicate: Callable[[Event], bool], timeout: float = 120) -> Event:
        """The first event meeting ``predicate``, waiting for it."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for event in self.events():
                if predicate(event):
                    return event
            if self.agents and all(a.proc.poll() is not None for a in self.agents.values()):
                break
            time.sleep(0.05)
        raise TimeoutError(
            f"no such event within {timeout} s; logs in {self.workdir}\n{self.stacks()}"
            f"\n{self.said()}"
        )

    def pace(self, step_time: float) -> None:
        """Sets the example's extra seconds per step, from each rank's next step on."""
        written = self.step_time_file.with_suffix(".tmp")
        written.write_text(str(step_time))
        written.replace(self.step_time_file)  # whole, or not yet: never half a number

    def wait(
        self, timeout: float = 180, *, step_time: float | None = FINISHING_STEP_TIME
    ) -> dict[str, int]:
        """Waits for every agent to exit; their exit statuses.

        Args:
            timeout: Seconds for all of them.
            step_time: The example's extra seconds per step from now on: a test has done
                what it paced the run for, and waits for its end (a paced tail was up to
                20 s of idle steps in a standby test); None: the pace stays.
        """
        if step_time is not None:
            self.pace(step_time)
        end = time.monotonic() + timeout
        out: dict[str, int] = {}
        for node_id, agent in self.agents.items():
            try:
                out[node_id] = agent.proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(
                    f"{node_id} still runs after {timeout} s\n{self.stacks()}\n{self.said()}"
                ) from None
        return out

    def stacks(self) -> str:
        """The Python stacks of this cluster's live processes (agents, warm servers,
        workers), each thread's, by ``py-spy dump`` where py-spy is installed (the dev
        extra has it) and may trace them: what a run that hangs says of where it hangs
        (twice a standby test's agents never exited after training, and their logs
        said nothing)."""
        spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
        if spy is None:
            return "(no py-spy installed: no stacks)"
        out = []
        for pid, command in _marked(self._mark):
            try:
                dump = subprocess.run(
                    [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
                )
                text = dump.stdout or dump.stderr
            except (OSError, subprocess.TimeoutExpired) as exc:
                text = f"py-spy failed: {exc}"
            out.append(f"--- {pid}: {command[:200]}\n{text.strip()}")
        return "\n".join(out) or "(no process of the cluster left)"

    def said(self) -> str:
        """What the coordinator says of the job, in short: its generations (world size
        and why each ended), who waits and who is quarantined. It goes last in a timeout's
        message, after the stacks: a CI log keeps the tail of a failure, and this is what
        tells a false end (a hang or straggler named under load) from a slow run."""
        try:
            body = httpx.get(
                f"{self.url}/v1/jobs/{self.job}", verify=ssl_context(), timeout=10
            ).json()
        except (httpx.HTTPError, ValueError) as exc:
            return f"(the job's status could not be read: {exc!r})"
        if not isinstance(body, dict):
            return f"(the job's status: {body!r})"
        history = [
            (g.get("generation"), g.get("world_size"), g.get("ended_reason"))
            for g in body.get("history", [])
        ]
        waiting = [(w.get("node_id"), w.get("standby")) for w in body.get("waiting", [])]
        quarantined = [q.get("node_id") for q in body.get("quarantined_nodes", [])]
        return (
            f"job {self.job}: generation {body.get('generation')} ({body.get('status')});"
            f" history (generation, world, ended) {history}; waiting {waiting};"
            f" quarantined {quarantined}; blocked {body.get('blocked')}"
        )

    def lingering(self, timeout: float = 20) -> list[str]:
        """The command lines of this cluster's processes still running ``timeout`` s
        after the call (every agent having exited): none, once a job's workers and what
        they started (a DataLoader's workers, which notice a dead parent within 5 s)
        are gone. Returns as soon as none is left."""
        end = time.monotonic() + timeout
        while (left := _marked(self._mark)) and time.monotonic() < end:
            time.sleep(0.1)
        return [command for _, command in left]

    def stop(self) -> None:
        """Kills what still runs: the agents with what they started, and any process
        of theirs that outlived its parent."""
        for node_id, agent in self.agents.items():
            if agent.proc.poll() is None:
                self.kill(node_id)
        kill_processes([pid for pid, _ in _marked(self._mark)])


@dataclass
class Verdict:
    """What the events say about consistency and loss."""

    consistent: bool
    problems: list[str]
    steps_lost: dict[int, int]
    final_step: int | None
    first_loss: float | None
    last_loss: float | None


def judge(events: Sequence[Event], history: Sequence[dict[str, Any]]) -> Verdict:
    """Checks that every rank of every generation resumed from the checkpoint the
    coordinator named for it, and counts the steps lost at each restart.

    A generation that trained no step may show fewer ranks resumed: a membership change
    that ended it while its workers started stops those that had not resumed yet (a
    node that joins while the others load, often on a busy machine). One that trained a
    step must show each of its ranks once: a step is a collective of all of them.

    Args:
        events: The example's events (``--events``).
        history: The job's generation history (``GET /v1/jobs/JOB``).
    """
    problems: list[str] = []
    pointers = {g["generation"]: (g["checkpoint"] or {}).get("version") for g in history}
    resumed: dict[int, list[Event]] = {}
    for e in events:
        if e["event"] == "resumed":
            resumed.setdefault(e["generation"], []).append(e)
    trained = {e["generation"] for e in events if e["event"] == "step"}
    for generation, group in sorted(resumed.items()):
        versions = {e["version"] for e in group}
        ranks = sorted(e["rank"] for e in group)
        if len(versions) != 1:
            problems.append(f"generation {generation}: ranks loaded versions {sorted(versions)}")
        if versions != {pointers.get(generation)}:
            problems.append(
                f"generation {generation}: loaded {sorted(versions, key=str)}, "
                f"the coordinator named {pointers.get(generation)}"
            )
        every = list(range(group[0]["world_size"]))
        fits = len(set(ranks)) == len(ranks) and set(ranks) <= set(every)
        if ranks != every and (generation in trained or not fits):
            problems.append(f"generation {generation}: ranks {ranks} resumed")
    steps = [e for e in events if e["event"] == "step"]
    last_step: dict[int, int] = {}
    for e in steps:
        last_step[e["generation"]] = max(last_step.get(e["generation"], -1), e["step"])
    lost: dict[int, int] = {}
    for generation, group in resumed.items():
        earlier = [g for g in last_step if g < generation]
        if earlier:
            lost[generation] = max(0, last_step[max(earlier)] - (group[0]["step"] - 1))
    finished = [e["step"] for e in events if e["event"] == "finished"]
    return Verdict(
        consistent=not problems and bool(resumed),
        problems=problems,
        steps_lost=lost,
        final_step=max(finished) if finished else None,
        first_loss=steps[0]["loss"] if steps else None,
        last_loss=steps[-1]["loss"] if steps else None,
    )
