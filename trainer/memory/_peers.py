"""Peer replicas: each node's agent runs a replica server over its memory tier.

A rank copies its files of a version to the node the coordinator named (its ring
successor) with a write grant; a restarting rank reads files that its own node does not
hold from a live holder with a read grant. Grants are signed by the coordinator with the
job's Ed25519 key and checked here with its public half (:mod:`rallypoint.client`), so
the bytes go between nodes, never through the coordinator::

    PUT {url}/v/{version}/rank-RRRRR/{file}?token=...   X-Rallypoint-Items: N
        body: N bytes of JSON, the file's items ([[offset, length, checksum], ...]),
        then the file
    GET {url}/v/{version}/{path}?token=...              Range: bytes=a-b (optional)

A write is refused unless its grant was issued in the generation this agent runs (a
zombie of an ended generation cannot overwrite replicas), a read unless its grant is at
least as new (a zombie cannot read on). Every item of a written file is checked against
its checksum before the file is kept.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import logging
import os
import re
import secrets
import shutil
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import torch
import xxhash

from rallypoint.client import ElasticClient, GrantClaims, PeerGrant, SignedUrlError, verify_grant

from .._bytes import CHECKSUM, as_memoryview
from ..errors import TransferDenied, TransferError, TransferNotFound
from ._tier import NodeMemory

__all__ = ["ITEMS_HEADER", "ReplicaServer", "push", "read_peer"]

log = logging.getLogger("rallypoint.trainer")

#: The header that gives the length of the item list the body of a write starts with
#: (a list of thousands of items would not fit a header line).
ITEMS_HEADER = "X-Rallypoint-Items"
_MAX_ITEMS = 64 << 20
_PATH = re.compile(r"^/(?P<id>[0-9a-f]{16})/v/(?P<version>[0-9]{1,10})/(?P<name>[A-Za-z0-9._/-]+)$")
_RANK = re.compile(r"^rank-(?P<rank>[0-9]{5})/[A-Za-z0-9._-]{1,64}$")
_CHUNK = 8 << 20
_TIMEOUT = 60.0


class _Checker:
    """Checks a file's items against their checksums as its bytes stream in."""

    def __init__(self, items: list[tuple[int, int, str]], size: int) -> None:
        self.items = sorted(items)
        self.size = size
        self.position = 0
        self.index = 0
        self.hasher = xxhash.xxh3_128()
        self.bad: int | None = next(
            (o for o, n, _ in self.items if o < 0 or n < 0 or o + n > size), None
        )
        for (o1, n1, _), (o2, _, _) in itertools.pairwise(self.items):
            if o1 + n1 > o2:
                self.bad = o2  # overlapping items: refuse rather than guess
                break

    def feed(self, chunk: memoryview) -> None:
        start, end = self.position, self.position + len(chunk)
        self.position = end
        while self.bad is None and self.index < len(self.items):
            offset, length, digest = self.items[self.index]
            lo, hi = max(start, offset), min(end, offset + length)
            if lo < hi:
                self.hasher.update(chunk[lo - start : hi - start])
            if offset + length > end:
                return  # the item goes on in the next chunk
            if f"{CHECKSUM}:{self.hasher.hexdigest()}" != digest:
                self.bad = offset
            self.hasher.reset()
            self.index += 1

    def failed(self) -> int | None:
        """The offset of the first item that failed (or was never complete), if any."""
        if self.bad is None and self.index < len(self.items):
            return self.items[self.index][0]
        return self.bad


class ReplicaServer:
    """This node's replica server (run by its agent, one per agent start).

    Args:
        memory: The node's memory tier.
        client: The agent's client (for the job's public key).
        addr: The address other nodes reach this one at.
        generation: The generation the agent runs now (0 before its first).
        joining: Whether the agent waits to join a generation now (a standby parked
            beside a running one among them): it then takes copies granted in a newer
            generation than its own, but never again in an older one than it took.
    """

    def __init__(
        self,
        memory: NodeMemory,
        client: ElasticClient,
        addr: str,
        generation: Callable[[], int],
        joining: Callable[[], bool] = lambda: False,
    ) -> None:
        self.memory = memory
        self.client = client
        self.generation = generation
        self.joining = joining
        self._newest = 0
        self._id = secrets.token_hex(8)
        self._key: str | None = None
        self._server = ThreadingHTTPServer(("0.0.0.0", 0), _handler(self))
        self._server.daemon_threads = True
        host = f"[{addr}]" if ":" in addr else addr
        #: The URL other nodes reach this server at: new with every agent, so the
        #: coordinator never counts a restarted agent's empty memory as a holder.
        self.url = f"http://{host}:{self._server.server_address[1]}/{self._id}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="rallypoint-replicas", daemon=True
        )

    def start(self) -> ReplicaServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def public_key(self) -> str:
        if self._key is None:
            self._key = self.client.peer_key()
        return self._key

    def check(self, token: str, version: int, op: str) -> GrantClaims:
        """The grant's claims if they cover ``op`` on ``version`` here, now.

        Raises:
            SignedUrlError: They do not (the message says why).
        """
        claims = verify_grant(self.public_key(), token)
        if (claims.job, claims.node, claims.peer) != (
            self.memory.job_id,
            self.memory.node_id,
            self.url,
        ):
            raise SignedUrlError("the grant is for another job, node or agent")
        if claims.version != version or claims.op != op:
            raise SignedUrlError(f"the grant does not allow {op} of version {version}")
        running = self.generation()
        # Only the coordinator grants a copy to a standby, and only beside the
        # generation that runs: the newest this node was granted one in.
        standby = claims.gen > running and claims.gen >= self._newest and self.joining()
        if op == "write" and claims.gen != running and not standby:
            raise SignedUrlError(
                f"the grant is from generation {claims.gen}; this node runs {running}"
            )
        if standby and op == "write":
            self._newest = claims.gen
        if claims.gen < running:
            raise SignedUrlError(f"the grant is from ended generation {claims.gen}")
        return claims


def _handler(server: ReplicaServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("replica server: " + format, *args)

        def _refuse(self, status: int, message: str) -> None:
            body = json.dumps(
                {"code": "access_denied" if status == 403 else "bad", "message": message}
            )
            raw = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _target(self, op: str) -> tuple[int, str, GrantClaims] | None:
            url = urlsplit(self.path)
            match = _PATH.match(url.path)
            if match is None or match["id"] != server.url.rsplit("/", 1)[1]:
                self._refuse(404, "no such replica server")  # an earlier agent's URL
                return None
            name = match["name"]
            if ".." in name.split("/") or name.startswith("/"):
                self._refuse(400, "bad file name")
                return None
            token = parse_qs(url.query).get("token", [""])[0]
            version = int(match["version"])
            try:
                claims = server.check(token, version, op)
            except SignedUrlError as exc:
                self._refuse(403, str(exc))
                return None
            except Exception as exc:  # the coordinator could not give the key
                self._refuse(503, f"cannot check grants now: {exc}")
                return None
            return version, name, claims

        def do_PUT(self) -> None:
            target = self._target("write")
            if target is None:
                return
            version, name, claims = target
            rank = _RANK.match(name)
            if rank is None or int(rank["rank"]) not in claims.ranks:
                self._refuse(403, f"the grant does not cover {name}")
                return
            try:
                total = int(self.headers.get("Content-Length", ""))
                listed = int(self.headers.get(ITEMS_HEADER, ""))
                if not 0 < listed <= min(total, _MAX_ITEMS):
                    raise ValueError(f"an item list of {listed} bytes")
                raw = self.rfile.read(listed)
                items = [(int(o), int(n), str(c)) for o, n, c in json.loads(raw)]
            except (TypeError, ValueError) as exc:
                self._refuse(400, f"Content-Length and {ITEMS_HEADER} are required: {exc}")
                return
            size = total - listed
            if not self._receive(version, name, size, items):
                return
            self.send_response(201)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _receive(
            self, version: int, name: str, size: int, items: list[tuple[int, int, str]]
        ) -> bool:
            """Streams the body next to its place, checks every item, then moves it in:
            a replica is there whole and checked, or not at all."""
            target = server.memory.replica_path(version, name)
            partial = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                free = shutil.disk_usage(target.parent).free
                if free < size:
                    self._refuse(
                        507, f"{size >> 20} MiB sent, {free >> 20} MiB of shared memory free"
                    )
                    return False
                checker = _Checker(items, size)
                buffer = bytearray(min(_CHUNK, max(size, 1)))
                view = memoryview(buffer)
                with open(partial, "wb") as f:
                    left = size
                    while left:
                        n = self.rfile.readinto(view[: min(len(buffer), left)])
                        if not n:
                            break
                        # Checked as it streams: a second pass would read it all again.
                        checker.feed(view[:n])
                        f.write(view[:n])
                        left -= n
                if left:
                    self._refuse(400, f"the body ended {left} bytes short")
                    return False
                bad = checker.failed()
                if bad is not None:
                    self._refuse(422, f"{name} at {bad} fails its checksum")
                    return False
                os.replace(partial, target)
            except OSError as exc:
                self._refuse(507, f"cannot keep the replica: {exc}")
                return False
            finally:
                with contextlib.suppress(OSError):
                    partial.unlink()
            server.memory.prune_replicas()
            return True

        def do_GET(self) -> None:
            target = self._target("read")
            if target is None:
                return
            version, name, _ = target
            path = server.memory.find(version, name)
            if path is None:
                self._refuse(404, f"version {version} {name} is not held here")
                return
            size = path.stat().st_size
            start, stop = 0, size
            ranged = self.headers.get("Range")
            if ranged:
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", ranged.strip())
                if m is None:
                    self._refuse(400, "only one bytes=a-b range")
                    return
                start = int(m[1])
                stop = min(size, int(m[2]) + 1) if m[2] else size
                if start >= size and size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
            self.send_response(206 if ranged else 200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(stop - start))
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
            self.end_headers()
            with open(path, "rb") as f:
                self.connection.sendfile(f, start, stop - start)  # page cache to socket

    return Handler


def _connection(grant: PeerGrant, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    url = urlsplit(grant.url)
    if url.scheme != "http" or url.hostname is None:
        raise TransferDenied(f"replica server URL {grant.url!r} is not http://host:port/...")
    return http.client.HTTPConnection(url.hostname, url.port, timeout=timeout), url.path


def _failed(status: int, body: bytes, what: str) -> TransferError:
    try:
        message = str(json.loads(body)["message"])
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode(errors="replace")
    if status == 403:
        return TransferDenied(f"{what}: refused: {message}")
    if status == 404:
        return TransferNotFound(f"{what}: {message}")
    return TransferError(f"{what}: HTTP {status}: {message}")


def push(
    grant: PeerGrant,
    version: int,
    name: str,
    parts: Sequence[memoryview],
    items: Sequence[tuple[int, int, str]],
    *,
    timeout: float = _TIMEOUT,
) -> None:
    """Copies one file of ``version`` to the node ``grant`` names.

    Args:
        name: The file, relative to the version (``rank-00003/data.distcp``).
        parts: Its bytes, in order (sent as they are: nothing is joined).
        items: ``(offset, length, checksum)`` of each item, checked by the receiver.

    Raises:
        TransferDenied: The receiver refused the grant.
        TransferError: The copy failed (the receiver is gone, or out of memory).
    """
    what = f"copying v{version} {name} to node {grant.node_id}"
    listed = json.dumps([list(i) for i in items], separators=(",", ":")).encode()
    size = sum(len(p) for p in parts)
    conn, base = _connection(grant, timeout)
    try:
        conn.putrequest("PUT", f"{base}/v/{version}/{name}?token={quote(grant.token)}")
        conn.putheader("Content-Length", str(len(listed) + size))
        conn.putheader(ITEMS_HEADER, str(len(listed)))
        conn.endheaders()
        conn.send(listed)
        for part in parts:
            conn.send(part)
        response = conn.getresponse()
        body = response.read()
    except OSError as exc:
        raise TransferError(f"{what}: {exc}") from exc
    finally:
        conn.close()
    if response.status != 201:
        raise _failed(response.status, body, what)


def read_peer(
    grant: PeerGrant,
    version: int,
    name: str,
    start: int,
    length: int,
    *,
    timeout: float = _TIMEOUT,
) -> torch.Tensor:
    """``length`` bytes of a file of ``version`` from ``start``, from the replica server
    ``grant`` names (a uint8 tensor).

    Raises:
        TransferNotFound: The node does not hold the file.
        TransferDenied: It refused the grant.
        TransferError: The read failed, or came back short.
    """
    what = f"reading v{version} {name} from node {grant.node_id}"
    out = torch.empty(length, dtype=torch.uint8)
    conn, base = _connection(grant, timeout)
    try:
        conn.putrequest("GET", f"{base}/v/{version}/{name}?token={quote(grant.token)}")
        conn.putheader("Range", f"bytes={start}-{start + length - 1}")
        conn.endheaders()
        response = conn.getresponse()
        if response.status != 206:
            raise _failed(response.status, response.read(), what)
        view = as_memoryview(out)
        got = 0
        while got < length:
            n = response.readinto(view[got:])
            if not n:
                break
            got += n
    except OSError as exc:
        raise TransferError(f"{what}: {exc}") from exc
    finally:
        conn.close()
    if got != length:
        raise TransferError(f"{what}: {got} of {length} bytes came")
    return out
