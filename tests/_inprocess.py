"""A coordinator in the test's own process: the server ``rallypoint serve`` runs
(:func:`rallypoint.service.app.server`, settings from :func:`rallypoint.cli.serve_settings`),
on a loopback port, in a thread.

Clients, ``httpx`` calls and even other processes reach it by URL exactly as they reach a
``rallypoint serve`` process, so an API test moves between the two by fixture alone. It
takes the same flags, but not what only a process has: a SIGKILL and a restart, a log,
``serve``'s logging set-up and process-wide tuning (the GIL switch interval, a frozen
collector; it does take the table batch path). Tests of those use ``spawn`` (conftest).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from rallypoint.cli import serve_settings
from rallypoint.service.app import server
from rallypoint.service.storage import Storage, open_storage, use_batch_path

__all__ = ["InProcessCoordinator"]


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """``env`` added to this process's environment while settings and storage are read
    (what a spawned coordinator's environment gives it), then taken away again."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class InProcessCoordinator:
    """The coordinator of ``rallypoint serve ARGS`` with ``ENV``, served from a thread.

    Args:
        args: ``rallypoint serve`` flags, e.g. ``["--storage", "local:/tmp/s"]``.
        env: Variables the settings and the storage read (``RALLYPOINT_*``, ``AZURE_*``).
    """

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.args = args
        self.env = env or {}
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = int(self._sock.getsockname()[1])
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._storage: Storage | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage(self) -> Storage:
        """The storage it serves from, once started (its tables are the app's own)."""
        assert self._storage is not None, "not started"
        return self._storage

    def start(self, deadline_s: float = 30) -> InProcessCoordinator:
        with _environ(self.env):
            settings = serve_settings(self.args)
            self._storage = open_storage(settings.storage, prefix=settings.storage_prefix)
        if settings.storage == "azure":
            use_batch_path()  # the table transactions' path `rallypoint serve` takes
        # The test process's logging and global state stay as pytest set them.
        self._server = server(settings, self._storage, own_process=False)
        self._thread = threading.Thread(
            target=self._server.run,
            args=([self._sock],),
            name=f"coordinator-{self.port}",
            daemon=True,  # one a test failed to stop does not hold pytest's exit
        )
        self._thread.start()
        end = time.monotonic() + deadline_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"the in-process coordinator on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(30)
        if self._storage is not None:
            self._storage.close()  # create_app leaves a storage it was given open
            self._storage = None
        self._sock.close()
