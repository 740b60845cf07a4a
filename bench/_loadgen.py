"""Simulated nodes for the rendezvous bench: N nodes in one asyncio process.

Each node keeps one HTTP/1.1 connection open and writes on it the bytes an
``ElasticClient`` writes: ``join`` with the job's spec, ``wait`` long-polls until the
seal, then heartbeats with the credential the join returned. Those bytes are the
client's own: a real ``ElasticClient`` builds each request (on a transport that keeps it
instead of sending it) and h11 writes it as httpx's connection would, so a field or a
header the client adds is on the wire here too. (Hand-written bodies drifted once: the
client's ``warm`` and ``ready`` fields left every round refused, "bodies differ from the
client's".) It reads only the status, ``content-length`` and the JSON it needs, so a
request costs this process a fraction of what it costs the coordinator
(``bench/rendezvous.py --only transports`` measures it beside httpx's ``AsyncClient``).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import resource
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import h11
import httpx
from pydantic import BaseModel

from rallypoint.client import CREDENTIAL_HEADER, ElasticClient, JobSpec
from rallypoint.client.models import Assignment, HeartbeatRequest, JoinReply, RankProgress

__all__ = [
    "Beats",
    "Loadgen",
    "LoadgenError",
    "Round",
    "raise_nofile",
    "run",
]

_T = TypeVar("_T")
_CONTENT_LENGTH = re.compile(rb"(?i)\r\ncontent-length: *(\d+)")
_RETRY_AFTER = re.compile(rb"(?i)\r\nretry-after: *(\d+(?:\.\d*)?)\r\n")
_RETRY_STATUS = {429, 502, 503, 504}  # as ElasticClient retries them
_CONNECTING = 256  # connections opened at once: uvicorn's listen backlog is 2,048


class LoadgenError(RuntimeError):
    pass


def run(main: Coroutine[Any, Any, _T]) -> _T:
    """Runs ``main`` on uvloop (the coordinator's loop; cheaper here too) if present."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop comes with rallypoint[service]
        return asyncio.run(main)
    return uvloop.run(main)


def raise_nofile(connections: int) -> tuple[int, int]:
    """Lets this process (and the coordinator it starts, which inherits it) hold a file
    descriptor per connection and then some; returns the (soft, hard) limit now.

    Raises:
        LoadgenError: The hard limit is lower and this process may not raise it.
    """
    need = connections + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, max(hard, need)))
    except (ValueError, OSError) as exc:
        raise LoadgenError(f"RLIMIT_NOFILE is {soft}/{hard}; {need} needed: {exc}") from exc
    return resource.getrlimit(resource.RLIMIT_NOFILE)


class _Connection:
    """One node's keep-alive connection; a reply is read by its ``content-length`` (the
    coordinator sends no chunked replies)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.sent = self.received = 0

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def request(self, head: bytes, body: bytes) -> tuple[int, bytes, bytes]:
        """Sends a request's head and body; returns the reply's status, head and body. Like
        httpx, it opens a new connection once if the server closed the idle one."""
        for attempt in (0, 1):
            if self.writer is None or self.writer.is_closing():
                await self.open()
            assert self.reader is not None and self.writer is not None
            # Two writes, as httpx makes them (h11 hands over the head, then the body,
            # on a TCP_NODELAY socket).
            self.writer.write(head)
            self.writer.write(body)
            try:
                reply_head = await self.reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                self.writer.close()
                self.writer = None
                if attempt:
                    raise
                continue
            match = _CONTENT_LENGTH.search(reply_head)
            reply = await self.reader.readexactly(int(match[1])) if match else b""
            self.sent += len(head) + len(body)
            self.received += len(reply_head) + len(reply)
            return int(reply_head[9:12]), reply_head, reply
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class _Captured(Exception):
    """Ends a client's call once it built the request the load generator wants."""


class _Scripted(httpx.BaseTransport):
    """Answers a client's requests with ``replies`` in turn and keeps every request; the
    first request past them raises :class:`_Captured` (the client does not retry it)."""

    def __init__(self, *replies: BaseModel) -> None:
        self.replies = list(replies)
        self.requests: list[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        self.requests.append(request)
        if len(self.requests) > len(self.replies):
            raise _Captured
        reply = self.replies[len(self.requests) - 1]
        return httpx.Response(200, content=reply.model_dump_json(exclude_none=True))


def _wire(request: httpx.Request) -> tuple[bytes, bytes]:
    """The head and the body httpx's HTTP/1.1 connection writes for ``request``: h11's
    bytes for it, as httpcore hands it over (the target is the URL's raw path)."""
    conn = h11.Connection(our_role=h11.CLIENT)
    head = conn.send(
        h11.Request(method=request.method, target=request.url.raw_path, headers=request.headers.raw)
    )
    body = conn.send(h11.Data(data=request.content))
    assert head is not None and body is not None
    return head, body


# What the client is given where a request's head holds a node's own value, replaced in
# the bytes it built by each node's: the id in the path, the credential in its header.
_NODE = "loadgen-node-sentinel"
_CREDENTIAL = "loadgen-credential-sentinel"


@dataclass(frozen=True)
class _Template:
    """A request the client built for the node :data:`_NODE` with the credential
    :data:`_CREDENTIAL`, each of which its head holds once and its body never."""

    head: bytes
    body: bytes

    @classmethod
    def of(cls, request: httpx.Request) -> _Template:
        head, body = _wire(request)
        for value in (_NODE, _CREDENTIAL):
            if head.count(value.encode()) != 1 or value.encode() in body:
                raise LoadgenError(
                    f"the client's request holds {value!r} other than once: {head!r}"
                )
        return cls(head, body)

    def head_for(self, node_id: bytes, credential: bytes) -> bytes:
        return self.head.replace(_NODE.encode(), node_id).replace(_CREDENTIAL.encode(), credential)


def _client(
    url: str, job: str, node_id: str, *replies: BaseModel
) -> tuple[ElasticClient, _Scripted]:
    transport = _Scripted(*replies)
    return ElasticClient(url, job, node_id, http_transport=transport), transport


def _captured(call: Callable[[], object], transport: _Scripted) -> list[httpx.Request]:
    """The requests ``call`` made, the last one kept from the wire."""
    try:
        call()
    except _Captured:
        return transport.requests
    raise LoadgenError("the client's call ended without the request expected")


def _join(url: str, job: str, node_id: str, port: int, spec: JobSpec) -> tuple[bytes, bytes]:
    """``ElasticClient.join(spec=spec)``'s first request, as the client writes it."""
    client, transport = _client(url, job, node_id)
    try:
        (join,) = _captured(lambda: client.join("127.0.0.1", port, spec=spec), transport)
    finally:
        client.close()
    return _wire(join)


def _wait(url: str, job: str, round: int) -> _Template:
    """The long-poll ``ElasticClient.join`` sends after a reply of ``waiting`` for
    ``round``."""
    waiting = JoinReply(status="waiting", round=round, credential=_CREDENTIAL)
    client, transport = _client(url, job, _NODE, waiting)
    try:
        _, wait = _captured(lambda: client.join("127.0.0.1", 20000), transport)
    finally:
        client.close()
    return _Template.of(wait)


def _heartbeat(
    url: str,
    job: str,
    generation: int,
    hold: timedelta,
    progress: Sequence[RankProgress] = (),
) -> _Template:
    """``ElasticClient.heartbeat(hold, progress=progress)`` of a member of ``generation``
    (no ``progress``: a beat that carries none, as a node whose workers report none)."""
    assignment = Assignment(
        job_id=job,
        node_id=_NODE,
        generation=generation,
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=29500,
    )
    sealed = JoinReply(status="sealed", round=1, assignment=assignment, credential=_CREDENTIAL)
    client, transport = _client(url, job, _NODE, sealed)
    try:
        _, beat = _captured(
            lambda: (
                client.join("127.0.0.1", 20000),
                client.heartbeat(hold, progress=list(progress) or None),
            ),
            transport,
        )
    finally:
        client.close()
    return _Template.of(beat)


class _Node:
    """A simulated node: its connection and what it was told."""

    def __init__(self, host: str, port: int, node_id: str) -> None:
        self.node_id = node_id
        self.conn = _Connection(host, port)
        self.credential = b""
        self.generation = 0
        self.rank = -1
        self.assignment_bytes = 0
        self.assigned_at = 0.0
        self.retries = 0
        self.retried = ""  # the first answer retried

    async def send(self, template: _Template) -> tuple[int, bytes]:
        """One request of ``template``'s, as this node's."""
        head = template.head_for(self.node_id.encode(), self.credential)
        return await self.call(head, template.body)

    async def call(self, head: bytes, body: bytes) -> tuple[int, bytes]:
        """One request, retried on 429/5xx as ElasticClient's default RetryPolicy does
        (full jitter, from 0.2 s doubling to 10 s, no later than a ``Retry-After``, for
        120 s); raises on other errors."""
        cap, end = 0.2, time.monotonic() + 120.0
        while True:
            status, reply_head, reply = await self.conn.request(head, body)
            if status < 400:
                return status, reply
            answer = f"HTTP {status} {reply[:300].decode(errors='replace')}"
            delay = random.uniform(0, cap)
            if status not in _RETRY_STATUS or time.monotonic() + delay > end:
                raise LoadgenError(f"{self.node_id}: {answer}")
            self.retries += 1
            self.retried = self.retried or answer
            soon = _RETRY_AFTER.search(reply_head)
            await asyncio.sleep(min(delay, float(soon[1])) if soon else delay)
            cap = min(cap * 2, 10.0)


@dataclass
class Round:
    """One rendezvous round as the nodes saw it.

    Attributes:
        seconds: From the first join written until the last node held its assignment.
        loadgen_cpu: This process's CPU seconds over that time.
        assignment_bytes: The mean body of the reply that carried a node's assignment.
        wire_bytes: Bytes sent and received per node over the round, HTTP heads included.
        requests: Joins and waits sent.
        retries: Of those, answers of 429/5xx that were retried.
        retried: One of those answers.
    """

    seconds: float
    loadgen_cpu: float
    assignment_bytes: float
    wire_bytes: float
    requests: int
    retries: int
    retried: str = ""


@dataclass
class Beats:
    """Heartbeats as the nodes saw them.

    Attributes:
        samples: (seconds since the first beat, latency beyond the hold) per beat.
        loadgen_cpu: This process's CPU seconds over the beats.
        restarts: Replies that said ``restart``.
        sent: Bytes the nodes sent over the beats, HTTP heads included.
        received: Bytes they received.
    """

    samples: list[tuple[float, float]] = field(default_factory=list)
    loadgen_cpu: float = 0.0
    restarts: int = 0
    sent: int = 0
    received: int = 0


class Loadgen:
    """N simulated nodes of one job on one coordinator (see the module docstring).

    Args:
        host, port: The coordinator.
        job: The job id.
        n: Nodes, named ``n00000`` and on.
    """

    def __init__(self, host: str, port: int, job: str, n: int) -> None:
        self.job = job
        self.url = f"http://{host}:{port}"
        self.nodes = [_Node(host, port, f"n{i:05d}") for i in range(n)]
        self._waits: dict[int, _Template] = {}

    def _wait(self, round: int) -> _Template:
        if round not in self._waits:
            self._waits[round] = _wait(self.url, self.job, round)
        return self._waits[round]

    async def connect(self) -> float:
        """Opens every node's connection (at most 256 at a time); returns the seconds."""
        gate = asyncio.Semaphore(_CONNECTING)
        started = time.perf_counter()

        async def one(node: _Node) -> None:
            async with gate:
                await node.conn.open()

        await asyncio.gather(*(one(node) for node in self.nodes))
        return time.perf_counter() - started

    def close(self) -> None:
        for node in self.nodes:
            node.conn.close()

    async def join(
        self,
        spec: JobSpec,
        go: Callable[[], None] = lambda: None,
        waves: tuple[int, float] | None = None,
    ) -> Round:
        """Every node joins with ``spec`` and long-polls until it is assigned, exactly as
        ``ElasticClient.join(spec=spec)``; ``go`` runs as the first join is written (the
        bench reads the coordinator's CPU there).

        Args:
            waves: (nodes, seconds): that many nodes start their join at once, the next
                as many that much later; None: all at once.

        Raises:
            LoadgenError: A request was refused, or the ranks are not 0..N-1.
        """
        n = len(self.nodes)
        joins = [
            _join(self.url, self.job, node.node_id, 20000 + i % 40000, spec)
            for i, node in enumerate(self.nodes)
        ]
        self._wait(1)  # a new job's first round: built before the clock starts
        for node in self.nodes:
            node.conn.sent = node.conn.received = 0
        requests = 0
        loop = asyncio.get_running_loop()

        async def one(i: int, node: _Node, join: tuple[bytes, bytes]) -> None:
            nonlocal requests
            if waves is not None:
                await asyncio.sleep(i // waves[0] * waves[1])
            requests += 1
            _, reply = await node.call(*join)
            data = json.loads(reply)
            node.credential = data["credential"].encode()
            while data["status"] != "sealed":
                requests += 1
                _, reply = await node.send(self._wait(data["round"]))
                data = json.loads(reply)
            node.assigned_at = loop.time()
            node.assignment_bytes = len(reply)
            assignment = data["assignment"]
            node.generation, node.rank = assignment["generation"], assignment["rank"]

        cpu = time.process_time()
        started = loop.time()
        go()
        await asyncio.gather(*(one(i, self.nodes[i], joins[i]) for i in range(n)))
        seconds = max(node.assigned_at for node in self.nodes) - started
        cpu = time.process_time() - cpu
        ranks = sorted(node.rank for node in self.nodes)
        if ranks != list(range(n)) or len({node.generation for node in self.nodes}) != 1:
            raise LoadgenError(f"ranks are not 0..{n - 1} of one generation: {ranks[:5]}...")
        return Round(
            seconds=seconds,
            loadgen_cpu=cpu,
            assignment_bytes=sum(node.assignment_bytes for node in self.nodes) / n,
            wire_bytes=sum(node.conn.sent + node.conn.received for node in self.nodes) / n,
            requests=requests,
            retries=sum(node.retries for node in self.nodes),
            retried=next((node.retried for node in self.nodes if node.retried), ""),
        )

    async def heartbeats(
        self,
        seconds: float,
        interval: timedelta = timedelta(seconds=1),
        hold: timedelta = timedelta(0),
        progress: Sequence[RankProgress] = (),
    ) -> Beats:
        """Every node heartbeats for ``seconds`` as ``ElasticClient.heartbeats(interval)``
        does: a beat asks the coordinator to hold it ``hold`` (the client's thread holds
        each for ``interval``; 0 is a plain ``heartbeat()``), and the next one starts an
        ``interval`` after the last one started, or at once if the reply came later.
        The nodes' first beats are spread evenly over one interval. Each beat carries
        ``progress`` (an agent's beat carries its workers', one per process), the same
        for every node: what it costs the coordinator does not depend on the values.
        """
        every, held = interval.total_seconds(), hold.total_seconds()
        beat = _heartbeat(self.url, self.job, self.nodes[0].generation, hold, progress)
        loop = asyncio.get_running_loop()
        beats = Beats()
        start = loop.time() + 0.5
        end = start + seconds

        async def one(i: int, node: _Node) -> None:
            at = start + every * i / len(self.nodes)
            await asyncio.sleep(at - loop.time())
            while at < end:
                sent = loop.time()
                _, reply = await node.send(beat)
                now = loop.time()
                beats.samples.append((sent - start, now - sent - held))
                if b'"restart"' in reply:
                    beats.restarts += 1
                    return
                at = sent + every
                await asyncio.sleep(max(0.0, at - now))

        cpu = time.process_time()
        sent = sum(node.conn.sent for node in self.nodes)
        received = sum(node.conn.received for node in self.nodes)
        await asyncio.gather(*(one(i, node) for i, node in enumerate(self.nodes)))
        beats.loadgen_cpu = time.process_time() - cpu
        beats.sent = sum(node.conn.sent for node in self.nodes) - sent
        beats.received = sum(node.conn.received for node in self.nodes) - received
        return beats

    async def beat_raw(self, nodes: int, beats: int) -> float:
        """The first ``nodes`` nodes each send ``beats`` plain heartbeats, one after the
        other, on their connections; returns this process's CPU seconds (beside
        :meth:`beat_httpx`, to show which is cheaper per request)."""
        beat = _heartbeat(self.url, self.job, self.nodes[0].generation, timedelta(0))

        async def one(node: _Node) -> None:
            for _ in range(beats):
                _, reply = await node.send(beat)
                json.loads(reply)

        cpu = time.process_time()
        await asyncio.gather(*(one(node) for node in self.nodes[:nodes]))
        return time.process_time() - cpu

    async def beat_httpx(self, url: str, nodes: int, beats: int) -> float:
        """:meth:`beat_raw` through one httpx ``AsyncClient`` (a connection per node)."""
        body = HeartbeatRequest(generation=self.nodes[0].generation).model_dump_json()
        limits = httpx.Limits(max_connections=nodes, max_keepalive_connections=nodes)
        async with httpx.AsyncClient(base_url=url, limits=limits) as client:

            async def one(node: _Node) -> None:
                path = f"/v1/jobs/{self.job}/nodes/{node.node_id}/heartbeat"
                headers = {
                    CREDENTIAL_HEADER: node.credential.decode(),
                    "Content-Type": "application/json",
                }
                for _ in range(beats):
                    reply = await client.post(path, content=body, headers=headers)
                    reply.raise_for_status()
                    json.loads(reply.content)

            cpu = time.process_time()
            await asyncio.gather(*(one(node) for node in self.nodes[:nodes]))
            return time.process_time() - cpu
