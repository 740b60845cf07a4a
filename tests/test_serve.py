"""``rallypoint serve`` under a real uvicorn, on both backends."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from ._coordinator import Coordinator


@pytest.fixture
def start() -> Iterator[Callable[..., str]]:
    """Starts coordinators (args after ``serve``, extra env); each returns its URL once
    healthy, and all are stopped after the test."""
    started: list[Coordinator] = []

    def run(*args: str, env: dict[str, str] | None = None) -> str:
        started.append(Coordinator(list(args), env or {}).start())
        return started[-1].url

    yield run
    for coordinator in started:
        coordinator.stop()


def test_serves_health_and_readiness_on_local_storage(
    tmp_path: Path, start: Callable[..., str]
) -> None:
    url = start("--storage", f"local:{tmp_path}")
    ready = httpx.get(f"{url}/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "storage": f"local:{tmp_path}"}
    assert (tmp_path / "tables.sqlite3").exists()
    assert httpx.get(f"{url}/openapi.json").json()["info"]["title"] == "Rallypoint coordinator"


def test_serves_on_azurite_from_the_environment(azurite: str, start: Callable[..., str]) -> None:
    url = start(
        env={
            "RALLYPOINT_STORAGE": "azure",
            "RALLYPOINT_STORAGE_PREFIX": "serve",
            "AZURE_STORAGE_CONNECTION_STRING": azurite,
        }
    )
    assert httpx.get(f"{url}/readyz").json()["storage"] == "azure:devstoreaccount1"


def test_readiness_fails_when_storage_goes_away(tmp_path: Path, start: Callable[..., str]) -> None:
    url = start("--storage", f"local:{tmp_path}")
    for path in sorted((tmp_path / "blobs").rglob("*"), reverse=True):
        path.rmdir()
    (tmp_path / "blobs").rmdir()
    ready = httpx.get(f"{url}/readyz")
    assert ready.status_code == 503
    assert ready.json()["code"] == "storage_unavailable"
    assert httpx.get(f"{url}/healthz").status_code == 200  # the process itself is fine


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--host", "0.0.0.0"], "without a token"),
        (["--storage", "s3://bucket"], "local:PATH"),
        (["--port", "70000"], "65535"),
    ],
)
def test_unsafe_or_bad_settings_are_refused(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rallypoint", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("RALLYPOINT_")},
    )
    assert result.returncode == 2
    assert message in result.stderr


def test_a_token_or_insecure_allows_other_addresses() -> None:
    from rallypoint.service.settings import Settings

    assert Settings(host="0.0.0.0", token="s3cret").host == "0.0.0.0"
    assert Settings(host="0.0.0.0", insecure=True).insecure
    assert Settings(host="::1").host == "::1"
