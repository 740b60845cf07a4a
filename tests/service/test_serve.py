"""``rallypoint serve`` under a real uvicorn, on both backends."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from rallypoint.tls import ssl_context

from .._coordinator import Coordinator

pytestmark = pytest.mark.e2e


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
    assert ready.json() == {
        "status": "ready",
        "storage": f"local:{tmp_path}",
        "storage_state": "ok",
        "storage_down_s": 0,
    }
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


def test_readiness_fails_only_once_storage_is_gone_for_the_grace(
    tmp_path: Path, start: Callable[..., str]
) -> None:
    """Storage is every replica's: within the grace a replica stays ready (taking them
    all out of the balancer would lose the heartbeats they can answer) and says what
    storage does; past it, 503. Storage back: ready again, on its own."""
    url = start("--storage", f"local:{tmp_path}", env={"RALLYPOINT_STORAGE_GRACE": "3"})
    blobs = tmp_path / "blobs"
    hidden = tmp_path / "hidden"
    blobs.rename(hidden)  # the container's folder is gone: its ping fails

    def readiness() -> tuple[int, dict[str, object]]:
        reply = httpx.get(f"{url}/readyz", timeout=1, verify=ssl_context())
        return reply.status_code, reply.json()

    def until(check: Callable[[int, dict[str, object]], bool], what: str) -> None:
        end = time.monotonic() + 10
        while not check(*readiness()):
            assert time.monotonic() < end, what
            time.sleep(0.1)

    until(lambda status, body: body.get("storage_state") == "unavailable", "noticed")
    assert readiness()[0] == 200
    until(lambda status, body: status == 503, "unready past the grace")
    assert readiness()[1]["code"] == "storage_unavailable"
    assert httpx.get(f"{url}/healthz").status_code == 200  # the process itself is fine
    hidden.rename(blobs)
    until(lambda status, body: body.get("storage_state") == "ok", "ready again")


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
