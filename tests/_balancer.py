"""The deployed shape for the tests: coordinator replicas behind a real HAProxy
(:class:`Topology`: three on one Azurite).

HAProxy (Debian's package; ``make balancer`` installs it) health-checks every replica
through ``/readyz`` as a Kubernetes Service or an AzureML endpoint does, and reports
each server's open sessions on a stats page, so a test can kill the replica that holds
the long-polls.
"""

from __future__ import annotations

import contextlib
import csv
import io
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from rallypoint.cli.processes import free_port, stop_process
from rallypoint.client import ElasticClient
from rallypoint.tls import ssl_context

from ._azurite import Azurite
from ._coordinator import Coordinator

__all__ = ["REPLICAS", "Balancer", "Topology", "haproxy_binary"]


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or (
        "/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None
    )
    if found is None:
        raise RuntimeError("HAProxy is not installed: run `make balancer` (apt, as root)")
    return found


class Balancer:
    """HAProxy on a free loopback port, round robin over ``servers`` (``host:port``).

    Server connections that fail to open are retried on another server; a request
    whose server dies while holding it gets 502, which clients retry. Long-polls are
    held up to 30 s, so the server timeout is above that.
    """

    def __init__(self, servers: list[str]) -> None:
        self.servers = servers
        self.port = free_port()
        self.stats_port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="haproxy-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> str:
        lines = [
            "global",
            "    maxconn 4000",
            "defaults",
            "    mode http",
            "    timeout connect 1s",
            "    timeout client 90s",
            "    timeout server 90s",
            "    timeout http-keep-alive 60s",
            "    option redispatch",
            # A node's close reaches the replica that holds its heartbeat, which then cuts
            # it at once; without it a killed node is found only at the heartbeat timeout.
            "    option abortonclose",
            "    retries 2",
            "    retry-on conn-failure",
            "frontend rallypoint",
            f"    bind 127.0.0.1:{self.port}",
            "    default_backend coordinators",
            "frontend stats",
            f"    bind 127.0.0.1:{self.stats_port}",
            "    stats enable",
            "    stats uri /stats",
            "backend coordinators",
            "    balance roundrobin",
            # The probes of the deployments we ship: readiness, 1 s timeout.
            "    option httpchk GET /readyz",
            "    http-check expect status 200",
            "    timeout check 1s",
            "    default-server inter 500ms fall 2 rise 1",
        ]
        lines += [f"    server r{i} {address} check" for i, address in enumerate(self.servers)]
        return "\n".join(lines) + "\n"

    def start(self, deadline_s: float = 20) -> Balancer:
        config = self.dir / "haproxy.cfg"
        config.write_text(self.config())
        log = (self.dir / "haproxy.log").open("ab")
        self.proc = subprocess.Popen(
            [haproxy_binary(), "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited: {(self.dir / 'haproxy.log').read_text()}")
            with contextlib.suppress(httpx.TransportError, KeyError):
                if all(s["status"] == "UP" for s in self.stats().values()):
                    return self
            time.sleep(0.1)
        raise RuntimeError(f"haproxy's servers are not all up: {self.stats()}")

    def stats(self) -> dict[str, dict[str, str]]:
        """Each server's row of HAProxy's CSV statistics (``status``, ``scur``: open
        sessions, ...)."""
        reply = httpx.get(
            f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=2, verify=ssl_context()
        )
        rows = csv.DictReader(io.StringIO(reply.text.lstrip("# ")))
        return {
            row["svname"]: row
            for row in rows
            if row["pxname"] == "coordinators" and row["svname"] not in ("FRONTEND", "BACKEND")
        }

    def busiest(self) -> int:
        """The index of the server holding the most sessions now."""
        sessions = {name: int(row["scur"] or 0) for name, row in self.stats().items()}
        return int(max(sessions, key=lambda name: sessions[name])[1:])

    def stop(self) -> None:
        stop_process(self.proc, grace_s=10)
        shutil.rmtree(self.dir, ignore_errors=True)


#: The replicas of a :class:`Topology`.
REPLICAS = 3


class Topology:
    """The deployed shape: :data:`REPLICAS` coordinators on one Azurite (its data in
    ``tmp_path``) behind a :class:`Balancer`, all started; :meth:`stop` stops them."""

    def __init__(self, tmp_path: Path) -> None:
        self.azurite = Azurite(location=tmp_path / "azurite")
        env = {"AZURE_STORAGE_CONNECTION_STRING": self.azurite.connection_string}
        self.replicas = [Coordinator(["--storage", "azure"], env=env) for _ in range(REPLICAS)]
        self.balancer = Balancer([f"127.0.0.1:{r.port}" for r in self.replicas])
        try:
            assert self.azurite.start(), self.azurite.log.read_text()
            for replica in self.replicas:
                replica.start()
            self.balancer.start()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return self.balancer.url

    def status(self, job: str) -> dict[str, Any]:
        """The job's status, through the client as a user reads it: a replica whose
        breaker has yet to see storage come back (seconds after the others, behind a
        thawed Azurite) answers 503 with Retry-After, which the client waits out."""
        with ElasticClient(self.url, job, "observer") as client:
            return client.membership().model_dump(mode="json")

    def kill_busiest(self) -> int:
        """SIGKILLs the replica holding the most connections (held long-polls)."""
        busiest = self.balancer.busiest()
        self.replicas[busiest].kill()
        return busiest

    def stop(self) -> None:
        self.balancer.stop()
        for replica in self.replicas:
            replica.stop()
        self.azurite.stop()
