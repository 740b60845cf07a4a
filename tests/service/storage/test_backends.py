"""Choosing a backend, and the errors for a backend that cannot be used."""

from __future__ import annotations

import importlib.metadata
import logging
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from azure.data.tables import TableClient

from rallypoint.service.errors import BadRequest, InvalidName, LimitExceeded, StorageUnavailable
from rallypoint.service.storage import (
    AzureStorage,
    BatchOp,
    Entity,
    LocalStorage,
    _azure_batch,
    open_storage,
    use_batch_path,
)
from rallypoint.service.storage._azure_table import AzureTable

from ..._azurite import connection_string, free_port


def test_local_spec_opens_a_directory(tmp_path: Path) -> None:
    storage = open_storage(f"local:{tmp_path / 'x'}")
    assert isinstance(storage, LocalStorage)
    assert storage.describe() == f"local:{tmp_path / 'x'}"
    storage.table("jobs")
    assert (tmp_path / "x" / "tables.sqlite3").exists()


def test_azure_spec_uses_the_connection_string(azurite: str) -> None:
    storage = open_storage("azure", connection_string=azurite, prefix="spec")
    assert isinstance(storage, AzureStorage)
    assert storage.describe() == "azure:devstoreaccount1"
    storage.table("jobs").upsert(Entity("p", "r", {"v": 1}))
    storage.ping()


@pytest.fixture
def count_threads(monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[threading.Thread]]:
    """Call it to count the threads this process starts from then on (they still
    start): the list they are added to."""

    def count() -> list[threading.Thread]:
        started: list[threading.Thread] = []
        start = threading.Thread.start

        def counted(thread: threading.Thread) -> None:
            started.append(thread)
            start(thread)

        monkeypatch.setattr(threading.Thread, "start", counted)
        return started

    return count


def test_a_batch_starts_no_threads(
    azurite: str, count_threads: Callable[[], list[threading.Thread]]
) -> None:
    # azure-core would start a thread pool per transaction (and one per changeset): at
    # a rendezvous of a thousand joins, starting those threads cost more than the writes.
    assert use_batch_path()  # as `rallypoint serve` does at start-up
    table = open_storage("azure", connection_string=azurite, prefix="threads").table("jobs")
    started = count_threads()
    table.batch([BatchOp("upsert", Entity("p", f"r{i}", {"v": i})) for i in range(100)])
    assert started == []
    assert sorted(e.data["v"] for e in table.query("p")) == list(range(100))


@pytest.mark.parametrize(
    ("version", "tested"),
    [
        ("1.29.4", True),
        ("1.41.0", True),
        ("1.41.9", True),
        ("1.29.3", False),
        ("1.42.0", False),
        ("1.42.0b1", False),
        ("2.0.0", False),
        ("dev", False),
    ],
)
def test_the_batch_path_is_kept_to_tested_azure_core_releases(version: str, tested: bool) -> None:
    assert _azure_batch.tested(version) is tested


def test_an_azure_core_without_metadata_counts_as_untested(monkeypatch: pytest.MonkeyPatch) -> None:
    def unknown(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", unknown)
    assert not _azure_batch.tested()


def test_pyproject_allows_the_azure_core_releases_the_batch_path_was_tested_on() -> None:
    text = (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
    found = re.search(r'"azure-core>=([\d.]+),<([\d.]+)"', text)
    assert found, "pyproject's service extra bounds azure-core on both sides"
    low, high = (tuple(int(n) for n in v.split(".")) for v in found.groups())
    assert (low, high) == _azure_batch.TESTED_AZURE_CORE
    assert _azure_batch.tested()  # the venv running this is inside


@pytest.fixture
def stock_batches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[logging.LogRecord]]:
    """azure-core's own batch path, as on a release outside the tested ones; yields
    the warnings logged. The in-order path is back afterwards."""
    monkeypatch.setattr(_azure_batch, "TESTED_AZURE_CORE", ((0,), (1,)))
    monkeypatch.setattr(_azure_batch, "_refused", False)
    _azure_batch.uninstall()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("rallypoint.storage")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        monkeypatch.undo()
        assert _azure_batch.install()


def test_outside_the_tested_releases_batches_take_azure_cores_path(
    azurite: str,
    stock_batches: list[logging.LogRecord],
    count_threads: Callable[[], list[threading.Thread]],
) -> None:
    from azure.core.pipeline import Pipeline

    storage = open_storage("azure", connection_string=azurite, prefix="stock")
    table, other = storage.table("jobs"), storage.table("others")
    assert not use_batch_path() and not use_batch_path()  # serve's start-up asks once
    assert not _azure_batch.installed()
    assert Pipeline.__dict__["_prepare_multipart_mixed_request"].__func__.__module__ == (
        "azure.core.pipeline._base"
    )
    [warning] = stock_batches  # once, however many tables
    assert "not a release the batch path was tested on" in warning.getMessage()
    started = count_threads()
    table.batch([BatchOp("upsert", Entity("p", f"r{i}", {"v": i})) for i in range(100)])
    other.batch([BatchOp("insert", Entity("p", "a")), BatchOp("insert", Entity("p", "b"))])
    assert started, "azure-core's own path prepares sub-requests in its thread pools"
    assert sorted(e.data["v"] for e in table.query("p")) == list(range(100))
    assert [e.row_key for e in other.query("p")] == ["a", "b"]
    storage.close()


def test_building_azure_storage_changes_nothing_process_wide(azurite: str) -> None:
    """Only `rallypoint serve`'s start-up (service._process.tune) takes the batch path:
    a process that builds storage for itself keeps azure-core as it was."""
    _azure_batch.uninstall()
    try:
        storage = open_storage("azure", connection_string=azurite, prefix="quiet")
        storage.table("jobs").batch([BatchOp("upsert", Entity("p", "r", {"v": 1}))])
        storage.close()
        assert not _azure_batch.installed()
    finally:
        assert use_batch_path() and _azure_batch.installed()


def test_uninstall_restores_azure_cores_own_helpers() -> None:
    import azure.core.rest._helpers as helpers
    from azure.core.utils import _pipeline_transport_rest_shared as shared

    assert _azure_batch.install() and _azure_batch.install()  # idempotent
    assert helpers._prepare_multipart_body_helper is not shared._prepare_multipart_body_helper
    _azure_batch.uninstall()
    try:
        assert helpers._prepare_multipart_body_helper is shared._prepare_multipart_body_helper
        assert not _azure_batch.installed()
    finally:
        assert _azure_batch.install()


def _batch_request() -> Any:
    """A transaction shaped as azure-data-tables builds one: a batch around a changeset
    of entity requests (a PUT, a MERGE with If-Match, a DELETE)."""
    from azure.core.rest import HttpRequest

    url = "http://127.0.0.1:10002/devstoreaccount1"
    subs = [
        HttpRequest("PUT", f"{url}/jobs(PartitionKey='p',RowKey='a')", json={"v": 1}),
        HttpRequest(
            "MERGE",
            f"{url}/jobs(PartitionKey='p',RowKey='b')",
            json={"v": "é"},
            headers={"If-Match": "W/\"datetime'2026'\""},
        ),
        HttpRequest("DELETE", f"{url}/jobs(PartitionKey='p',RowKey='c')"),
    ]
    changeset = HttpRequest("POST", None)  # type: ignore[arg-type]
    changeset.set_multipart_mixed(*subs, boundary="changeset_1234")
    batch = HttpRequest("POST", f"{url}/$batch")
    batch.set_multipart_mixed(changeset, boundary="batch_5678")
    return batch


def test_batch_bodies_are_the_bytes_azure_core_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    import azure.core.rest._helpers as helpers
    from azure.core.utils import _pipeline_transport_rest_shared as shared

    _azure_batch.install()  # as `rallypoint serve` does at start-up
    ours = _batch_request()
    ours.prepare_multipart_body()
    assert helpers._prepare_multipart_body_helper is not shared._prepare_multipart_body_helper
    monkeypatch.setattr(
        helpers, "_prepare_multipart_body_helper", shared._prepare_multipart_body_helper
    )
    theirs = _batch_request()
    theirs.prepare_multipart_body()
    assert ours.content == theirs.content
    assert ours.headers["Content-Type"] == theirs.headers["Content-Type"]


@pytest.mark.parametrize("eol", ["\r\n", "\n"])
def test_batch_replies_split_as_azure_core_splits_them(eol: str) -> None:
    from azure.core.utils._pipeline_transport_rest_shared import message_parser

    from rallypoint.service.storage._azure_batch import _Part

    reply = eol.join(
        [
            "--batchresponse_1",
            "Content-Type: multipart/mixed; boundary=changesetresponse_2",
            "",
            "--changesetresponse_2",
            "Content-Type: application/http",
            "Content-Transfer-Encoding: binary",
            "",
            "HTTP/1.1 204 No Content",
            'ETag: W/"1"',
            "",
            "",
            "--changesetresponse_2",
            "Content-Type: application/http",
            "Content-Transfer-Encoding: binary",
            "",
            "HTTP/1.1 412 Precondition Failed",
            "Content-Type: application/json",
            "",
            '{"odata.error":{"code":"UpdateConditionNotSatisfied"}}',
            "--changesetresponse_2--",
            "",
            "--batchresponse_1--",
            "",
        ]
    ).encode()
    content_type = "multipart/mixed; boundary=batchresponse_1"
    theirs = message_parser(b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + reply)
    ours = _Part(content_type, reply)

    def shape(message: Any) -> Any:
        payload = message.get_payload(decode=message.get_content_type() != "multipart/mixed")
        if isinstance(payload, list):
            return [shape(part) for part in payload]
        return (message.get_content_type(), payload.replace(b"\r\n", b"\n"))

    assert shape(ours) == shape(theirs)
    assert len(shape(ours)[0]) == 2


def test_prefixes_keep_deployments_apart(azurite: str, tmp_path: Path) -> None:
    for make in (
        lambda p: AzureStorage(p, connection_string=azurite),
        lambda p: LocalStorage(tmp_path, p),
    ):
        one, two = make("one"), make("two")
        one.table("jobs").upsert(Entity("p", "r", {"who": "one"}))
        one.blobs("ckpt").put("x", b"one")
        assert list(two.table("jobs").query("p")) == []
        assert list(two.blobs("ckpt").list()) == []


@pytest.mark.parametrize("spec", ["s3", "local-ish:x", "azure:account", ""])
def test_unknown_specs_are_refused(spec: str) -> None:
    with pytest.raises(BadRequest):
        open_storage(spec)


def test_azure_without_credentials_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT", raising=False)
    with pytest.raises(BadRequest, match="AZURE_STORAGE_CONNECTION_STRING"):
        open_storage("azure")


@pytest.mark.parametrize("prefix", ["", "Upper", "has-dash", "1st", "x" * 25])
def test_bad_prefixes_are_refused(prefix: str, tmp_path: Path) -> None:
    with pytest.raises(BadRequest):
        LocalStorage(tmp_path, prefix)


def test_unreachable_azure_is_storage_unavailable_and_checks_come_first() -> None:
    port = free_port()  # nothing listens here
    client = TableClient.from_connection_string(
        connection_string(port, port), table_name="nowhere", retry_total=0
    )
    table = AzureTable(client)
    with pytest.raises(StorageUnavailable):
        table.get("p", "r")
    # Bad input is refused before a request is sent: no StorageUnavailable here.
    with pytest.raises(InvalidName):
        table.insert(Entity("p", "a/b"))
    with pytest.raises(LimitExceeded):
        table.insert(Entity("p", "r", {"b": b"x" * (64 * 1024 + 1)}))
    with pytest.raises(StorageUnavailable):
        table.ping()
