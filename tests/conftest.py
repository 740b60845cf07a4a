"""Fixtures shared by the tests, and the lanes every test falls in.

Lanes (registered in pyproject.toml; ``make test-fast`` runs the first two): each test is
in exactly one, the heaviest thing it needs, found from its fixtures here or from a mark
where fixtures cannot tell.

- ``unit``: starts no process. Coordinators run in the test's process (``start``).
- ``azurite``: the session's Azurite (``azurite``, or the ``azure`` case of ``storage`` or
  ``backend``), and no other process.
- ``e2e``: any other process: a ``rallypoint serve`` (``spawn``), torchrun, the CLI,
  HAProxy, Chromium. A module or test that starts one itself says so with
  ``pytest.mark.e2e``; one that forgets fails, as outside e2e starting a process does.

A session fails if it leaves behind a process of a test cluster or a semaphore one held
(checked after its last test; see ``_leftovers.py``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Callable, Generator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest

from rallypoint.cli import processes
from rallypoint.service._checkpoints import Checkpoints
from rallypoint.service._rendezvous import Rendezvous
from rallypoint.service.storage import AzureStorage, BlobStore, LocalStorage, Storage

from ._azurite import running_azurite
from ._coordinator import Coordinator
from ._inprocess import InProcessCoordinator
from ._leftovers import SESSION_ENV, leftovers

Start = Callable[..., InProcessCoordinator]
Spawn = Callable[..., Coordinator]

LANES = ("unit", "azurite", "e2e")
_LANE = pytest.StashKey[str]()


def _lane(item: pytest.Item) -> str:
    marked = {m.name for m in item.iter_markers()}
    fixtures = set(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    if "e2e" in marked or "spawn" in fixtures:
        return "e2e"
    if (
        "azurite" in marked
        or "azurite" in fixtures
        or "azure" in (params.get("storage"), params.get("backend"))
    ):
        return "azurite"
    return "unit"


def pytest_configure(config: pytest.Config) -> None:
    # This session's own mark, which every process its tests start inherits: an xdist
    # worker replaces the one it inherited from the controller with its own.
    os.environ[SESSION_ENV] = uuid.uuid4().hex


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    """After the session's last test (the first fixture set up, the last torn down): no
    process of a test cluster of this session runs, and no semaphore the harness found
    open in the processes it SIGKILLed remains; else the run fails, naming them."""
    yield
    left = leftovers(os.environ[SESSION_ENV])
    if left:
        pytest.fail("the session left behind (now removed):\n" + "\n".join(left), pytrace=False)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by the marks added here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        lane = item.stash[_LANE] = _lane(item)
        if item.get_closest_marker(lane) is None:
            item.add_marker(lane)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    with _no_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    with _no_processes(item):
        return (yield)


class _SpawnRefused(Exception):
    pass


# What libraries run to look at the machine (platform.processor() for the Azure SDKs'
# user agent), gone before the call returns: no lane's business.
_PROBES = {"uname", "ldconfig"}


@contextlib.contextmanager
def _no_processes(item: pytest.Item) -> Iterator[None]:
    """Outside e2e, starting a process (Azurite aside, in the azurite lane) fails the test
    with the mark it needs: the fast lane stays fast without anyone remembering."""
    lane = item.stash.get(_LANE, "e2e")
    if lane == "e2e":
        yield
        return
    real = subprocess.Popen.__init__

    def refuse(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        program = Path(os.fsdecode(argv[0])).name
        if program in _PROBES:
            return real(self, args, *rest, **kw)
        if program != "azurite":
            raise _SpawnRefused(f"{item.nodeid} starts {program}: mark it pytest.mark.e2e")
        if lane == "unit":
            raise _SpawnRefused(f"{item.nodeid} starts Azurite: mark it pytest.mark.azurite")
        return real(self, args, *rest, **kw)

    subprocess.Popen.__init__ = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = real  # type: ignore[method-assign]


@pytest.fixture(scope="session", autouse=True)
def _one_tls_context() -> Iterator[None]:
    """One default TLS context for every httpx client the tests make. httpx builds one
    per client by loading certifi's bundle (25 ms); the tests' URLs are all http://, and
    making clients was a third of the unit lane's time."""
    from httpx._transports import default

    made = default.create_ssl_context
    shared: dict[tuple[Any, ...], Any] = {}

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is not True or cert is not None:
            return made(verify=verify, cert=cert, trust_env=trust_env)
        # What else decides the context: the variables httpx reads.
        key = (trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if key not in shared:
            shared[key] = made(verify=verify, cert=cert, trust_env=trust_env)
        return shared[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(default, "create_ssl_context", create_ssl_context)
        yield


@pytest.fixture(scope="session")
def azurite() -> Iterator[str]:
    """A connection string to a real Azurite, started once per test session."""
    with running_azurite() as conn:
        yield conn


@pytest.fixture(params=["local", "azure"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    """The same contract runs against both backends, each test on fresh names."""
    prefix = "t" + uuid.uuid4().hex[:12]
    storage: Storage
    if request.param == "local":
        storage = LocalStorage(tmp_path / "storage", prefix)
    else:
        storage = AzureStorage(prefix, connection_string=request.getfixturevalue("azurite"))
    yield storage
    storage.close()


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
        return ["--storage", f"local:{tmp_path / 'storage'}"], {}
    prefix = "c" + uuid.uuid4().hex[:10]
    return ["--storage", "azure"], {
        "AZURE_STORAGE_CONNECTION_STRING": request.getfixturevalue("azurite"),
        "RALLYPOINT_STORAGE_PREFIX": prefix,
    }


_Started = TypeVar("_Started", InProcessCoordinator, Coordinator)


def _starter(
    kind: Callable[[list[str], dict[str, str]], _Started],
    backend: tuple[list[str], dict[str, str]],
) -> Iterator[Callable[..., _Started]]:
    """What ``start`` and ``spawn`` yield: a function that starts a ``kind`` coordinator
    with the backend's flags and its own after them; all stop after the test."""
    args, env = backend
    started: list[_Started] = []

    def run(*extra: str) -> _Started:
        started.append(kind([*args, *extra], env).start())
        return started[-1]

    yield run
    for coordinator in started:
        coordinator.stop()


@pytest.fixture
def start(backend: tuple[list[str], dict[str, str]]) -> Iterator[Start]:
    """Starts coordinators in this process (``rallypoint serve`` flags after the
    backend's), each on its own port; all stop after the test."""
    yield from _starter(InProcessCoordinator, backend)


@pytest.fixture
def spawn(backend: tuple[list[str], dict[str, str]]) -> Iterator[Spawn]:
    """As ``start``, but each a ``rallypoint serve`` process: for tests that kill one,
    read its log, or run it beside other processes (their lane is e2e)."""
    yield from _starter(Coordinator, backend)


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[processes.Coordinator]:
    """A ``rallypoint serve`` process on local storage for torchrun's jobs (their lane is
    e2e), its log kept beside the test's files; a module may define its own."""
    storage = ["--storage", f"local:{tmp_path / 'storage'}"]
    c = processes.Coordinator(storage, log=tmp_path / "coordinator.log").start()
    yield c
    c.stop()


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
