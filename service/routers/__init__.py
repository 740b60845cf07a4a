"""One APIRouter per resource."""

from .checkpoints import router as checkpoints
from .envelope import router as envelope
from .health import probe
from .health import router as health
from .jobs import router as jobs
from .metrics import router as metrics
from .pages import router as pages
from .store import router as store
from .tokens import router as tokens

__all__ = [
    "checkpoints",
    "envelope",
    "health",
    "jobs",
    "metrics",
    "pages",
    "probe",
    "store",
    "tokens",
]
