"""The FastAPI application factory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

from fastapi import FastAPI

import rallypoint

from . import routers
from ._checkpoints import Checkpoints
from ._driver import Driver
from ._http import BodyLimit, install_handlers
from ._rendezvous import Rendezvous
from ._store import KeyValue
from .settings import Settings
from .storage import Storage, open_storage

__all__ = ["create_app"]

# The tables and containers the coordinator opens at start-up.
TABLES = ("jobs",)
CONTAINERS = ("checkpoints",)


def create_app(settings: Settings | None = None, storage: Storage | None = None) -> FastAPI:
    """Builds the coordinator.

    Args:
        settings: Defaults to the environment (``RALLYPOINT_*``).
        storage: Defaults to the backend ``settings.storage`` names.
    """
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = storage or open_storage(settings.storage, prefix=settings.storage_prefix)
        for name in TABLES:
            store.table(name)
        for name in CONTAINERS:
            store.blobs(name)
        app.state.storage = store
        app.state.rdzv = Rendezvous(store.table("jobs"))
        app.state.driver = Driver(app.state.rdzv)
        app.state.kv = KeyValue(store.table("jobs"))
        app.state.checkpoints = Checkpoints(
            app.state.rdzv,
            store.blobs("checkpoints"),
            keep=settings.checkpoint_keep,
            timeout=timedelta(seconds=settings.checkpoint_timeout),
        )
        yield
        await app.state.driver.close()
        if storage is None:
            store.close()

    app = FastAPI(title="Rallypoint coordinator", version=rallypoint.__version__, lifespan=lifespan)
    app.state.settings = settings
    install_handlers(app)
    app.include_router(routers.health)
    app.include_router(routers.jobs)
    app.include_router(routers.checkpoints)
    app.include_router(routers.store)
    app.include_router(routers.envelope)
    app.add_middleware(BodyLimit)
    return app
