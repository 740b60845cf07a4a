"""The contract: ``/openapi.json`` says what every route answers, and the coordinator
answers only that (schemathesis against a served coordinator); error codes are one list
that the service keeps to and the client maps; unsupported methods get 405."""

from __future__ import annotations

import inspect
import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import pytest
from pydantic import ValidationError

from rallypoint.client import codes
from rallypoint.client import errors as client_errors
from rallypoint.client.models import CREDENTIAL_HEADER, MAX_NODES_LIMIT, JobSpec
from rallypoint.service import _http
from rallypoint.service import errors as service_errors
from rallypoint.service.app import create_app
from rallypoint.service.settings import Settings

from .._inprocess import InProcessCoordinator

HOOKS = Path(__file__).with_name("_contract_hooks.py")
CONFIG = Path(__file__).with_name("schemathesis.toml")
#: Cases per operation and phase: ~2,500 cases in all, about 40 s on two cores.
EXAMPLES = 40
#: A fixed seed keeps CI's run reproducible; set the variable to explore others.
SEED = int(os.environ.get("RALLYPOINT_CONTRACT_SEED", "20261123"))
TOKEN = secrets.token_urlsafe(24)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("storage")
    # One argument: a token that starts with "-" (1 in 64) would read as another flag.
    args = ["--storage", f"local:{root}", f"--token={TOKEN}"]
    coordinator = InProcessCoordinator(args).start()
    yield coordinator.url
    coordinator.stop()


@pytest.mark.e2e  # schemathesis's CLI, in a process of its own
def test_schemathesis_finds_nothing(url: str, tmp_path: Path) -> None:
    """Every check schemathesis has (status codes, bodies, headers, accepted and refused
    data, methods, auth) over >= 1,000 generated requests, with the admin token. Node
    routes get no credential: their documented 403 is what they answer then."""
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(CONFIG),
        "run",
        f"{url}/openapi.json",
        "--checks",
        "all",
        "--header",
        f"Authorization: Bearer {TOKEN}",
        "--max-examples",
        str(EXAMPLES),
        "--seed",
        str(SEED),
        "--generation-database",
        "none",
        "--request-timeout",
        "70",  # a join or wait holds up to 60 s
        "--no-color",
    ]
    # Its working directory is the test's: schemathesis keeps a cache folder there.
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)}
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    output = run.stdout + run.stderr
    generated = re.search(r"(\d+) generated", output)
    assert run.returncode == 0, output[-20_000:]
    assert generated is not None and int(generated[1]) >= 1_000, output[-2_000:]


def _service_errors() -> list[type[service_errors.RallypointServiceError]]:
    found = []
    for _, cls in inspect.getmembers(service_errors, inspect.isclass):
        if issubclass(cls, service_errors.RallypointServiceError):
            found.append(cls)
    return found


def test_every_service_code_is_in_the_shared_list() -> None:
    sent = {cls.code for cls in _service_errors()}
    # The HTTP layer's own: routing, parsing, validation, the body limit, a crash.
    sent |= set(_http._HTTP_CODES.values())
    sent |= {codes.MALFORMED_JSON, codes.INVALID_REQUEST, codes.INTERNAL_ERROR}
    assert sent <= set(codes.CODES), sent - set(codes.CODES)


def test_a_code_outside_the_list_cannot_be_defined() -> None:
    with pytest.raises(TypeError, match=r"not in rallypoint\.client\.codes"):

        class Invented(service_errors.RequestError):
            code = "invented"


def test_every_code_maps_to_a_client_exception() -> None:
    for code in codes.CODES:
        error = client_errors.error_for(400, code, "message")
        assert type(error) is not client_errors.ServerError, f"{code} has no client class"
        assert error.code == code and error.message == "message"
    # Where the client has the service's class by name, that is the one it raises.
    for cls in _service_errors():
        same = getattr(client_errors, cls.__name__, None)
        if isinstance(same, type) and issubclass(same, client_errors.ServerError):
            assert type(client_errors.error_for(cls.status, cls.code, "m")) is same, cls
    assert type(client_errors.error_for(500, "from_a_newer_server", "m")) is (
        client_errors.ServerError
    )


def test_a_spec_as_the_api_writes_and_reads_it_is_what_the_document_admits(
    tmp_path: Path,
) -> None:
    """The default spec as replies carry it (``hang_limit`` null: learned), and world
    sizes sent as JSON numbers with no fraction, which JSON Schema calls integers: the
    document admits both, and the model takes both; neither takes a fraction, a boolean
    or a size out of bounds."""
    schema = create_app(Settings(storage=f"local:{tmp_path}")).openapi()
    admits = jsonschema_rs.Draft202012Validator(schema["components"]["schemas"]["JobSpec"])
    written = json.loads(JobSpec().model_dump_json())
    assert written["hang_limit"] is None and admits.is_valid(written)
    whole = {"max_nodes": 4, "world_sizes": [2.0, 4.0], "hang_limit": None}
    assert admits.is_valid(whole)
    assert JobSpec.model_validate_json(json.dumps(whole)).world_sizes == (2, 4)
    for sizes in [[2.5], [True], [0], [MAX_NODES_LIMIT + 1]]:
        assert not admits.is_valid({"max_nodes": 4, "world_sizes": sizes})
        with pytest.raises(ValidationError):
            JobSpec.model_validate_json(json.dumps({"max_nodes": 4, "world_sizes": sizes}))


def _operations(schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            yield f"{method.upper()} {path}", operation


@pytest.mark.parametrize("token", ["T", None])
def test_the_document_says_who_may_call(tmp_path: Path, token: str | None) -> None:
    """With a token, every /v1 route declares it (and 401); without one, none does;
    routes that act for a node declare the node credential either way."""
    schema = create_app(Settings(storage=f"local:{tmp_path}", token=token)).openapi()
    schemes = schema["components"].get("securitySchemes", {})
    assert (
        "bearerToken" in schemes and schemes["tokenHeader"]["name"] == "X-Rallypoint-Token"
    ) is (token is not None)
    assert schemes["nodeCredential"]["name"] == CREDENTIAL_HEADER
    for name, operation in _operations(schema):
        security = operation.get("security", [])
        responses = operation["responses"]
        node = name.endswith("/heartbeat") or name.startswith("POST /v1/jobs/{job_id}/store")
        if token is not None and " /v1/" in name:
            assert {"bearerToken", "tokenHeader"} <= {s for r in security for s in r}, name
            assert "401" in responses, name
        if token is None:
            assert "401" not in responses and all("bearerToken" not in r for r in security), name
        if node:
            assert security and all("nodeCredential" in r for r in security), name
            assert "403" in responses, name
        for status, response in responses.items():
            if status.isdigit() and int(status) >= 400:
                assert "ErrorBody" in str(response["content"]), (name, status)


def test_unsupported_methods_get_405_with_allow(url: str) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    for method, path, allow in [
        ("TRACE", "/v1/jobs/j", "GET, PUT"),
        ("PATCH", "/v1/jobs/j", "GET, PUT"),
        ("DELETE", "/v1/jobs", "GET"),
        ("TRACE", "/healthz", "GET"),
    ]:
        reply = httpx.request(method, f"{url}{path}", headers=headers)
        assert reply.status_code == 405, (method, path, reply.text)
        assert reply.headers["allow"] == allow
        assert reply.json()["code"] == codes.METHOD_NOT_ALLOWED
