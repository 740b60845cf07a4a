"""The package's structure: what one subpackage may import from another.

Each subpackage (``rallypoint.client``, ``.service``, ``.trainer``, ``.localfs``,
``.cli``, and ``rallypoint``'s own top-level modules as one more) keeps its
implementation in private modules (``_name``) and shares what others need through public
ones. A private module imported from another subpackage is a coupling nobody sees from
the outside: it breaks when its owner reorganizes, so it fails here, read from the source
with ``ast``.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: tomli, where installed
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent


def _setuptools() -> dict[str, Any]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        settings: dict[str, Any] = tomllib.load(f)["tool"]["setuptools"]
    return settings


def _modules() -> Iterator[tuple[str, bool, Path]]:
    """(module name, is a package's ``__init__``, path) of every module under the
    subpackages' folders, listed in ``packages`` or not."""
    settings = _setuptools()
    for package, folder in settings["package-dir"].items():
        if package.count(".") > 1:
            continue  # a nested package: walked from its subpackage's folder
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [*package.split("."), *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                yield ".".join(parts[:-1]), True, path
            else:
                yield ".".join(parts), False, path


def _owner(module: str, subpackages: set[str]) -> str:
    """The subpackage a module belongs to: ``rallypoint.X`` or ``rallypoint`` itself."""
    parts = module.split(".")
    if len(parts) > 1 and f"rallypoint.{parts[1]}" in subpackages:
        return f"rallypoint.{parts[1]}"
    return "rallypoint"


def _imported(tree: ast.Module, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of everything ``module`` imports, relative imports resolved;
    ``from M import N`` yields ``M.N``, as N may be a submodule."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                yield node.lineno, source if alias.name == "*" else f"{source}.{alias.name}"


def _private_part(name: str, owner: str) -> str | None:
    """``name`` up to its first private segment inside ``owner``; None if it has none."""
    parts = name.split(".")
    for i in range(len(owner.split(".")), len(parts)):
        if parts[i].startswith("_") and not parts[i].startswith("__"):
            return ".".join(parts[: i + 1])
    return None


def cross_package_private_imports() -> list[str]:
    """``path:line: importer imports name`` for each private module (or name) of another
    subpackage that a module of the package imports, once per import statement."""
    settings = _setuptools()
    subpackages = {p for p in settings["packages"] if p.count(".") == 1}
    found: dict[str, None] = {}
    for module, is_package, path in _modules():
        owner = _owner(module, subpackages)
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in _imported(tree, module, is_package):
            if not (name == "rallypoint" or name.startswith("rallypoint.")):
                continue
            other = _owner(name, subpackages)
            private = _private_part(name, other)
            if other != owner and private is not None:
                found[f"{path.relative_to(ROOT)}:{line}: {module} imports {private}"] = None
    return list(found)


def test_no_module_imports_another_subpackages_private_module() -> None:
    found = cross_package_private_imports()
    assert not found, (
        f"{len(found)} imports reach into another subpackage's private modules; import "
        "its public API instead (export what is needed in its __init__ or a public "
        "module):\n" + "\n".join(found)
    )


def test_every_package_folder_ships() -> None:
    """A folder with an ``__init__.py`` under a mapped one is listed in ``packages``:
    setuptools leaves an unlisted one out of the wheel, and nothing here would notice."""
    settings = _setuptools()
    listed = {ROOT / folder for folder in settings["package-dir"].values()}
    unlisted = sorted(
        str(init.parent.relative_to(ROOT))
        for folder in set(listed)
        for init in folder.rglob("__init__.py")
        if init.parent not in listed and "__pycache__" not in init.parts
    )
    assert not unlisted, f"package folders missing from pyproject's packages: {unlisted}"


def test_the_image_copies_every_package_folder() -> None:
    """deploy/Dockerfile copies the source folder by folder: one left out fails the
    image's ``pip install`` (setuptools finds no directory for its package)."""
    settings = _setuptools()
    copied = set(re.findall(r"^COPY (\S+) ", (ROOT / "deploy" / "Dockerfile").read_text(), re.M))
    folders = {folder.split("/")[0] for folder in settings["package-dir"].values()}
    assert folders <= copied, f"not copied into the image: {sorted(folders - copied)}"


def test_the_check_sees_relative_and_aliased_imports() -> None:
    """The checker itself: what it resolves, so that a pass means something."""
    source = (
        "import rallypoint.client._client as c\n"
        "from rallypoint.client import _models\n"
        "from ..client._models import JobSpec\n"
        "from ..cli import _demo\n"
        "from ._checkpoints import Checkpoints\n"
        "from .storage._names import check_key\n"
    )
    got = list(_imported(ast.parse(source), "rallypoint.service.app", False))
    assert [name for _, name in got] == [
        "rallypoint.client._client",
        "rallypoint.client._models",
        "rallypoint.client._models.JobSpec",
        "rallypoint.cli._demo",
        "rallypoint.service._checkpoints.Checkpoints",
        "rallypoint.service.storage._names.check_key",
    ]
    subpackages = {"rallypoint.cli", "rallypoint.client", "rallypoint.service"}
    private = [
        _private_part(name, _owner(name, subpackages))
        for _, name in got
        if _owner(name, subpackages) != "rallypoint.service"
    ]
    assert private == [
        "rallypoint.client._client",
        "rallypoint.client._models",
        "rallypoint.client._models",
        "rallypoint.cli._demo",
    ]


if __name__ == "__main__":
    print("\n".join(cross_package_private_imports()))
