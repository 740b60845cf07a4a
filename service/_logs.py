"""The coordinator's log configuration: uvicorn's plain lines, or one JSON object per line
(``--log-format json``) for log collectors (Azure Monitor, Loki, Elasticsearch)."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

__all__ = ["JsonFormatter", "log_config"]

# uvicorn.access passes (client, method, path, http version, status) as its arguments.
_ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and for access lines
    the request's fields; exceptions as a ``traceback`` string."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        args = record.args
        if record.name == "uvicorn.access" and isinstance(args, tuple) and len(args) == 5:
            entry.update(zip(_ACCESS_FIELDS, args, strict=True))
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def log_config(fmt: str, level: str = "INFO") -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for uvicorn and the coordinator's own loggers."""
    formatter: dict[str, Any] = (
        {"()": JsonFormatter}
        if fmt == "json"
        else {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}
    )
    handler = {"class": "logging.StreamHandler", "formatter": "main", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"main": formatter},
        "handlers": {"main": handler},
        "loggers": {
            "uvicorn": {"handlers": ["main"], "level": level, "propagate": False},
            "uvicorn.error": {"level": level},
            "uvicorn.access": {"handlers": ["main"], "level": level, "propagate": False},
            "rallypoint": {"handlers": ["main"], "level": level, "propagate": False},
        },
    }
