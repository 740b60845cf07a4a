from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from rallypoint.service._checkpoints import Checkpoints
from rallypoint.service._rendezvous import Rendezvous
from rallypoint.service.storage import AzureStorage, BlobStore, LocalStorage, Storage

from ._azurite import running_azurite
from ._coordinator import Coordinator

Start = Callable[..., Coordinator]


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


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Coordinators run on both backends; tests that also take ``transport`` add the
    envelope on the local one (the envelope does not touch storage)."""
    if "backend" not in metafunc.fixturenames:
        return
    chosen = any("backend" in m.args[0] for m in metafunc.definition.iter_markers("parametrize"))
    if chosen:  # the test names its backend itself
        if "transport" in metafunc.fixturenames:
            metafunc.parametrize("transport", ["rest", "envelope"], indirect=True)
    elif "transport" in metafunc.fixturenames:
        combos = [("local", "rest"), ("azure", "rest"), ("local", "envelope")]
        metafunc.parametrize(
            ["backend", "transport"], combos, indirect=True, ids=["-".join(c) for c in combos]
        )
    else:
        metafunc.parametrize("backend", ["local", "azure"], indirect=True)


@pytest.fixture
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """Arguments and environment for coordinators sharing one storage."""
    if request.param == "local":
        return ["--storage", f"local:{tmp_path / 'store'}"], {}
    prefix = "c" + uuid.uuid4().hex[:10]
    return ["--storage", "azure"], {
        "AZURE_STORAGE_CONNECTION_STRING": request.getfixturevalue("azurite"),
        "RALLYPOINT_STORAGE_PREFIX": prefix,
    }


@pytest.fixture
def start(backend: tuple[list[str], dict[str, str]]) -> Iterator[Start]:
    started: list[Coordinator] = []

    def run(*extra: str) -> Coordinator:
        args, env = backend
        started.append(Coordinator([*args, *extra], env).start())
        return started[-1]

    yield run
    for coordinator in started:
        coordinator.stop()


@pytest.fixture
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a module's client tests both ways: each operation at its own path, and every
    one through the single envelope route an AzureML endpoint forwards."""
    monkeypatch.setenv("RALLYPOINT_TRANSPORT", request.param)
    return str(request.param)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def rdzv(storage: Storage, clock: Clock) -> Rendezvous:
    return Rendezvous(storage.table("jobs"), clock)


@pytest.fixture
def blobs(storage: Storage) -> BlobStore:
    return storage.blobs("checkpoints")


@pytest.fixture
def ckpts(rdzv: Rendezvous, blobs: BlobStore) -> Checkpoints:
    """The checkpoints over ``rdzv``: 3 versions kept, 10 minutes to finish one (a
    module may override it with its own)."""
    return Checkpoints(rdzv, blobs, keep=3, timeout=timedelta(seconds=600))
