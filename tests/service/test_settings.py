"""Settings that shape the coordinator's rules reach them, and bad values are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from rallypoint.service.app import create_app
from rallypoint.service.settings import Settings


def test_the_heartbeat_reconnect_window_is_the_drivers(tmp_path: Path) -> None:
    settings = Settings(storage=f"local:{tmp_path}", heartbeat_reconnect=1.0)
    with TestClient(create_app(settings)) as client:
        assert client.app.state.driver.reconnect == 1.0  # type: ignore[attr-defined]
    with TestClient(create_app(Settings(storage=f"local:{tmp_path}"))) as client:
        assert client.app.state.driver.reconnect == 0.25  # type: ignore[attr-defined]


@pytest.mark.parametrize("seconds", [0, -1, 31])
def test_a_reconnect_window_out_of_range_is_refused(tmp_path: Path, seconds: float) -> None:
    with pytest.raises(ValidationError, match="heartbeat_reconnect"):
        Settings(storage=f"local:{tmp_path}", heartbeat_reconnect=seconds)
