"""One APIRouter per resource."""

from .checkpoints import router as checkpoints
from .health import router as health
from .jobs import router as jobs

__all__ = ["checkpoints", "health", "jobs"]
