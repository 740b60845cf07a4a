"""Node processes that run the torchrun plugin's rendezvous as torchrun's agent does,
for many jobs at once, without training: the cheapest real client of the plugin path.

A :class:`PluginNode` is one process (torch imported once, seconds here) with one agent
thread per job it is told to start. Each thread gets the handler as torchrun gets it
(``get_rendezvous_handler``, through the ``torchrun.handlers`` entry point), calls
``next_rendezvous``, uses the generation's store as the agent does to assign worker
ranks (a set, then a blocking get of every node's key), and then polls
``num_nodes_waiting`` every 0.1 s (torchrun's monitor interval): when the plugin says the
generation ended, it calls ``next_rendezvous`` again, as the agent restarts its workers.

Commands, one a line on stdin: ``start JOB MIN MAX HEARTBEAT_TIMEOUT LAST_CALL`` (a
heartbeat every second, whatever the timeout),
``hush JOB`` (no further rendezvous for the job, then the handler's ``shutdown``: the
node leaves, and the generation's end restarts nothing). Events, one JSON object a line
on stdout: ``sealed`` (job, generation, rank, world_size), ``restart`` (job, why),
``hushed``, ``error``.

A :class:`VictimNode` is a node to SIGKILL: an ``ElasticClient`` that joins and holds
heartbeats (no torch), in a process of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any

__all__ = ["PluginNode", "VictimNode"]

_AGENT = r"""
import json, os, sys, threading
os.environ["RALLYPOINT_MEMORY_DIR"] = "none"  # no memory tier: nothing here saves
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

url, node = sys.argv[1:3]
lock = threading.Lock()
handlers, hushed = {}, {}

def emit(**event):
    with lock:
        print(json.dumps(event), flush=True)

def agent(job, low, high, timeout, last_call):
    params = RendezvousParameters(
        backend="rallypoint", endpoint=url, run_id=job, min_nodes=int(low),
        max_nodes=int(high), local_addr="127.0.0.1", node_id=node,
        heartbeat_timeout=timeout, last_call=last_call, join_timeout="60",
        store_timeout="30", heartbeat_interval="1",
    )
    handler = handlers[job] = get_rendezvous_handler(params)
    try:
        while not hushed[job].is_set():
            info = handler.next_rendezvous()
            a = handler.assignment
            try:  # the agent's worker-rank assignment through the generation's store
                info.store.set(f"node/{info.rank}", node)
                for r in range(info.world_size):
                    info.store.get(f"node/{r}")
            except Exception as exc:
                emit(event="restart", job=job, node=node, generation=a.generation,
                     why=f"store: {type(exc).__name__}: {exc}")
                continue
            emit(event="sealed", job=job, node=node, generation=a.generation,
                 rank=info.rank, world_size=info.world_size)
            while not hushed[job].wait(0.1):  # torchrun's monitor interval
                if handler.num_nodes_waiting() > 0:
                    beats = getattr(handler, "_beats", None)
                    emit(event="restart", job=job, node=node, generation=a.generation,
                         why=getattr(beats, "ended", None))
                    break
    except Exception as exc:
        emit(event="error", job=job, node=node, error=f"{type(exc).__name__}: {exc}")

for line in sys.stdin:
    command, job, *args = line.split()
    if command == "start":
        hushed[job] = threading.Event()
        threading.Thread(target=agent, args=(job, *args), daemon=True).start()
    elif command == "hush":
        hushed[job].set()
        def leave(job=job):  # the beats stop: a job the test is done with costs nothing
            handlers[job].shutdown()
            emit(event="hushed", job=job, node=node)
        threading.Thread(target=leave, daemon=True).start()
"""

_VICTIM = r"""
import base64, json, sys
from datetime import timedelta
from rallypoint.client import ElasticClient, JobSpec, RallypointError, StoreRequest

url, job, node, low, high, timeout, last_call = sys.argv[1:8]
client = ElasticClient(url, job, node)
spec = JobSpec(min_nodes=int(low), max_nodes=int(high),
               heartbeat_timeout=timedelta(seconds=int(timeout)),
               last_call=timedelta(seconds=int(last_call)), join_timeout=timedelta(seconds=60))
a = client.join(addr="127.0.0.1", spec=spec, timeout=timedelta(seconds=60))
with client.heartbeats(interval=timedelta(seconds=1)):
    # Its part of the agents' worker-rank assignment (they wait for every node's key).
    value = base64.b64encode(node.encode()).decode()
    try:
        client.store(a.generation, StoreRequest(op="set", keys=[f"node/{a.rank}"],
                                                values=[value]))
        event = {"event": "sealed", "generation": a.generation}
    except RallypointError as exc:
        event = {"event": "restart", "generation": a.generation, "why": str(exc)}
    print(json.dumps({**event, "job": job, "node": node}), flush=True)
    sys.stdin.read()  # held until killed
"""


class _Process:
    def __init__(self, name: str, args: list[str]) -> None:
        self.name = name
        # Its stderr: why it failed, if it did (closed in stop).
        self.log = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
        )
        self.events: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        stdout = self.proc.stdout
        assert stdout is not None
        threading.Thread(target=self._read, args=(stdout,), daemon=True).start()

    def _read(self, stdout: IO[str]) -> None:
        for line in stdout:
            if line.startswith("{"):
                with self._changed:
                    self.events.append(json.loads(line))
                    self._changed.notify_all()

    def job_events(self, job: str) -> list[dict[str, Any]]:
        with self._changed:
            return [e for e in self.events if e["job"] == job]

    def wait_for(
        self, job: str, event: str | None, deadline: float, **fields: Any
    ) -> dict[str, Any]:
        """The job's first event of this kind (None: any), with these ``fields``, by
        ``deadline`` (``time.monotonic``)."""
        want = {"job": job, **({"event": event} if event else {}), **fields}
        with self._changed:
            while True:
                found = [e for e in self.events if want.items() <= e.items()]
                if found:
                    return found[0]
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise TimeoutError(
                        f"{self.name}: no {event} of {job}: {self.job_events(job)}\n{self.stderr()}"
                    )
                self._changed.wait(left)

    def stderr(self, chars: int = 3000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout, self.log):
            if pipe is not None:
                pipe.close()


class PluginNode(_Process):
    """One node's agent process (see the module docstring), for any number of jobs."""

    def __init__(self, url: str, node: str) -> None:
        super().__init__(node, [sys.executable, "-c", _AGENT, url, node])

    def send(self, *words: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()


class VictimNode(_Process):
    """A node of ``job`` to SIGKILL once it beats: an ``ElasticClient`` holding its
    heartbeats, as an agent does."""

    def __init__(self, url: str, job: str, node: str, *spec: int) -> None:
        super().__init__(node, [sys.executable, "-c", _VICTIM, url, job, node, *map(str, spec)])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
