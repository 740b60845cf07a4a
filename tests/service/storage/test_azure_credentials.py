"""Reaching Azure storage: endpoints, credentials, and the ones that cannot sign URLs."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential
from azure.storage.blob import (
    AccountSasPermissions,
    BlobServiceClient,
    ResourceTypes,
    generate_account_sas,
)

from rallypoint.service.errors import BadRequest
from rallypoint.service.storage import AzureStorage, Entity, open_storage
from rallypoint.service.storage._storage import (
    ACCOUNT_ENV,
    BLOB_ENDPOINT_ENV,
    CONNECTION_STRING_ENV,
    ENDPOINT_SUFFIX_ENV,
    TABLE_ENDPOINT_ENV,
)

from ..._azurite import ACCOUNT, KEY

ROOT = Path(__file__).resolve().parents[3]
ENVIRONMENT = (
    CONNECTION_STRING_ENV,
    ACCOUNT_ENV,
    TABLE_ENDPOINT_ENV,
    BLOB_ENDPOINT_ENV,
    ENDPOINT_SUFFIX_ENV,
)


def _fields(connection_string: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in connection_string.split(";") if part)


def _prefix() -> str:
    return "a" + uuid.uuid4().hex[:12]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _round_trip(storage: AzureStorage) -> None:
    """A table write and read, a blob write and read, and a write and a read through
    the URLs the coordinator hands trainers."""
    table = storage.table("jobs")
    table.upsert(Entity("p", "r", {"v": 1}))
    assert table.get("p", "r").data == {"v": 1}
    blobs = storage.blobs("ckpt")
    blobs.put("v1/own", b"stored")
    write = blobs.sign("v1/shard", access="write", ttl=timedelta(minutes=5))
    put = httpx.put(write, content=b"uploaded", headers={"x-ms-blob-type": "BlockBlob"})
    assert put.status_code == 201, put.text
    read = blobs.sign("v1/shard", access="read", ttl=timedelta(minutes=5))
    assert httpx.get(read).content == b"uploaded"
    assert blobs.get("v1/own") == b"stored"


def test_account_mode_reaches_explicit_endpoints_with_a_named_key(azurite: str) -> None:
    fields = _fields(azurite)
    storage = AzureStorage(
        _prefix(),
        account=ACCOUNT,
        credential=AzureNamedKeyCredential(ACCOUNT, KEY),
        table_endpoint=fields["TableEndpoint"],
        blob_endpoint=fields["BlobEndpoint"] + "/",
    )
    assert storage.describe() == f"azure:{ACCOUNT}"
    _round_trip(storage)
    assert (
        storage.blobs("ckpt")
        .sign("x", access="read", ttl=timedelta(minutes=1))
        .startswith(fields["BlobEndpoint"] + "/")
    )
    storage.close()


def test_connection_strings_with_their_own_endpoints_keep_working(azurite: str) -> None:
    # TableEndpoint= and BlobEndpoint= (Azurite's, on loopback ports), keys in any case.
    fields = _fields(azurite)
    lowered = (
        f"accountname={ACCOUNT};accountkey={KEY};"
        f"blobendpoint={fields['BlobEndpoint']};tableendpoint={fields['TableEndpoint']}"
    )
    for connection_string in (azurite, lowered):
        storage = AzureStorage(_prefix(), connection_string=connection_string)
        _round_trip(storage)
        storage.close()


def test_endpoint_suffix_names_the_default_endpoints_in_another_cloud(
    clean_env: pytest.MonkeyPatch,
) -> None:
    # No request is sent: the clients are built, and their URLs checked.
    key_string = f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={KEY};"
    storage = AzureStorage(connection_string=key_string + "EndpointSuffix=core.chinacloudapi.cn")
    assert storage._tables_client.url.startswith("https://acct.table.core.chinacloudapi.cn")
    assert storage._blob_client.url.startswith("https://acct.blob.core.chinacloudapi.cn")
    storage.close()

    clean_env.setenv(ACCOUNT_ENV, "acct")
    clean_env.setenv(ENDPOINT_SUFFIX_ENV, "core.usgovcloudapi.net")
    clean_env.setenv(TABLE_ENDPOINT_ENV, "https://acct.privatelink.table.core.usgovcloudapi.net/")
    storage = open_storage("azure")
    assert isinstance(storage, AzureStorage)
    assert storage._tables_client.url.startswith(
        "https://acct.privatelink.table.core.usgovcloudapi"
    )
    assert storage._blob_client.url.startswith("https://acct.blob.core.usgovcloudapi.net")
    assert storage._account_key is None  # a managed identity signs with delegation keys
    storage.close()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({TABLE_ENDPOINT_ENV: "https://t.example.com"}, f"{TABLE_ENDPOINT_ENV} need"),
        ({ACCOUNT_ENV: "acct", BLOB_ENDPOINT_ENV: "acct.blob.core.windows.net"}, "service URL"),
        ({ACCOUNT_ENV: "acct", BLOB_ENDPOINT_ENV: "https://a.example.com/?sv=x"}, "no query"),
        ({ACCOUNT_ENV: "acct", ENDPOINT_SUFFIX_ENV: "https://core.windows.net"}, "DNS suffix"),
        (
            {CONNECTION_STRING_ENV: f"AccountName=a;AccountKey={KEY}", ENDPOINT_SUFFIX_ENV: "x.y"},
            "in the connection string",
        ),
        ({CONNECTION_STRING_ENV: "not a connection string"}, "azure storage:"),
    ],
)
def test_bad_endpoint_settings_are_refused(
    clean_env: pytest.MonkeyPatch, settings: dict[str, str], message: str
) -> None:
    for name, value in settings.items():
        clean_env.setenv(name, value)
    with pytest.raises(BadRequest, match=message):
        open_storage("azure")


def _account_sas() -> str:
    return generate_account_sas(
        ACCOUNT,
        KEY,
        resource_types=ResourceTypes(service=True, container=True, object=True),
        permission=AccountSasPermissions(read=True, write=True, list=True, create=True),
        expiry=datetime.now(timezone.utc) + timedelta(hours=1),
    )


def test_an_account_sas_is_refused_as_it_cannot_sign_per_object_urls(azurite: str) -> None:
    fields = _fields(azurite)
    sas_string = (
        f"BlobEndpoint={fields['BlobEndpoint']};TableEndpoint={fields['TableEndpoint']};"
        f"SharedAccessSignature={_account_sas()}"
    )
    # The SAS itself is good: Azurite takes it.
    BlobServiceClient.from_connection_string(sas_string).get_service_properties()
    with pytest.raises(BadRequest) as refused:
        AzureStorage(_prefix(), connection_string=sas_string)
    message = str(refused.value)
    assert CONNECTION_STRING_ENV in message and "SharedAccessSignature=" in message
    assert "AccountKey=" in message and "managed identity" in message
    with pytest.raises(BadRequest, match="AzureSasCredential"):
        AzureStorage(
            _prefix(),
            account=ACCOUNT,
            credential=AzureSasCredential(_account_sas()),
            table_endpoint=fields["TableEndpoint"],
            blob_endpoint=fields["BlobEndpoint"],
        )


@pytest.mark.e2e
def test_serve_refuses_an_account_sas_at_start_up(azurite: str) -> None:
    fields = _fields(azurite)
    env = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT}
    env[CONNECTION_STRING_ENV] = (
        f"BlobEndpoint={fields['BlobEndpoint']};TableEndpoint={fields['TableEndpoint']};"
        f"SharedAccessSignature={_account_sas()}"
    )
    result = subprocess.run(
        [sys.executable, "-m", "rallypoint", "serve", "--storage", "azure", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode != 0
    assert "gives a shared access signature (SharedAccessSignature=)" in result.stderr
