"""The FastAPI application factory."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import TYPE_CHECKING

import anyio.from_thread
from fastapi import FastAPI

import rallypoint
from rallypoint.client.models import JobStatus

from . import _contract, _process, routers
from ._checkpoints import Checkpoints
from ._driver import Driver
from ._fastpath import HeartbeatFastPath
from ._http import BodyLimit, install_handlers
from ._metrics import Metrics
from ._rendezvous import Rendezvous
from ._store import KeyValue
from ._tokens import Tokens
from ._views import Views
from .errors import UnknownJob
from .settings import Settings
from .storage import Storage, open_storage

if TYPE_CHECKING:
    import uvicorn

__all__ = ["create_app", "serve", "server"]

# The tables and containers the coordinator opens at start-up.
TABLES = ("jobs",)
CONTAINERS = ("checkpoints",)


def create_app(
    settings: Settings | None = None, storage: Storage | None = None, *, fast_path: bool = True
) -> FastAPI:
    """Builds the coordinator.

    Args:
        settings: Defaults to the environment (``RALLYPOINT_*``).
        storage: Defaults to the backend ``settings.storage`` names.
        fast_path: Answer well-formed heartbeats before routing (see ``_fastpath``); the
            answers are the route's either way, only cheaper.
    """
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        backend = storage or open_storage(settings.storage, prefix=settings.storage_prefix)
        for name in TABLES:
            backend.table(name)
        for name in CONTAINERS:
            backend.blobs(name)
        app.state.storage = backend
        losses = (settings.node_losses, settings.node_loss_window) if settings.node_losses else None
        app.state.rdzv = Rendezvous(
            backend.table("jobs"),
            on_miss=metrics.generation_missed,
            node_losses=losses,
            hang_window=settings.hang_window,
        )
        app.state.kv = KeyValue(backend.table("jobs"))
        app.state.tokens = Tokens(backend.table("jobs"), settings.token)
        app.state.checkpoints = Checkpoints(
            app.state.rdzv,
            backend.blobs("checkpoints"),
            keep=settings.checkpoint_keep,
            timeout=timedelta(seconds=settings.checkpoint_timeout),
            write_ttl=timedelta(seconds=settings.write_url_ttl),
            read_ttl=timedelta(seconds=settings.read_url_ttl),
            on_commit=metrics.committed,
            on_restore=metrics.restored,
        )
        app.state.views = Views(app.state.rdzv, app.state.checkpoints)
        app.state.driver = Driver(
            app.state.rdzv,
            reconnect=settings.heartbeat_reconnect,
            grace=settings.storage_grace,
            on_change=app.state.views.touched,
        )
        prober = asyncio.create_task(routers.probe(backend), name="storage-probe")
        yield
        prober.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await prober
        await app.state.driver.close()
        await app.state.views.close()
        if storage is None:
            backend.close()

    def job_states() -> list[JobStatus]:
        # Called at a scrape, in a worker thread: each job's status is a glance at the
        # views (the one a viewer keeps fresh, or one read shared with any under way).
        rdzv: Rendezvous = app.state.rdzv
        views: Views = app.state.views
        states = []
        for job in rdzv.list_jobs():
            with contextlib.suppress(UnknownJob):  # deleted since it was listed
                glance = functools.partial(views.status, job.job_id, watch=False)
                states.append(anyio.from_thread.run(glance))
        return states

    def versions(job_id: str) -> dict[str, int]:
        checkpoints: Checkpoints = app.state.checkpoints
        return checkpoints.durabilities(job_id)

    metrics = Metrics(job_states, versions)
    app = FastAPI(title="Rallypoint coordinator", version=rallypoint.__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    install_handlers(app)
    _contract.install(app)
    app.include_router(routers.health)
    app.include_router(routers.jobs)
    app.include_router(routers.checkpoints)
    app.include_router(routers.store)
    app.include_router(routers.tokens)
    app.include_router(routers.envelope)
    app.include_router(routers.metrics)
    app.include_router(routers.pages)
    if fast_path:
        app.add_middleware(HeartbeatFastPath)
    app.add_middleware(BodyLimit)
    app.add_middleware(metrics.middleware)
    return app


def server(
    settings: Settings, storage: Storage | None = None, *, own_process: bool = True
) -> uvicorn.Server:
    """The coordinator under uvicorn, as ``rallypoint serve`` runs it (:func:`serve`);
    tests and embedders run it in a thread of their own (``run(sockets=[...])``).

    On shutdown it stops accepting connections and answers every held long-poll at once
    (heartbeat watches, joins, store waits), so callers move to another replica or retry,
    rather than waiting out their hold or losing the connection.

    Args:
        settings: Its address, logging and the app's settings.
        storage: As :func:`create_app`'s (one given is left open).
        own_process: The server owns its process: it sets up logging as
            ``settings.log_format`` says and, once started, applies the coordinator's
            process-wide settings (``_process.tune``). False leaves the logging and the
            process of the program that runs it as they are.
    """
    import uvicorn

    from ._logs import log_config

    app = create_app(settings, storage)

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if own_process:
                _process.tune()  # the process-wide settings, now that the app exists

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # uvicorn drains in-flight requests before the lifespan's shutdown: without
            # this, a held heartbeat would keep it waiting for its whole hold.
            driver: Driver | None = getattr(app.state, "driver", None)
            if driver is not None:
                await driver.close()
            await super().shutdown(sockets)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=log_config(settings.log_format) if own_process else None,
        access_log=settings.access_log,
        timeout_graceful_shutdown=10,
    )
    return Server(config)


def serve(settings: Settings) -> None:
    """Runs the coordinator (:func:`server`) until SIGTERM or SIGINT."""
    server(settings).run()
