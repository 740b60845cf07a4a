"""Starts a real Azurite (the npm package pinned in package.json) for the tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ACCOUNT = "devstoreaccount1"
# Azurite's documented, public development key.
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def connection_string(blob_port: int, table_port: int) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
        f"BlobEndpoint=http://127.0.0.1:{blob_port}/{ACCOUNT};"
        f"TableEndpoint=http://127.0.0.1:{table_port}/{ACCOUNT};"
    )


def azurite_binary() -> str:
    local = ROOT / "node_modules" / ".bin" / "azurite"
    if local.exists():
        return str(local)
    found = shutil.which("azurite")
    if found:
        return found
    raise RuntimeError("Azurite is not installed: run `npm ci` at the repository root")


@contextmanager
def running_azurite(deadline_s: float = 60) -> Iterator[str]:
    """Runs Azurite in memory on free loopback ports; yields its connection string."""
    binary = azurite_binary()
    for _attempt in range(3):  # a free port can be taken between choosing and binding it
        blob, queue, table = free_port(), free_port(), free_port()
        log_fd, log = tempfile.mkstemp(prefix="azurite-", suffix=".log")
        proc = subprocess.Popen(
            [
                binary,
                "--inMemoryPersistence",
                "--disableTelemetry",
                "--skipApiVersionCheck",
                "--loose",
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                str(blob),
                "--queueHost",
                "127.0.0.1",
                "--queuePort",
                str(queue),
                "--tableHost",
                "127.0.0.1",
                "--tablePort",
                str(table),
            ],
            stdout=log_fd,
            stderr=subprocess.STDOUT,
        )
        os.close(log_fd)
        end = time.monotonic() + deadline_s
        while proc.poll() is None and time.monotonic() < end:
            if _listening(blob) and _listening(table):
                break
            time.sleep(0.1)
        if proc.poll() is None and _listening(blob) and _listening(table):
            try:
                yield connection_string(blob, table)
            finally:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                Path(log).unlink(missing_ok=True)
            return
        proc.kill()
        proc.wait()
    raise RuntimeError(f"Azurite did not start; its log is {log}")
