"""Credentials, tokens and signatures are compared as bytes: whatever a caller sends, a
value that is not the secret is refused as such, never a 500 (``hmac.compare_digest``
raises ``TypeError`` on text with a non-ASCII character, and a header arrives as text
decoded from latin-1, so it may hold any byte)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from rallypoint.client import CREDENTIAL_HEADER, JobSpec, SignedUrlError
from rallypoint.localfs import load_key, sign_file_url, verify_file_url
from rallypoint.service.app import create_app
from rallypoint.service.settings import Settings
from rallypoint.trainer import TransferDenied, download

TOKEN = "admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
# Not credentials: non-ASCII bytes (alone, and as long as a real one), and too long.
NOT_CREDENTIALS = [b"\xe9", b"\xe9" * 43, b"x" * 129, b"\xff" * 200]


@pytest.fixture(params=[True, False], ids=["fast-path", "routes"])
def member(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[TestClient, str]]:
    settings = Settings(storage=f"local:{tmp_path}", token=TOKEN)
    app = create_app(settings, fast_path=request.param)
    with TestClient(app, raise_server_exceptions=False) as client:
        spec = JobSpec(min_nodes=1, max_nodes=2, last_call=timedelta(0))
        join = {"node_id": "a", "addr": "h", "port": 1, "spec": spec.model_dump(mode="json")}
        credential = client.post("/v1/jobs/job/join", json=join, headers=ADMIN).json()["credential"]
        yield client, credential


def acting_requests(client: TestClient, headers: list[tuple[str, bytes]]) -> dict[str, Any]:
    """Every route that takes the node credential, as node ``a`` of generation 1."""
    post, get = client.post, client.get
    return {
        "heartbeat": post(
            "/v1/jobs/job/nodes/a/heartbeat", json={"generation": 1}, headers=headers
        ),
        "waiting beat": post("/v1/jobs/job/nodes/a/heartbeat", json={}, headers=headers),
        "wait": post("/v1/jobs/job/nodes/a/wait", json={"round": 1, "wait": 0}, headers=headers),
        "assignment": get("/v1/jobs/job/generations/1/nodes/a", headers=headers),
        "store": post(
            "/v1/jobs/job/store/1", json={"op": "num_keys", "node_id": "a"}, headers=headers
        ),
        "begin": post(
            "/v1/jobs/job/checkpoints",
            json={"node_id": "a", "generation": 1, "step": 1},
            headers=headers,
        ),
        "report": post(
            "/v1/jobs/job/checkpoints/1/shards",
            json={
                "node_id": "a",
                "generation": 1,
                "files": [{"name": "f", "size": 1, "checksum": "xxh3-128:00"}],
            },
            headers=headers,
        ),
        "leave": post("/v1/jobs/job/nodes/a/leave", json={"reason": "x"}, headers=headers),
    }


@pytest.mark.parametrize("value", NOT_CREDENTIALS, ids=["e9", "e9x43", "x129", "ffx200"])
def test_a_credential_that_is_not_one_is_refused_on_every_route(
    member: tuple[TestClient, str], value: bytes
) -> None:
    client, credential = member
    # The real credential was accepted once: the generation keeps it, and compares the
    # next beats with it (where a non-ASCII one raised TypeError).
    beat = client.post(
        "/v1/jobs/job/nodes/a/heartbeat",
        json={"generation": 1},
        headers={**ADMIN, CREDENTIAL_HEADER: credential},
    )
    assert beat.status_code == 200, beat.text
    replies = acting_requests(
        client, [("Authorization", f"Bearer {TOKEN}".encode()), (CREDENTIAL_HEADER, value)]
    )
    answers = {route: (r.status_code, r.json().get("code")) for route, r in replies.items()}
    assert answers == dict.fromkeys(replies, (403, "invalid_credential")), answers


@pytest.mark.parametrize("token", [b"\xe9", b"admin-toke\xe9", b"x" * 5000])
def test_a_token_that_is_not_one_is_unauthorized(
    member: tuple[TestClient, str], token: bytes
) -> None:
    client, credential = member
    for header, value in (("Authorization", b"Bearer " + token), ("X-Rallypoint-Token", token)):
        replies = acting_requests(
            client, [(header, value), (CREDENTIAL_HEADER, credential.encode())]
        )
        answers = {route: (r.status_code, r.json().get("code")) for route, r in replies.items()}
        assert answers == dict.fromkeys(replies, (401, "unauthorized")), answers


def test_a_file_url_whose_signature_is_not_one_is_denied(tmp_path: Path) -> None:
    (tmp_path / "blobs" / "c").mkdir(parents=True)
    (tmp_path / "blobs" / "c" / "o").write_bytes(b"data")
    url = sign_file_url(
        tmp_path, load_key(tmp_path, create=True), "c/o", "r", int(time.time()) + 60
    )
    assert download(url) == b"data"
    signed, _, _ = url.partition("&sig=")
    # As a URL carries them: UTF-8 for é, and a byte that is no UTF-8 at all.
    for sig in ("%C3%A9", "%C3%A9" * 64, "%E9", "%FF" * 64, "x" * 5000):
        forged = f"{signed}&sig={sig}"
        with pytest.raises(SignedUrlError):
            verify_file_url(forged, "r")
        with pytest.raises(TransferDenied):
            download(forged)
