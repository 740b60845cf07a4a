"""Starts a real Azurite (the npm package pinned in package.json) for the tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rallypoint.cli.processes import free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent
ACCOUNT = "devstoreaccount1"
# Azurite's documented, public development key.
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


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


class Azurite:
    """One Azurite on free loopback ports, which a test may freeze (SIGSTOP: connections
    open, nothing answers), kill, and start again on the same ports: with ``location``
    it keeps its data there (``--location``), else in memory."""

    def __init__(self, location: Path | None = None) -> None:
        self.location = location
        self.blob, self.queue, self.table = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        fd, log = tempfile.mkstemp(prefix="azurite-", suffix=".log")
        os.close(fd)
        self.log = Path(log)

    @property
    def connection_string(self) -> str:
        return connection_string(self.blob, self.table)

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self, deadline_s: float = 60) -> bool:
        """Starts it; whether it listens within ``deadline_s`` (else it is killed)."""
        persistence = (
            ["--location", str(self.location)]
            if self.location is not None
            else ["--inMemoryPersistence"]
        )
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    azurite_binary(),
                    *persistence,
                    "--disableTelemetry",
                    "--skipApiVersionCheck",
                    "--loose",
                    "--blobHost",
                    "127.0.0.1",
                    "--blobPort",
                    str(self.blob),
                    "--queueHost",
                    "127.0.0.1",
                    "--queuePort",
                    str(self.queue),
                    "--tableHost",
                    "127.0.0.1",
                    "--tablePort",
                    str(self.table),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        end = time.monotonic() + deadline_s
        while self.proc.poll() is None and time.monotonic() < end:
            if _listening(self.blob) and _listening(self.table):
                return True
            time.sleep(0.1)
        self.kill()
        return False

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """Frozen (:meth:`freeze`) while the block runs, as an account that hangs; thawed
        after it, however it ends."""
        self.freeze()
        try:
            yield
        finally:
            self.thaw()

    def kill(self) -> None:
        """SIGKILL, as a crash (what it persisted survives)."""
        if self.proc is not None and self.proc.poll() is None:
            self.thaw()
            self.proc.kill()
            self.proc.wait()

    def terminate(self) -> None:
        """SIGTERM: it saves what it holds (its ``--location`` storage saves every few
        seconds otherwise, so a SIGKILL also loses the last seconds' writes, which
        Azure itself never does)."""
        if self.proc is not None and self.proc.poll() is None:
            self.thaw()  # a stopped process would not see the SIGTERM
            stop_process(self.proc, grace_s=10)

    def stop(self) -> None:
        self.terminate()
        self.log.unlink(missing_ok=True)


@contextmanager
def running_azurite(deadline_s: float = 60) -> Iterator[str]:
    """Runs Azurite in memory on free loopback ports; yields its connection string."""
    for _attempt in range(3):  # a free port can be taken between choosing and binding it
        azurite = Azurite()
        if azurite.start(deadline_s):
            try:
                yield azurite.connection_string
            finally:
                azurite.stop()
            return
    raise RuntimeError(f"Azurite did not start; its log is {azurite.log}")
