"""The Azure Table storage adapter (azure-data-tables); also runs against Azurite."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from azure.core import MatchConditions
from azure.data.tables import EdmType, EntityProperty, TableClient, UpdateMode

from ..errors import BadRequest
from ._azure_errors import storage_errors
from ._continuation import continuation_cursor, continuation_token
from ._table import BatchOp, Entity, Page, PageQuery, Table, Value, matches

__all__ = ["AzureTable"]

_SYSTEM = {"PartitionKey", "RowKey", "Timestamp"}


def _to_azure(entity: Entity) -> dict[str, Any]:
    out: dict[str, Any] = {"PartitionKey": entity.partition_key, "RowKey": entity.row_key}
    for name, value in entity.data.items():
        # Every int is an Int64: the SDK would store small ones as Int32 and refuse others.
        if isinstance(value, int) and not isinstance(value, bool):
            out[name] = EntityProperty(value, EdmType.INT64)
        elif isinstance(value, (bytearray, memoryview)):
            out[name] = bytes(value)
        else:
            out[name] = value
    return out


def _from_azure(raw: Mapping[str, Any], etag: str) -> Entity:
    data: dict[str, Value | None] = {}
    for name, value in raw.items():
        # A table stores no nulls: a null is a $select's property the entity lacks.
        if name in _SYSTEM or value is None:
            continue
        data[name] = value.value if isinstance(value, EntityProperty) else value
    return Entity(raw["PartitionKey"], raw["RowKey"], data, etag)


def _literal(value: str | int | float | bool) -> str:
    """An OData literal of the same Edm type that :func:`_to_azure` stores."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value}L"
    if isinstance(value, float):
        text = repr(value)
        return text if any(c in text for c in ".eE") else text + ".0"
    return "'" + value.replace("'", "''") + "'"


def _etag_condition(if_match: str | None) -> dict[str, Any]:
    if if_match is None:
        return {}
    return {"etag": if_match, "match_condition": MatchConditions.IfNotModified}


def _operation(op: BatchOp) -> tuple[Any, ...]:
    """One operation in the form ``TableClient.submit_transaction`` takes."""
    entity = _to_azure(op.entity)
    if op.kind == "insert":
        return ("create", entity)
    if op.kind == "upsert":
        return ("upsert", entity, {"mode": UpdateMode.REPLACE})
    if op.kind == "replace":
        return ("update", entity, {"mode": UpdateMode.REPLACE, **_etag_condition(op.if_match)})
    return ("delete", entity, _etag_condition(op.if_match))


class AzureTable(Table):
    """See base class."""

    def __init__(self, client: TableClient) -> None:
        self.name = client.table_name
        self._client = client

    def _insert(self, entity: Entity) -> Entity:
        with storage_errors(f"insert {self.name}/{entity.row_key}"):
            meta = self._client.create_entity(_to_azure(entity))
        return Entity(entity.partition_key, entity.row_key, dict(entity.data), meta["etag"])

    def _get(self, partition_key: str, row_key: str) -> Entity:
        with storage_errors(f"get {self.name}/{partition_key}/{row_key}"):
            raw = self._client.get_entity(partition_key, row_key)
        return _from_azure(raw, str(raw.metadata["etag"]))

    def _replace(self, entity: Entity, if_match: str) -> Entity:
        with storage_errors(f"replace {self.name}/{entity.row_key}"):
            meta = self._client.update_entity(
                _to_azure(entity), mode=UpdateMode.REPLACE, **_etag_condition(if_match)
            )
        return Entity(entity.partition_key, entity.row_key, dict(entity.data), meta["etag"])

    def _upsert(self, entity: Entity) -> Entity:
        with storage_errors(f"upsert {self.name}/{entity.row_key}"):
            meta = self._client.upsert_entity(_to_azure(entity), mode=UpdateMode.REPLACE)
        return Entity(entity.partition_key, entity.row_key, dict(entity.data), meta["etag"])

    def _delete(self, partition_key: str, row_key: str, if_match: str | None) -> None:
        # TableClient.delete_entity swallows 404; a one-operation transaction reports it.
        op = _operation(BatchOp("delete", Entity(partition_key, row_key), if_match))
        with storage_errors(f"delete {self.name}/{partition_key}/{row_key}"):
            self._client.submit_transaction([op])

    def _query_page(self, request: PageQuery) -> Page:
        partition_key, where = request.partition_key, request.where
        query = " and ".join(
            [f"PartitionKey eq {_literal(partition_key)}"]
            + [f"{c.name} {c.op} {_literal(c.value)}" for c in where]
        )
        token: dict[str, str] | None = None
        if request.continuation is not None:
            cursor = continuation_cursor(request.continuation)
            try:
                token = json.loads(cursor)
            except ValueError as exc:
                raise BadRequest("malformed continuation token") from exc
        with storage_errors(f"query {self.name}/{partition_key}"):
            # With $select, Azure returns only what is named: the keys too.
            select = None if request.select is None else ["PartitionKey", "RowKey", *request.select]
            pages = self._client.query_entities(
                query, results_per_page=request.page_size, select=select
            ).by_page(
                continuation_token=token  # type: ignore[arg-type]  # the SDK's token is a dict
            )
            raws = list(next(pages))
            next_token = pages.continuation_token  # type: ignore[attr-defined]
        # Azurite compares across types ("40" > 15); Azure does not. Re-check, so both agree.
        entities = [
            entity
            for entity in (_from_azure(raw, str(raw.metadata["etag"])) for raw in raws)
            if matches(entity.data, where)
        ]
        if not next_token:
            return Page(entities, None)
        return Page(entities, continuation_token(json.dumps(next_token)))

    def _batch(self, ops: list[BatchOp]) -> list[Entity | None]:
        operations = [_operation(op) for op in ops]
        with storage_errors(f"batch on {self.name}", batch=True):
            metas = self._client.submit_transaction(operations)
        return [
            None
            if op.kind == "delete"
            else Entity(op.entity.partition_key, op.entity.row_key, dict(op.entity.data), m["etag"])
            for op, m in zip(ops, metas, strict=True)
        ]

    def ping(self) -> None:
        with storage_errors(f"table {self.name}"):
            next(iter(self._client.query_entities("PartitionKey eq ''", results_per_page=1)), None)

    def close(self) -> None:
        self._client.close()
