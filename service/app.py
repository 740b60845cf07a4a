"""The FastAPI application factory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from fastapi.responses import JSONResponse

import rallypoint

from .errors import StorageError
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
        yield
        if storage is None:
            store.close()

    app = FastAPI(title="Rallypoint coordinator", version=rallypoint.__version__, lifespan=lifespan)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """The process is up."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], response_model=None)
    async def readyz() -> dict[str, str] | JSONResponse:
        """Storage answers."""
        store: Storage = app.state.storage
        try:
            await anyio.to_thread.run_sync(store.ping)
        except StorageError as exc:
            return JSONResponse({"code": exc.code, "message": exc.message}, status_code=503)
        return {"status": "ready", "storage": store.describe()}

    return app
