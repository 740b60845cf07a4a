from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rallypoint.service.storage import AzureStorage, LocalStorage, Storage

from ._azurite import running_azurite


@pytest.fixture(scope="session")
def azurite() -> Iterator[str]:
    """A connection string to a real Azurite, started once per test session."""
    with running_azurite() as conn:
        yield conn


@pytest.fixture(params=["local", "azure"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    """The same contract runs against both backends, each test on fresh names."""
    prefix = "t" + uuid.uuid4().hex[:12]
    store: Storage
    if request.param == "local":
        store = LocalStorage(tmp_path / "store", prefix)
    else:
        store = AzureStorage(prefix, connection_string=request.getfixturevalue("azurite"))
    yield store
    store.close()
