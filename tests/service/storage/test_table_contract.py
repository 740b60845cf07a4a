"""The table port's contract, run unchanged against the local and the Azure adapter."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from rallypoint.service.errors import (
    AlreadyExists,
    BadRequest,
    InvalidName,
    LimitExceeded,
    Modified,
    NotFound,
)
from rallypoint.service.storage import BatchOp, Cond, Entity, Storage, Table, Value

from ..._race import one_winner


@pytest.fixture
def table(storage: Storage) -> Table:
    return storage.table("items")


ALL_TYPES = {
    "text": "héllo wörld ✓ 权重",
    "empty": "",
    "small": 7,
    "big": 2**62 + 1,
    "negative": -(2**63),
    "ratio": 0.25,
    "whole": 3.0,
    "flag": True,
    "off": False,
    "raw": bytes(range(256)),
}


def test_round_trip_keeps_every_type(table: Table) -> None:
    stored = table.insert(Entity("p", "r", {**ALL_TYPES, "absent": None}))
    assert stored.etag
    got = table.get("p", "r")
    assert got.data == ALL_TYPES
    assert {k: type(v) for k, v in got.data.items()} == {k: type(v) for k, v in ALL_TYPES.items()}
    assert got.etag == stored.etag


def test_insert_refuses_an_existing_entity(table: Table) -> None:
    table.insert(Entity("p", "r", {"v": 1}))
    with pytest.raises(AlreadyExists):
        table.insert(Entity("p", "r", {"v": 2}))
    assert table.get("p", "r").data == {"v": 1}


def test_get_missing_is_not_found(table: Table) -> None:
    with pytest.raises(NotFound):
        table.get("p", "nobody")


def test_replace_is_compare_and_swap(table: Table) -> None:
    first = table.insert(Entity("p", "r", {"v": 1}))
    second = table.replace(Entity("p", "r", {"v": 2}), if_match=first.etag or "")
    assert second.etag != first.etag
    with pytest.raises(Modified):
        table.replace(Entity("p", "r", {"v": 3}), if_match=first.etag or "")
    assert table.get("p", "r").data == {"v": 2}
    with pytest.raises(NotFound):
        table.replace(Entity("p", "ghost", {"v": 1}), if_match=first.etag or "")


def test_replace_drops_properties_it_does_not_name(table: Table) -> None:
    first = table.insert(Entity("p", "r", {"a": 1, "b": 2}))
    table.replace(Entity("p", "r", {"a": 5, "b": None}), if_match=first.etag or "")
    assert table.get("p", "r").data == {"a": 5}


def test_upsert_creates_then_replaces(table: Table) -> None:
    a = table.upsert(Entity("p", "r", {"v": 1}))
    b = table.upsert(Entity("p", "r", {"w": 2}))
    assert a.etag != b.etag
    assert table.get("p", "r").data == {"w": 2}


def test_delete_honours_etag_and_reports_missing(table: Table) -> None:
    first = table.insert(Entity("p", "r", {"v": 1}))
    table.upsert(Entity("p", "r", {"v": 2}))
    with pytest.raises(Modified):
        table.delete("p", "r", if_match=first.etag)
    table.get("p", "r")
    table.delete("p", "r", if_match=table.get("p", "r").etag)
    with pytest.raises(NotFound):
        table.get("p", "r")
    with pytest.raises(NotFound):
        table.delete("p", "r")


def test_two_writers_racing_on_one_etag_exactly_one_wins(table: Table) -> None:
    base = table.insert(Entity("p", "race", {"owner": "none"}))

    def write(i: int) -> None:
        table.replace(Entity("p", "race", {"owner": f"w{i}"}), if_match=base.etag or "")

    winner = one_winner(write, Modified)
    assert table.get("p", "race").data["owner"] == f"w{winner}"


def test_cas_counter_loses_no_increment(table: Table) -> None:
    table.insert(Entity("p", "counter", {"n": 0}))

    def bump(_: int) -> None:
        for _ in range(10):
            while True:
                current = table.get("p", "counter")
                n = int(current.data["n"] or 0)
                try:
                    table.replace(Entity("p", "counter", {"n": n + 1}), if_match=current.etag or "")
                    break
                except Modified:
                    continue

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(bump, range(4)))
    assert table.get("p", "counter").data["n"] == 40


def test_batch_applies_all(table: Table) -> None:
    old = table.insert(Entity("p", "old", {"v": 1}))
    table.insert(Entity("p", "gone", {"v": 1}))
    results = table.batch(
        [
            BatchOp("insert", Entity("p", "new", {"v": 1})),
            BatchOp("replace", Entity("p", "old", {"v": 2}), if_match=old.etag),
            BatchOp("upsert", Entity("p", "up", {"v": 3})),
            BatchOp("delete", Entity("p", "gone")),
        ]
    )
    assert results[3] is None
    assert [r.row_key for r in results[:3] if r] == ["new", "old", "up"]
    assert all(r.etag for r in results[:3] if r)
    assert {e.row_key: e.data["v"] for e in table.query("p")} == {"new": 1, "old": 2, "up": 3}
    # The returned ETags are the stored ones: they work as conditions.
    assert results[1] is not None
    table.replace(Entity("p", "old", {"v": 9}), if_match=results[1].etag or "")


@pytest.mark.parametrize(
    ("failing", "error"),
    [
        (BatchOp("insert", Entity("p", "exists", {"v": 0})), AlreadyExists),
        (BatchOp("replace", Entity("p", "exists", {"v": 0}), if_match='W/"stale"'), Modified),
        (BatchOp("delete", Entity("p", "missing")), NotFound),
    ],
)
def test_batch_is_all_or_nothing(table: Table, failing: BatchOp, error: type) -> None:
    table.insert(Entity("p", "exists", {"v": 1}))
    ops = [
        BatchOp("insert", Entity("p", "a", {"v": 1})),
        BatchOp("upsert", Entity("p", "b", {"v": 1})),
        failing,
    ]
    with pytest.raises(error) as caught:
        table.batch(ops)
    assert caught.value.op_index == 2
    assert [e.row_key for e in table.query("p")] == ["exists"]
    assert table.get("p", "exists").data == {"v": 1}


@pytest.mark.parametrize(
    "ops",
    [
        [],
        [BatchOp("upsert", Entity("p", f"r{i}")) for i in range(101)],
        [BatchOp("upsert", Entity("p", "a")), BatchOp("upsert", Entity("q", "b"))],
        [BatchOp("upsert", Entity("p", "a")), BatchOp("delete", Entity("p", "a"))],
        [BatchOp("replace", Entity("p", "a"))],
    ],
    ids=["empty", "101-ops", "two-partitions", "row-twice", "replace-without-etag"],
)
def test_malformed_batches_are_refused(table: Table, ops: list[BatchOp]) -> None:
    with pytest.raises(BadRequest):
        table.batch(ops)
    assert list(table.query("p")) == []


def test_paging_past_a_thousand_entities(table: Table) -> None:
    rows = [f"r{i:05d}" for i in range(2500)]
    for start in range(0, len(rows), 100):
        table.batch(
            [
                BatchOp("insert", Entity("p", r, {"i": int(r[1:])}))
                for r in rows[start : start + 100]
            ]
        )
    table.insert(Entity("other", "r00000", {"i": -1}))

    assert [e.row_key for e in table.query("p")] == rows

    sizes, continuation = [], None
    while True:
        page = table.query_page("p", page_size=1000, continuation=continuation)
        sizes.append(len(page.entities))
        continuation = page.continuation
        if continuation is None:
            break
    assert sizes[:2] == [1000, 1000] and sum(sizes) == 2500

    filtered = list(table.query("p", [Cond("i", "ge", 1200), Cond("i", "lt", 2300)], page_size=250))
    assert [e.data["i"] for e in filtered] == list(range(1200, 2300))


def test_filters_compare_by_type(table: Table) -> None:
    table.batch(
        [
            BatchOp(
                "insert", Entity("p", "a", {"state": "alive", "beat": 10, "load": 0.5, "ok": True})
            ),
            BatchOp(
                "insert", Entity("p", "b", {"state": "dead", "beat": 20, "load": 1.5, "ok": False})
            ),
            BatchOp("insert", Entity("p", "c", {"state": "alive", "beat": 30})),
            BatchOp("insert", Entity("p", "d", {"state": "o'brien", "beat": "40"})),
        ]
    )

    def rows(*conds: Cond) -> list[str]:
        return [e.row_key for e in table.query("p", conds)]

    assert rows(Cond("state", "eq", "alive")) == ["a", "c"]
    assert rows(Cond("state", "ne", "alive")) == ["b", "d"]
    assert rows(Cond("state", "eq", "o'brien")) == ["d"]
    assert rows(Cond("beat", "gt", 15)) == ["b", "c"]  # "40" is a string: no match
    assert rows(Cond("beat", "le", 20), Cond("state", "eq", "alive")) == ["a"]
    assert rows(Cond("load", "lt", 1.0)) == ["a"]  # c has no load: no match
    assert rows(Cond("ok", "eq", True)) == ["a"]
    assert rows(Cond("ok", "eq", False)) == ["b"]
    assert rows(Cond("beat", "eq", "40")) == ["d"]


def test_a_query_reads_the_properties_it_selects_and_its_conditions(table: Table) -> None:
    progress = "x" * 5000  # what a beat row carries beside its stamp
    table.batch(
        [
            BatchOp("insert", Entity("p", "a", {"kind": "beat", "at": 1.5, "progress": progress})),
            BatchOp("insert", Entity("p", "b", {"kind": "beat", "at": 2.5})),
            BatchOp("insert", Entity("p", "c", {"kind": "node", "at": 3.5, "progress": "y"})),
        ]
    )
    read = list(table.query("p", [Cond("kind", "eq", "beat")], select=["at", "dropped"]))
    assert [(e.row_key, e.data) for e in read] == [
        ("a", {"kind": "beat", "at": 1.5}),
        ("b", {"kind": "beat", "at": 2.5}),
    ]
    assert all(e.etag for e in read)
    (whole,) = table.query("p", [Cond("at", "lt", 2.0)])
    assert whole.data["progress"] == progress  # without select: every property
    with pytest.raises(InvalidName):
        table.query_page("p", select=["x y"])


def test_a_select_keeps_each_kind_of_value_and_may_name_none(table: Table) -> None:
    data: dict[str, Value | None] = {"s": "x", "i": 7, "f": 0.5, "t": True, "b": b"\x00\xff"}
    table.insert(Entity("p", "a", {**data, "other": "o"}))
    (one,) = table.query("p", select=["s", "i", "f", "t", "b", "absent"])
    assert one.data == data
    (alone,) = table.query("p", select=["t"])
    assert alone.data == {"t": True}
    (keys,) = table.query("p", select=[])  # the keys alone: what counting rows needs
    assert (keys.row_key, keys.data) == ("a", {})


def test_unicode_keys_round_trip(table: Table) -> None:
    table.insert(Entity("jöb-権", "nœud ✓", {"v": 1}))
    assert table.get("jöb-権", "nœud ✓").data == {"v": 1}
    assert [e.row_key for e in table.query("jöb-権")] == ["nœud ✓"]


BAD_KEYS = ["", "a/b", "a\\b", "a#b", "a?b", "a\x00b", "tab\tkey", "\x7f", "k" * 513, 5]


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_bad_keys_are_refused(table: Table, key: object) -> None:
    with pytest.raises(InvalidName):
        table.insert(Entity("p", key, {}))  # type: ignore[arg-type]
    with pytest.raises(InvalidName):
        table.get(key, "r")  # type: ignore[arg-type]
    with pytest.raises(InvalidName):
        table.upsert(Entity(key, "r", {}))  # type: ignore[arg-type]
    assert list(table.query("p")) == []


@pytest.mark.parametrize(
    "data",
    [
        {"s": "x" * (32 * 1024 + 1)},  # 64 KiB + 2 bytes in UTF-16
        {"b": b"x" * (64 * 1024 + 1)},
        {f"p{i}": b"x" * 64 * 1024 for i in range(17)},  # over 1 MiB in all
        {f"p{i}": 1 for i in range(253)},
        {"big": 2**63},
    ],
    ids=["string-64k", "bytes-64k", "entity-1m", "253-properties", "int-65-bits"],
)
def test_azure_limits_are_refused_before_sending(table: Table, data: dict) -> None:
    with pytest.raises(LimitExceeded):
        table.insert(Entity("p", "r", data))
    with pytest.raises(NotFound):
        table.get("p", "r")


def test_largest_allowed_entity_is_stored(table: Table) -> None:
    data = {f"p{i:02d}": bytes([i]) * 64 * 1024 for i in range(14)}
    data["s"] = "é" * (32 * 1024)  # exactly 64 KiB in UTF-16
    table.insert(Entity("p", "r", data))
    assert table.get("p", "r").data == data


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ({"has space": 1}, InvalidName),
        ({"1leading": 1}, InvalidName),
        ({"PartitionKey": "x"}, InvalidName),
        ({"odata_type": "x"}, InvalidName),
        ({"nan": float("nan")}, BadRequest),
        ({"list": [1, 2]}, BadRequest),
    ],
    ids=["space", "digit-first", "reserved", "odata", "nan", "list"],
)
def test_bad_properties_are_refused(table: Table, data: dict, error: type) -> None:
    with pytest.raises(error):
        table.upsert(Entity("p", "r", data))
    with pytest.raises(NotFound):
        table.get("p", "r")


def test_bad_queries_are_refused(table: Table) -> None:
    with pytest.raises(BadRequest):
        table.query_page("p", page_size=0)
    with pytest.raises(BadRequest):
        table.query_page("p", page_size=1001)
    with pytest.raises(BadRequest):
        table.query_page("p", [Cond("x", "like", 1)])  # type: ignore[arg-type]
    with pytest.raises(InvalidName):
        table.query_page("p", [Cond("x y", "eq", 1)])
    with pytest.raises(BadRequest):
        table.query_page("p", continuation="%%%not-a-token")
