"""Per-job secrets kept in the job's table partition, made by the first replica that
needs one and shared by all (so any replica verifies what another issued).

Rows: ``peerkey`` (the Ed25519 key that signs peer grants) and ``nodekey`` (the HMAC key
node credentials are derived from). Whoever can read the table can read them, as it can
rewrite every other row: they guard the API, not the storage account.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable

from .errors import AlreadyExists, NotFound
from .storage import Entity, Table

__all__ = ["JobSecrets"]


class JobSecrets:
    """Get-or-create of a job's secret rows, cached (a secret never changes once made).

    Args:
        table: The rendezvous table (the job's partition).
    """

    def __init__(self, table: Table) -> None:
        self.table = table
        self._cache: dict[tuple[str, str], bytes] = {}
        self._lock = threading.Lock()

    def get(self, job_id: str, row: str, make: Callable[[], bytes]) -> bytes:
        """The job's secret ``row``, created with ``make()`` if no replica made it yet."""
        key = (job_id, row)
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None:
            return cached
        try:
            entity = self.table.get(job_id, row)
        except NotFound:
            fresh = base64.b64encode(make()).decode()
            try:
                entity = self.table.insert(Entity(job_id, row, {"kind": row, "private": fresh}))
            except AlreadyExists:  # another replica made it first: use that one
                entity = self.table.get(job_id, row)
        secret = base64.b64decode(str(entity.data["private"]))
        with self._lock:
            self._cache[key] = secret
        return secret
