"""The distribution's shape: one import package, extras that keep installs honest."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_holds_only_the_rallypoint_package(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("rallypoint-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"rallypoint"}
    for module in (
        "rallypoint/cli/__init__.py",
        "rallypoint/cli/processes.py",
        "rallypoint/client/__init__.py",
        "rallypoint/client/py.typed",
        "rallypoint/localfs/_fileurl.py",
        "rallypoint/service/routers/jobs.py",
        "rallypoint/service/storage/_local_table.py",
        "rallypoint/trainer/checkpoint/_transfer.py",
        "rallypoint/trainer/agent/_plugin.py",
        "rallypoint/trainer/memory/_tier.py",
    ):
        assert module in names
    meta = next(n for n in names if n.endswith("/METADATA"))
    requires = [
        line
        for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines()
        if line.startswith("Requires-Dist:")
    ]
    base = [line for line in requires if "extra ==" not in line]
    assert sorted(r.split()[1].split(">")[0] for r in base) == ["httpx", "pydantic"]


def fresh(code: str) -> str:
    """What ``code`` prints in a new interpreter: imports as a new process makes them."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_the_client_imports_nothing_heavy() -> None:
    code = (
        "import sys, rallypoint.client, rallypoint.localfs; "
        "heavy = {'torch', 'fastapi', 'azure', 'starlette', 'uvicorn'}; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))"
    )
    assert fresh(code) == "[]"


def test_the_service_imports_no_torch() -> None:
    code = (
        "import sys, rallypoint.service.app, rallypoint.service.storage._azure_blob; "
        "print('torch' in sys.modules)"
    )
    assert fresh(code) == "False"


def test_torchruns_agent_loads_no_checkpoint_path() -> None:
    # The agent loads its plugin through rallypoint.trainer; DCP (torch.distributed.tensor,
    # sympy) is 1.4 s of CPU at every agent start for a path only the workers run.
    code = (
        "import sys, rallypoint.trainer.agent._plugin; "
        "print(sorted(m for m in ('torch.distributed.checkpoint', 'sympy', "
        "'rallypoint.trainer.checkpoint') if m in sys.modules))"
    )
    assert fresh(code) == "[]"


def test_every_public_trainer_name_resolves() -> None:
    # The checkpoint path's names load on first use: each must still be there, and dir()
    # must show them before they are.
    code = (
        "import rallypoint.trainer as t; missing = set(t.__all__) - set(dir(t)); "
        "print(sorted(missing), all(getattr(t, n) is not None for n in t.__all__))"
    )
    assert fresh(code) == "[] True"


def test_base_install_runs_the_client_alone(tmp_path: Path) -> None:
    """A fresh venv with only the base install: the client imports; the rest says why not."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(ROOT)],
        check=True,
        timeout=600,
    )
    check = subprocess.run(
        [
            str(py),
            "-c",
            "import rallypoint.client, rallypoint.localfs, importlib.util as u; "
            "print([m for m in ('torch','fastapi','azure') if u.find_spec(m)])",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert check.stdout.strip() == "[]"
    serve = subprocess.run(
        [str(venv / "bin" / "rallypoint"), "serve"], capture_output=True, text=True, cwd=tmp_path
    )
    assert serve.returncode == 2
    assert "pip install 'rallypoint[service]'" in serve.stderr
