"""The Rallypoint client: what a trainer links against (httpx and pydantic, never torch)."""

from .errors import RallypointError, SignedUrlError

__all__ = ["RallypointError", "SignedUrlError"]
