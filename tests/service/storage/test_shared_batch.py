"""Shared transactions: each caller's batch keeps its all-or-none and its conditions, on
both backends, while concurrent callers share round trips."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from rallypoint.service.errors import AlreadyExists, BadRequest, Modified
from rallypoint.service.storage import BatchOp, Entity, SharedBatches, Storage, Table


@pytest.fixture
def table(storage: Storage) -> Table:
    return storage.table("items")


class Gate(Table):
    """The real table, with every transaction counted, and the first one held until the
    test opens the gate (so that others queue behind it, as under load)."""

    def __init__(self, table: Table) -> None:
        self.inner, self.name = table, table.name
        self.batches: list[int] = []
        self.entered, self.open = threading.Event(), threading.Event()

    def batch(self, ops):  # type: ignore[no-untyped-def]
        self.entered.set()
        self.open.wait(30)
        self.batches.append(len(ops))
        return self.inner.batch(ops)

    # the port's other hooks are not used by SharedBatches
    _insert = _get = _replace = _upsert = _delete = _query_page = _batch = ping = None  # type: ignore[assignment]


def pair(key: str, value: int) -> list[BatchOp]:
    return [
        BatchOp("upsert", Entity("p", f"node:{key}", {"v": value})),
        BatchOp("upsert", Entity("p", f"beat:{key}", {"v": value})),
    ]


def test_concurrent_batches_share_transactions_and_each_gets_its_own_results(
    table: Table,
) -> None:
    gate = Gate(table)
    shared = SharedBatches(gate)
    with ThreadPoolExecutor(121) as pool:
        first = pool.submit(shared.batch, pair("first", 0))
        assert gate.entered.wait(30)
        rest = [pool.submit(shared.batch, pair(f"n{i}", i)) for i in range(120)]
        while len(shared._partitions["p"].pending) < 120:  # all queued behind the first
            threading.Event().wait(0.01)
        gate.open.set()
        results = [first.result(), *(f.result() for f in rest)]
    # 121 callers, 242 operations: the first alone, then the 120 queued in three.
    assert gate.batches == [2, 100, 100, 40]
    for i, (node, beat) in enumerate(results[1:]):
        assert node is not None and beat is not None
        assert node.row_key == f"node:n{i}" and node.data["v"] == i and node.etag
        assert table.get("p", f"beat:n{i}").etag == beat.etag


def test_a_failed_condition_fails_its_caller_alone_and_applies_none_of_its_batch(
    table: Table,
) -> None:
    taken = table.insert(Entity("p", "node:taken", {"v": 0}))
    gate = Gate(table)
    shared = SharedBatches(gate)
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(shared.batch, pair("first", 0))
        assert gate.entered.wait(30)
        clash = pool.submit(
            shared.batch,
            [
                BatchOp("upsert", Entity("p", "beat:clash", {"v": 1})),
                BatchOp("insert", Entity("p", "node:taken", {"v": 1})),
            ],
        )
        stale = pool.submit(
            shared.batch,
            [BatchOp("replace", Entity("p", "node:taken", {"v": 2}), if_match='W/"old"')],
        )
        fine = [pool.submit(shared.batch, pair(f"n{i}", i)) for i in range(5)]
        while len(shared._partitions["p"].pending) < 7:
            threading.Event().wait(0.01)
        gate.open.set()
        first.result()
        with pytest.raises(AlreadyExists) as exists:
            clash.result()
        with pytest.raises(Modified) as modified:
            stale.result()
        assert [f.result()[0].data["v"] for f in fine] == list(range(5))  # type: ignore[union-attr]
    assert exists.value.op_index == 1 and modified.value.op_index == 0  # within each caller's
    assert table.get("p", "node:taken").etag == taken.etag
    assert Counter(e.row_key for e in table.query("p")) == Counter(
        ["node:taken", "node:first", "beat:first"]
        + [f"{kind}:n{i}" for i in range(5) for kind in ("node", "beat")]
    )  # nothing of the clashing caller's batch, beat:clash included


def test_a_bad_batch_is_refused_as_table_batch_refuses_it(table: Table) -> None:
    shared = SharedBatches(table)
    with pytest.raises(BadRequest):
        shared.batch([BatchOp("upsert", Entity("p", f"r{i}", {})) for i in range(101)])
    assert shared.batch(pair("after", 1))[0] is not None
