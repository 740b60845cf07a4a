"""One APIRouter per resource."""

from .health import router as health
from .jobs import router as jobs

__all__ = ["health", "jobs"]
