"""Rallypoint: where preempted trainers regroup.

The import package is split by role, and each part has its own install extra:

- :mod:`rallypoint.client` — ``ElasticClient`` and wire models (base install).
- :mod:`rallypoint.service` — the coordinator (``rallypoint[service]``).
- :mod:`rallypoint.trainer` — torch-side helpers (``rallypoint[trainer]``).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rallypoint")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
