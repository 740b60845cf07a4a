"""The embedded table adapter: one SQLite database in WAL mode.

Several coordinator processes may share the file: every write is one ``BEGIN IMMEDIATE``
transaction, so ETag checks and batches are atomic across processes too.
"""

from __future__ import annotations

import base64
import contextlib
import json
import secrets
import sqlite3
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from ..errors import AlreadyExists, Modified, NotFound, StorageUnavailable
from ._continuation import continuation_cursor, continuation_token
from ._table import BatchOp, Entity, Page, PageQuery, Table, Value

__all__ = ["LocalTable"]

_T = TypeVar("_T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entities (
    tbl TEXT NOT NULL, pk TEXT NOT NULL, rk TEXT NOT NULL, etag TEXT NOT NULL, data TEXT NOT NULL,
    PRIMARY KEY (tbl, pk, rk)
) WITHOUT ROWID
"""
_SQL_OPS = {"eq": "=", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
# Azure matches a condition only against a property of the same type; SQLite would
# happily compare an integer with a string, so the JSON type is checked too.
_JSON_TYPES = {str: "('text')", bool: "('true','false')", int: "('integer')", float: "('real')"}


def _encode(data: Mapping[str, Value | None]) -> str:
    return json.dumps(
        {
            k: {"$b": base64.b64encode(bytes(v)).decode()}
            if isinstance(v, (bytes, bytearray, memoryview))
            else v
            for k, v in data.items()
        },
        separators=(",", ":"),
        ensure_ascii=False,
    )


def _value(stored: object) -> Value | None:
    """A property as :func:`_encode` stored it (bytes as ``{"$b": base64}``)."""
    return base64.b64decode(stored["$b"]) if isinstance(stored, dict) else stored  # type: ignore[return-value]


def _decode(text: str) -> dict[str, Value | None]:
    return {k: _value(v) for k, v in json.loads(text).items()}


def _picked(names: tuple[str, ...], text: str) -> dict[str, Value | None]:
    """The properties a select named, from json_extract's array of them (null: absent;
    a table stores no nulls)."""
    values = json.loads(text)
    return {
        k: _value(v)
        for k, v in zip(names, values, strict=False)  # padded: two values at least
        if v is not None
    }


class _Request:
    """One caller's write, applied by whichever thread leads its group."""

    def __init__(self, apply: Callable[[sqlite3.Connection], object]) -> None:
        self.apply = apply
        self.done = False
        self.result: object = None
        self.error: BaseException | None = None


class _Group:
    """Group commit for one database file, shared by every LocalTable of the process.

    Writers queue their requests; one leader applies every queued request in a single
    transaction, each inside a SAVEPOINT so that one request's failed condition rolls
    back only that request, and commits once: one fsync for the group instead of one
    per write. A caller returns only after the commit holding its write.
    """

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.leader = threading.Lock()
        self.pending: list[_Request] = []


_GROUPS: defaultdict[Path, _Group] = defaultdict(_Group)


def _new_etag() -> str:
    return f'W/"{secrets.token_hex(8)}"'


class LocalTable(Table):
    """See base class. Stored in ``PATH/tables.sqlite3``, one row per entity."""

    def __init__(self, db_path: Path, name: str) -> None:
        self.name = name
        self._path = db_path
        self._local = threading.local()
        with self._write() as db:
            db.execute(_SCHEMA)

    def _db(self) -> sqlite3.Connection:
        # One connection per thread: sqlite3 connections must not cross threads.
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            try:
                db = sqlite3.connect(self._path, timeout=30, isolation_level=None)
                db.execute("PRAGMA journal_mode=WAL")
                # FULL: a generation the coordinator acknowledged must survive power loss.
                db.execute("PRAGMA synchronous=FULL")
            except sqlite3.Error as exc:
                raise StorageUnavailable(f"cannot open {self._path}: {exc}") from exc
            self._local.db = db
        return db

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, outside group commit (schema changes)."""
        db = self._db()
        with _GROUPS[self._path].leader:
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StorageUnavailable(f"cannot write {self._path}: {exc}") from exc
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            try:
                db.execute("COMMIT")
            except sqlite3.Error as exc:
                raise StorageUnavailable(f"cannot commit to {self._path}: {exc}") from exc

    def _transact(self, apply: Callable[[sqlite3.Connection], _T]) -> _T:
        """Runs ``apply`` atomically in a group-committed transaction; returns its result
        or raises its error once the group's commit is durable."""
        group = _GROUPS[self._path]
        request = _Request(apply)
        with group.mutex:
            group.pending.append(request)
        # Writers of this process queue on a Python lock: SQLite's own busy handler
        # makes a waiting writer sleep with growing backoff (up to 100 ms). Other
        # processes still wait on busy_timeout.
        with group.leader:
            if not request.done:  # nobody committed it yet: lead a group
                with group.mutex:
                    batch, group.pending = group.pending, []
                self._commit(batch)
        if request.error is not None:
            raise request.error
        return request.result  # type: ignore[return-value]

    def _commit(self, batch: list[_Request]) -> None:
        db = self._db()
        try:
            db.execute("BEGIN IMMEDIATE")
            for request in batch:
                db.execute("SAVEPOINT request")
                try:
                    request.result = request.apply(db)
                except Exception as exc:  # the request's own failure, e.g. Modified
                    db.execute("ROLLBACK TO request")
                    request.error = exc
                db.execute("RELEASE request")
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            failure = StorageUnavailable(f"cannot write {self._path}: {exc}")
            for request in batch:
                request.result, request.error = None, failure
        finally:
            for request in batch:
                request.done = True

    def _etag_of(self, db: sqlite3.Connection, pk: str, rk: str) -> str | None:
        row = db.execute(
            "SELECT etag FROM entities WHERE tbl=? AND pk=? AND rk=?", (self.name, pk, rk)
        ).fetchone()
        return None if row is None else str(row[0])

    def _apply(self, db: sqlite3.Connection, op: BatchOp, index: int | None) -> Entity | None:
        """Applies one operation inside an open write transaction."""
        pk, rk = op.entity.partition_key, op.entity.row_key
        current = self._etag_of(db, pk, rk)
        where = f"{pk!r}/{rk!r}"
        if op.kind == "insert" and current is not None:
            raise AlreadyExists(f"entity {where} exists", op_index=index)
        if op.kind in ("replace", "delete"):
            if current is None:
                raise NotFound(f"entity {where} does not exist", op_index=index)
            if op.if_match is not None and op.if_match != current:
                raise Modified(f"entity {where} changed since it was read", op_index=index)
        if op.kind == "delete":
            db.execute("DELETE FROM entities WHERE tbl=? AND pk=? AND rk=?", (self.name, pk, rk))
            return None
        etag = _new_etag()
        db.execute(
            "INSERT OR REPLACE INTO entities (tbl, pk, rk, etag, data) VALUES (?,?,?,?,?)",
            (self.name, pk, rk, etag, _encode(op.entity.data)),
        )
        return Entity(pk, rk, dict(op.entity.data), etag)

    def _one(self, op: BatchOp) -> Entity | None:
        return self._transact(lambda db: self._apply(db, op, None))

    def _insert(self, entity: Entity) -> Entity:
        result = self._one(BatchOp("insert", entity))
        assert result is not None
        return result

    def _replace(self, entity: Entity, if_match: str) -> Entity:
        result = self._one(BatchOp("replace", entity, if_match))
        assert result is not None
        return result

    def _upsert(self, entity: Entity) -> Entity:
        result = self._one(BatchOp("upsert", entity))
        assert result is not None
        return result

    def _delete(self, partition_key: str, row_key: str, if_match: str | None) -> None:
        self._one(BatchOp("delete", Entity(partition_key, row_key), if_match))

    def _batch(self, ops: list[BatchOp]) -> list[Entity | None]:
        return self._transact(lambda db: [self._apply(db, op, i) for i, op in enumerate(ops)])

    def _get(self, partition_key: str, row_key: str) -> Entity:
        try:
            row = (
                self._db()
                .execute(
                    "SELECT etag, data FROM entities WHERE tbl=? AND pk=? AND rk=?",
                    (self.name, partition_key, row_key),
                )
                .fetchone()
            )
        except sqlite3.Error as exc:
            raise StorageUnavailable(f"table {self.name}: {exc}") from exc
        if row is None:
            raise NotFound(f"entity {partition_key!r}/{row_key!r} does not exist")
        return Entity(partition_key, row_key, _decode(row[1]), row[0])

    def _query_page(self, request: PageQuery) -> Page:
        partition_key, page_size = request.partition_key, request.page_size
        chosen = request.select
        # With a select, SQLite takes the named properties out as one JSON array (two
        # paths at least, for json_extract to answer an array): a row's other properties
        # are never parsed, as Azure's $select never sends them.
        paths = [f'$."{name}"' for name in chosen or ()]
        picked = ", ".join("?" * max(2, len(paths)))
        column = "data" if chosen is None else f"json_extract(data, {picked})"
        sql = f"SELECT rk, etag, {column} FROM entities WHERE tbl=? AND pk=?"
        # The select's paths first, as they come first in the statement; padded with a
        # name no property has (names are identifiers: no "-").
        args: list[object] = []
        if chosen is not None:
            args += [*paths, '$."-"', '$."-"'][: max(2, len(paths))]
        args += [self.name, partition_key]
        if request.continuation is not None:
            sql += " AND rk > ?"
            args.append(continuation_cursor(request.continuation))
        for cond in request.where:
            path = f'$."{cond.name}"'
            sql += (
                f" AND json_type(data, ?) IN {_JSON_TYPES[type(cond.value)]}"
                f" AND json_extract(data, ?) {_SQL_OPS[cond.op]} ?"
            )
            args += [path, path, cond.value]
        sql += " ORDER BY rk LIMIT ?"
        args.append(page_size + 1)  # one more tells whether another page follows
        try:
            rows = self._db().execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise StorageUnavailable(f"table {self.name}: {exc}") from exc
        entities = (
            [Entity(partition_key, rk, _decode(data), etag) for rk, etag, data in rows]
            if chosen is None
            else [Entity(partition_key, rk, _picked(chosen, data), etag) for rk, etag, data in rows]
        )
        if len(entities) <= page_size:
            return Page(entities, None)
        entities = entities[:page_size]
        return Page(entities, continuation_token(entities[-1].row_key))

    def ping(self) -> None:
        try:
            self._db().execute("SELECT 1 FROM entities LIMIT 1").fetchall()
        except sqlite3.Error as exc:
            raise StorageUnavailable(f"table {self.name}: {exc}") from exc

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None
