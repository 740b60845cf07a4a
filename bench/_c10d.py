"""What the benches' stock torchrun anchors (its c10d rendezvous) share."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from rallypoint.cli.processes import Cluster, free_port

__all__ = ["anchor_cluster", "listening"]


def anchor_cluster(
    workdir: Path, job: str, nnodes: str, script: list[str], events: Path
) -> tuple[Cluster, int]:
    """Stock torchrun agents with their c10d rendezvous at a free port of this machine
    (the first agent hosts its store), running ``script``, whose events go to
    ``events``; the cluster and the port."""
    port = free_port()
    cluster = Cluster(
        "",
        job,
        workdir,
        nnodes=nnodes,
        script=script,
        rdzv=["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job}"],
    )
    cluster.events_file = events
    return cluster, port


def listening(port: int, limit: float) -> None:
    """Waits until the c10d store that the first agent hosts listens at ``port``, at most
    ``limit`` seconds (the others' agents fail if they start before it)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"no store listens at port {port} within {limit} s")
