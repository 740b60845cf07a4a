"""The Rallypoint coordinator: FastAPI app, domain logic and storage adapters."""

from .errors import RallypointServiceError, StorageError

__all__ = ["RallypointServiceError", "StorageError"]
