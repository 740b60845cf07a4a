"""The key-value store torchrun's agents share, kept in the coordinator's table.

Stock torchrun keeps this store in a TCPStore on one trainer, so losing that trainer
loses the store. Here each generation has its own keys in a partition of their own
(``JOB~store``), one row per key, written with ETag conditions like everything else:
any coordinator replica serves any request, and a restarted one loses nothing.

Keys are scoped by generation, so a restarted round never reads the keys of the round
before; a generation's keys are collected once a generation two newer stores its first.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import quote

from .errors import AlreadyExists, InvalidRequest, Modified, NotFound
from .storage import BatchOp, Cond, Entity, Table

__all__ = ["KeyValue"]

SUFFIX = "~store"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _row(generation: int, key: str) -> str:
    # Row keys may not hold '/', '\\', '#', '?' or control characters; torch's keys do.
    return f"{generation:010d}:{quote(key, safe='')}"


def _value(e: Entity) -> bytes:
    value = e.data.get("v", b"")
    return value if isinstance(value, bytes) else b""


class KeyValue:
    """Generation-scoped keys and values of every job, over one table.

    Args:
        table: Where they live (the rendezvous table; other partitions).
    """

    def __init__(self, table: Table) -> None:
        self.table = table
        self._collected: dict[str, int] = {}
        self._lock = threading.Lock()

    def _entity(self, job_id: str, generation: int, key: str, value: bytes) -> Entity:
        return Entity(job_id + SUFFIX, _row(generation, key), {"g": generation, "v": value})

    def set(self, job_id: str, generation: int, items: Mapping[str, bytes]) -> None:
        """Sets keys; a batch is atomic (up to 100 keys, the table's batch limit)."""
        self._collect(job_id, generation)
        ops = [BatchOp("upsert", self._entity(job_id, generation, k, v)) for k, v in items.items()]
        for start in range(0, len(ops), 100):
            self.table.batch(ops[start : start + 100])

    def get(self, job_id: str, generation: int, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys``; None for a missing one."""
        partition = job_id + SUFFIX
        out: list[bytes | None] = []
        for key in keys:
            try:
                out.append(_value(self.table.get(partition, _row(generation, key))))
            except NotFound:
                out.append(None)
        return out

    def add(self, job_id: str, generation: int, key: str, amount: int) -> int:
        """Adds to a counter (a missing key counts from 0); returns the new value.

        Raises:
            InvalidRequest: The value is not an integer, or the sum leaves int64 (torch's
                stores count in 64 bits): nothing is written.
        """

        def added(now: bytes | None) -> bytes:
            try:
                total = int(now or b"0") + amount
            except ValueError:
                raise InvalidRequest(f"store key {key!r} does not hold an integer") from None
            if not _INT64_MIN <= total <= _INT64_MAX:
                raise InvalidRequest(f"adding {amount} to store key {key!r} leaves int64")
            return b"%d" % total

        return int(self._swap(job_id, generation, key, added) or b"0")

    def compare_set(
        self, job_id: str, generation: int, key: str, expected: bytes, desired: bytes
    ) -> bytes:
        """Sets ``desired`` if the value is ``expected`` (``b""``: absent), as torch's
        stores do; returns the value stored afterwards (``expected`` if it was absent and
        ``expected`` was not empty)."""

        def change(now: bytes | None) -> bytes | None:
            return desired if (now if now is not None else b"") == expected else None

        stored = self._swap(job_id, generation, key, change)
        return expected if stored is None else stored

    def _swap(
        self,
        job_id: str,
        generation: int,
        key: str,
        change: Callable[[bytes | None], bytes | None],
    ) -> bytes | None:
        """Writes ``change(value)`` (None: absent) by compare-and-swap, retrying lost
        races; ``change`` returning None writes nothing. Returns the value stored
        afterwards (None: still absent)."""
        self._collect(job_id, generation)
        partition, row = job_id + SUFFIX, _row(generation, key)
        while True:
            try:
                current: Entity | None = self.table.get(partition, row)
            except NotFound:
                current = None
            now = None if current is None else _value(current)
            new = change(now)
            if new is None:
                return now
            entity = self._entity(job_id, generation, key, new)
            try:
                if current is None:
                    self.table.insert(entity)
                else:
                    self.table.replace(entity, if_match=current.etag or "")
            except (AlreadyExists, Modified):
                continue
            return new

    def delete(self, job_id: str, generation: int, key: str) -> bool:
        """Deletes a key; whether it existed."""
        try:
            self.table.delete(job_id + SUFFIX, _row(generation, key))
        except NotFound:
            return False
        return True

    def count(self, job_id: str, generation: int) -> int:
        """How many keys the generation has."""
        where = [Cond("g", "eq", generation)]
        return sum(1 for _ in self.table.query(job_id + SUFFIX, where))

    def _collect(self, job_id: str, generation: int) -> None:
        """Deletes the keys of generations older than ``generation - 1``, once per job and
        generation in this process (another replica doing it too is harmless)."""
        with self._lock:
            if self._collected.get(job_id, 0) >= generation:
                return
            self._collected[job_id] = generation
        partition = job_id + SUFFIX
        for e in self.table.query(partition, [Cond("g", "lt", generation - 1)]):
            with contextlib.suppress(NotFound):
                self.table.delete(partition, e.row_key)
