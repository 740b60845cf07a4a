"""Small batches of many callers sent as one table transaction.

A thousand nodes joining at once each write two rows (a registration and a first beat):
a thousand transactions, each a storage round trip and, through the Azure SDK, about
2.5 ms of the coordinator's CPU (docs/SCALE.md). :class:`SharedBatches` sends the batches
of concurrent callers on one partition as one transaction of up to 100 operations, the
way a database commits a group of transactions with one write.

Each caller's batch keeps its meaning: all of its operations apply or none do, and its
conditions (ETags, insert-only) hold. A transaction fails whole when one operation's
condition fails; the caller that owns it gets the error and the others go again without
it. No caller waits for a timer: whoever finds the partition idle sends what is queued
at once, and batches that arrive meanwhile go in the next transaction.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from ..errors import AlreadyExists, Modified, NotFound
from ._names import MAX_BATCH_OPS
from ._table import BatchOp, Entity, Table

__all__ = ["SharedBatches"]


class _Request:
    def __init__(self, ops: list[BatchOp]) -> None:
        self.ops = ops
        self.rows = {op.entity.row_key for op in ops}
        self.done = False
        self.result: list[Entity | None] = []
        self.error: BaseException | None = None


class _Partition:
    def __init__(self) -> None:
        self.mutex = threading.Lock()  # guards pending
        self.sender = threading.Lock()  # one transaction in flight per partition
        self.pending: list[_Request] = []


class SharedBatches:
    """:meth:`Table.batch` for many threads, sharing transactions (module docstring).

    Args:
        table: The table the transactions go to.
    """

    def __init__(self, table: Table) -> None:
        self.table = table
        self._partitions: defaultdict[str, _Partition] = defaultdict(_Partition)
        self._lock = threading.Lock()

    def batch(self, ops: list[BatchOp]) -> list[Entity | None]:
        """Like :meth:`Table.batch` (one partition, all or none), in a transaction that
        may carry other callers' batches too.

        Raises:
            Modified, NotFound, AlreadyExists: One of ``ops``' conditions failed; its
                ``op_index`` counts within ``ops``. Nothing of ``ops`` was applied.
            StorageError: The transaction failed for another reason.
        """
        request = _Request(list(ops))
        with self._lock:
            partition = self._partitions[request.ops[0].entity.partition_key]
        with partition.mutex:
            partition.pending.append(request)
        while not request.done:
            with partition.sender:
                if request.done:
                    break
                with partition.mutex:
                    group = _take(partition.pending)
                self._send(group)
        if request.error is not None:
            raise request.error
        return request.result

    def _send(self, group: list[_Request]) -> None:
        """Sends ``group`` as one transaction; a request whose condition fails leaves
        the group with its error, and the rest are sent again."""
        while group:
            ops = [op for request in group for op in request.ops]
            try:
                results = self.table.batch(ops)
            except (Modified, NotFound, AlreadyExists) as exc:
                located = _owner(group, exc.op_index)
                if located is None:  # no index to blame: each goes alone
                    if len(group) > 1:
                        for request in group:
                            self._send([request])
                        return
                    located = group[0], 0
                culprit, offset = located
                culprit.error = type(exc)(
                    str(exc),
                    op_index=None if exc.op_index is None else exc.op_index - offset,
                )
                culprit.done = True
                group.remove(culprit)
                continue
            except Exception as exc:  # storage down, or a bad batch: all of them fail
                for request in group:
                    request.error, request.done = exc, True
                return
            start = 0
            for request in group:
                request.result = results[start : start + len(request.ops)]
                request.done = True
                start += len(request.ops)
            return


def _take(pending: list[_Request]) -> list[_Request]:
    """Removes from ``pending`` the requests, oldest first, that fit one transaction:
    at most :data:`MAX_BATCH_OPS` operations, no row twice."""
    group: list[_Request] = []
    rows: set[str] = set()
    count = 0
    for request in list(pending):
        if group and count + len(request.ops) > MAX_BATCH_OPS:
            break  # (a request too big on its own goes alone, and Table.batch refuses it)
        if rows & request.rows:
            continue  # the same row twice: the next transaction takes it
        group.append(request)
        rows |= request.rows
        count += len(request.ops)
        pending.remove(request)
    return group


def _owner(group: list[_Request], op_index: int | None) -> tuple[_Request, int] | None:
    """The request whose operation is ``op_index`` of the group's transaction, and where
    its operations start in it."""
    if op_index is None:
        return None
    start = 0
    for request in group:
        if op_index < start + len(request.ops):
            return request, start
        start += len(request.ops)
    return None
