"""The table port: entities in partitions, ETag compare-and-swap, small batches.

Modelled on Azure Table storage, whose semantics both adapters follow exactly.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..errors import BadRequest
from ._names import MAX_BATCH_OPS, check_entity, check_key, check_property_name
from ._port import Port

__all__ = ["BatchOp", "Cond", "Entity", "Page", "PageQuery", "Table", "Value", "matches"]

#: The property types a table stores. ``int`` is stored as a 64-bit integer, ``float`` as a
#: double. ``None`` means "absent": such properties are not stored and are not read back.
Value = str | int | float | bool | bytes

Op = Literal["eq", "ne", "lt", "le", "gt", "ge"]


@dataclass(frozen=True)
class Entity:
    """One row of a table.

    Attributes:
        partition_key: The partition; queries and batches stay inside one.
        row_key: Unique within the partition.
        data: The properties. Names are identifiers of at most 255 characters.
        etag: Opaque version tag, set on every entity the table returns; pass it back to
            make a write conditional on nobody having written since.
    """

    partition_key: str
    row_key: str
    data: Mapping[str, Value | None] = field(default_factory=dict)
    etag: str | None = None


@dataclass(frozen=True)
class Cond:
    """One condition of a query filter, e.g. ``Cond("state", "eq", "alive")``.

    Conditions in a query are combined with AND. Values compare by their type: strings
    lexicographically, numbers numerically; ``bytes`` cannot be filtered on.
    """

    name: str
    op: Op
    value: str | int | float | bool


_COMPARE = {
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
}


def matches(data: Mapping[str, Value | None], where: Sequence[Cond]) -> bool:
    """Whether an entity meets every condition, with Azure's typed comparison: a
    property of another type than the value (or a missing one) never matches."""
    for cond in where:
        value = data.get(cond.name)
        if type(value) is not type(cond.value) or not _COMPARE[cond.op](value, cond.value):
            return False
    return True


@dataclass(frozen=True)
class PageQuery:
    """One checked page request of :meth:`Table.query_page`, as an adapter receives it.

    One object rather than four arguments: the adapters' hooks then take what the port
    checked as it is, and a new query option is one field, not three signatures.
    """

    partition_key: str
    where: tuple[Cond, ...]
    page_size: int
    continuation: str | None
    #: The properties to return (the conditions' among them); None: all.
    select: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Page:
    """One page of a partition query; ``continuation`` is None on the last page."""

    entities: list[Entity]
    continuation: str | None


@dataclass(frozen=True)
class BatchOp:
    """One operation of an atomic batch (see :meth:`Table.batch`).

    Attributes:
        kind: ``insert`` (fails if present), ``upsert`` (replace or create), ``replace``
            and ``delete`` (with ``if_match``: fail unless the ETag still matches; without:
            fail only if absent).
        entity: The entity; for ``delete`` only its keys are used.
        if_match: The ETag condition for ``replace`` and ``delete``.
    """

    kind: Literal["insert", "upsert", "replace", "delete"]
    entity: Entity
    if_match: str | None = None


class Table(Port):
    """A table of entities, addressed by ``(partition_key, row_key)``.

    Keys are non-empty strings of at most 1 KiB without ``/ \\ # ?`` or control
    characters; an entity holds at most 252 properties and 1 MiB, a string or bytes
    property at most 64 KiB. These are Azure's limits; every adapter checks them here,
    before any request is sent, and raises :class:`InvalidName` or :class:`LimitExceeded`.

    Adapters implement the ``_``-prefixed hooks, which receive checked arguments.
    """

    def insert(self, entity: Entity) -> Entity:
        """Creates an entity that must not exist yet.

        Returns:
            The stored entity with its ETag.

        Raises:
            AlreadyExists: An entity with these keys exists.
        """
        return self._insert(_checked(entity))

    def get(self, partition_key: str, row_key: str) -> Entity:
        """Reads one entity.

        Raises:
            NotFound: No entity has these keys.
        """
        return self._get(check_key("PartitionKey", partition_key), check_key("RowKey", row_key))

    def replace(self, entity: Entity, *, if_match: str) -> Entity:
        """Replaces an entity if its ETag is still ``if_match`` (compare-and-swap).

        Returns:
            The stored entity with its new ETag.

        Raises:
            Modified: Someone wrote the entity since ``if_match`` was read.
            NotFound: The entity does not exist (any more).
        """
        return self._replace(_checked(entity), _checked_etag(if_match))

    def upsert(self, entity: Entity) -> Entity:
        """Creates or replaces an entity unconditionally; returns it with its ETag."""
        return self._upsert(_checked(entity))

    def delete(self, partition_key: str, row_key: str, *, if_match: str | None = None) -> None:
        """Deletes an entity, if ``if_match`` is given only if its ETag still matches.

        Raises:
            NotFound: The entity does not exist.
            Modified: The ETag no longer matches.
        """
        self._delete(
            check_key("PartitionKey", partition_key),
            check_key("RowKey", row_key),
            None if if_match is None else _checked_etag(if_match),
        )

    def query_page(
        self,
        partition_key: str,
        where: Sequence[Cond] = (),
        *,
        page_size: int = 1000,
        continuation: str | None = None,
        select: Sequence[str] | None = None,
    ) -> Page:
        """Reads one page of the entities of a partition, in row-key order.

        Args:
            partition_key: The partition to read.
            where: Conditions every returned entity meets.
            page_size: At most this many entities (1..1000).
            continuation: The ``continuation`` of the previous page.
            select: The properties to read (Azure's ``$select``); an entity without one
                has it absent. None: all. Less to carry and parse where rows hold more
                than a caller reads, as beat rows with their progress do at every tick.
        """
        check_key("PartitionKey", partition_key)
        if (
            isinstance(page_size, bool)
            or not isinstance(page_size, int)
            or not (1 <= page_size <= 1000)
        ):
            raise BadRequest(f"page_size must be 1..1000, not {page_size!r}")
        for cond in where:
            check_property_name(cond.name)
            if cond.op not in ("eq", "ne", "lt", "le", "gt", "ge"):
                raise BadRequest(f"unknown filter operator {cond.op!r}")
            if not isinstance(cond.value, (str, int, float)):
                raise BadRequest(f"cannot filter on a {type(cond.value).__name__} value")
        names: tuple[str, ...] | None = None
        if select is not None:
            # The conditions' properties too: the adapters check them again on what they
            # read (Azurite compares across types where Azure does not).
            names = tuple(dict.fromkeys([*select, *(c.name for c in where)]))
            for name in names:
                check_property_name(name)
        return self._query_page(
            PageQuery(partition_key, tuple(where), page_size, continuation, names)
        )

    def query(
        self,
        partition_key: str,
        where: Sequence[Cond] = (),
        *,
        page_size: int = 1000,
        select: Sequence[str] | None = None,
    ) -> Iterator[Entity]:
        """Iterates over every matching entity of a partition, fetching page by page
        (``select``: as :meth:`query_page`'s)."""
        continuation: str | None = None
        while True:
            page = self.query_page(
                partition_key, where, page_size=page_size, continuation=continuation, select=select
            )
            yield from page.entities
            if page.continuation is None:
                return
            continuation = page.continuation

    def batch(self, ops: Sequence[BatchOp]) -> list[Entity | None]:
        """Applies up to 100 operations on one partition atomically: all or none.

        Returns:
            For each operation, the stored entity with its ETag (None for deletes).

        Raises:
            Modified, NotFound, AlreadyExists: One operation's condition failed; the
                error's ``op_index`` says which, and nothing was applied.
            BadRequest: Empty, over 100 operations, several partitions, or one row twice.
        """
        ops = list(ops)
        if not 1 <= len(ops) <= MAX_BATCH_OPS:
            raise BadRequest(f"a batch holds 1 to {MAX_BATCH_OPS} operations, not {len(ops)}")
        checked: list[BatchOp] = []
        rows: set[str] = set()
        for op in ops:
            if op.kind not in ("insert", "upsert", "replace", "delete"):
                raise BadRequest(f"unknown batch operation {op.kind!r}")
            if op.kind == "delete":
                check_key("PartitionKey", op.entity.partition_key)
                check_key("RowKey", op.entity.row_key)
            else:
                _checked(op.entity)
            if op.kind == "insert" and op.if_match is not None:
                raise BadRequest("an insert takes no if_match")
            if op.kind == "replace" and op.if_match is None:
                raise BadRequest("a replace in a batch needs if_match; use upsert otherwise")
            if op.entity.partition_key != ops[0].entity.partition_key:
                raise BadRequest("a batch must stay inside one partition")
            if op.entity.row_key in rows:
                raise BadRequest(f"row {op.entity.row_key!r} appears twice in one batch")
            rows.add(op.entity.row_key)
            checked.append(op)
        return self._batch(checked)

    # Adapter hooks: arguments are checked, errors must be the domain's.
    @abc.abstractmethod
    def _insert(self, entity: Entity) -> Entity: ...

    @abc.abstractmethod
    def _get(self, partition_key: str, row_key: str) -> Entity: ...

    @abc.abstractmethod
    def _replace(self, entity: Entity, if_match: str) -> Entity: ...

    @abc.abstractmethod
    def _upsert(self, entity: Entity) -> Entity: ...

    @abc.abstractmethod
    def _delete(self, partition_key: str, row_key: str, if_match: str | None) -> None: ...

    @abc.abstractmethod
    def _query_page(self, query: PageQuery) -> Page: ...

    @abc.abstractmethod
    def _batch(self, ops: list[BatchOp]) -> list[Entity | None]: ...


def _checked(entity: Entity) -> Entity:
    """Checks an entity and drops its None-valued ("absent") properties."""
    check_entity(entity.partition_key, entity.row_key, entity.data)
    return Entity(
        entity.partition_key,
        entity.row_key,
        {k: v for k, v in entity.data.items() if v is not None},
        entity.etag,
    )


def _checked_etag(etag: object) -> str:
    if not isinstance(etag, str) or not etag:
        raise BadRequest(f"if_match must be an ETag string, not {etag!r}")
    return etag
