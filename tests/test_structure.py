"""The package's structure: what one package may import from another.

Each subpackage (``rallypoint.client``, ``.service``, ``.trainer``, ``.localfs``,
``.cli``, and ``rallypoint``'s own top-level modules as one more) keeps its
implementation in private modules (``_name``) and shares what others need through public
ones. So does each package nested in one (``rallypoint.trainer.checkpoint``,
``.trainer.memory``, ``.trainer.agent``, ``.service.storage``, ...): its privates are
visible inside it and the packages nested in it, never to its parent or its siblings.
A private module imported from outside its package is a coupling nobody sees from the
outside: it breaks when its owner reorganizes, so it fails here, read from the source
with ``ast``. No module imports one that imports it back (the trainer's layers:
the checkpoint path over the memory tier, regrouping over the agent's board). The tests
share helpers through ``tests/_*.py`` and ``conftest.py``, never one test module
importing another.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Callable, Iterator
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


def _visible(private: str, package: str) -> bool:
    """Whether a module of ``package`` may import ``private`` (a private module or name):
    from inside the package that holds it, or a package nested in it. ``rallypoint``'s
    own top-level privates are its top-level modules' alone."""
    holder = private.rpartition(".")[0]
    if holder == "rallypoint":
        return package == "rallypoint"
    return package == holder or package.startswith(holder + ".")


def cross_package_private_imports() -> list[str]:
    """``path:line: importer imports name`` for each private module (or name) of another
    package that a module of the package imports, once per import statement."""
    settings = _setuptools()
    subpackages = {p for p in settings["packages"] if p.count(".") == 1}
    found: dict[str, None] = {}
    for module, is_package, path in _modules():
        package = module if is_package else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in _imported(tree, module, is_package):
            if not (name == "rallypoint" or name.startswith("rallypoint.")):
                continue
            private = _private_part(name, _owner(name, subpackages))
            if private is None:
                private = _private_part(name, "rallypoint")  # in a nested package's part
            if private is not None and not _visible(private, package):
                found[f"{path.relative_to(ROOT)}:{line}: {module} imports {private}"] = None
    return list(found)


def import_cycles(root: str) -> list[list[str]]:
    """The cycles among the modules under ``root`` (a package's dotted name): module A
    imports B when any of its imports, at the top or inside a function or a
    ``TYPE_CHECKING`` block, names B or something in B. Each cycle once, from its
    smallest module."""
    modules = {name: (is_package, path) for name, is_package, path in _modules()}
    inside = {m for m in modules if m == root or m.startswith(root + ".")}
    graph: dict[str, set[str]] = {}
    for module in inside:
        is_package, path = modules[module]
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = graph.setdefault(module, set())
        for _, name in _imported(tree, module, is_package):
            # The longest module the name lies in: "a.b.C" is module a.b's C.
            parts = name.split(".")
            target = next(
                (
                    ".".join(parts[:i])
                    for i in range(len(parts), 0, -1)
                    if ".".join(parts[:i]) in inside
                ),
                None,
            )
            if target is not None and target != module:
                edges.add(target)
    cycles: dict[tuple[str, ...], None] = {}

    def walk(node: str, trail: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in trail:
                cycle = trail[trail.index(nxt) :]
                start = cycle.index(min(cycle))
                cycles[tuple(cycle[start:] + cycle[:start])] = None
            elif len(trail) < 12:
                walk(nxt, [*trail, nxt])

    for module in sorted(inside):
        walk(module, [module])
    return [list(c) for c in cycles]


def test_no_module_imports_another_subpackages_private_module() -> None:
    found = cross_package_private_imports()
    assert not found, (
        f"{len(found)} imports reach into another subpackage's private modules; import "
        "its public API instead (export what is needed in its __init__ or a public "
        "module):\n" + "\n".join(found)
    )


def test_no_module_imports_one_that_imports_it_back() -> None:
    """Across the whole package, the service's rules and records as much as the
    trainer's layers. A package's ``__init__`` imports its parts, so a part importing its
    own package (or a module importing one that imports it back, if only under
    ``TYPE_CHECKING``) is a cycle too; ``examples`` are scripts, outside the package's
    graph."""
    cycles = [c for c in import_cycles("rallypoint") if not any(".examples" in m for m in c)]
    assert not cycles, "import cycles among the package's modules:\n" + "\n".join(
        " -> ".join([*c, c[0]]) for c in cycles
    )


def test_the_trainer_is_laid_out_by_role() -> None:
    """The families of parts that run in different processes live in their own packages:
    the worker's checkpoint path, the memory tier, the agent's side; each framework
    adapter is one public module over one private one."""
    trainer = ROOT / "trainer"
    for package, parts in {
        "checkpoint": {"_manager.py", "_dcp.py", "_staging.py", "_transfer.py"},
        "memory": {"_tier.py", "_peers.py"},
        "agent": {"_plugin.py", "_rendezvous.py", "_store.py", "_launch.py", "_board.py"},
    }.items():
        assert parts <= {p.name for p in (trainer / package).glob("*.py")}, package
    for framework in ("lightning", "transformers", "deepspeed"):
        assert (trainer / f"_{framework}.py").is_file(), framework
        public = ast.parse((trainer / f"{framework}.py").read_text())
        defined = [n for n in public.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
        assert not defined, (
            f"{framework}.py defines {[n.name for n in defined]}: put them in _{framework}.py"
        )


def test_the_checks_see_nested_privates_and_cycles() -> None:
    """The checkers themselves, on names they must refuse and allow."""
    assert _visible("rallypoint.trainer._bytes", "rallypoint.trainer.checkpoint")
    assert _visible("rallypoint.trainer.memory._tier", "rallypoint.trainer.memory")
    assert not _visible("rallypoint.trainer.memory._tier", "rallypoint.trainer")
    assert not _visible("rallypoint.trainer.memory._tier", "rallypoint.trainer.checkpoint")
    assert not _visible("rallypoint._version", "rallypoint.trainer")
    assert _private_part("rallypoint.trainer.memory._tier.NodeMemory", "rallypoint") == (
        "rallypoint.trainer.memory._tier"
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


def _test_module_in(name: str, exists: Callable[[Path], bool] = Path.is_file) -> str | None:
    """The test module (``test_*.py`` in ``tests/`` or a folder of it) that an imported
    ``name`` is, or lies in; None if none."""
    parts = name.split(".")
    if parts[0] != "tests":
        return None
    for i, part in enumerate(parts[1:], 1):
        if not part.startswith("test_"):
            continue
        # "tests.test_a.b" is test_a's b; "tests.test_a" may be a module or a name.
        if i < len(parts) - 1 or exists(ROOT.joinpath(*parts[: i + 1]).with_suffix(".py")):
            return ".".join(parts[: i + 1])
    return None


def imports_of_test_modules() -> list[str]:
    """``path:line: module imports test_module`` for each test module that a module
    under ``tests/`` imports, or imports something from."""
    found: dict[str, None] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        parts = ["tests", *path.relative_to(ROOT / "tests").with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in _imported(tree, module, is_package):
            target = _test_module_in(name)
            if target is not None:
                found[f"{path.relative_to(ROOT)}:{line}: {module} imports {target}"] = None
    return list(found)


def test_no_test_module_imports_another() -> None:
    """Helpers the tests share live in ``tests/_*.py`` and fixtures in ``conftest.py``:
    a test module imported by another runs its tests' imports, fixtures and marks twice
    over, and moving or trimming it breaks tests that are not its own."""
    found = imports_of_test_modules()
    assert not found, "test modules import other test modules:\n" + "\n".join(found)


def test_the_check_sees_test_modules_imported_any_way() -> None:
    source = (
        "from .. import test_torchrun\n"
        "from ..test_cli import cli\n"
        "import tests.test_x as x\n"
        "from .test_b import helper\n"
        "from .._support import spec, test_name\n"
        "from . import conftest\n"
    )
    got = list(_imported(ast.parse(source), "tests.client.test_a", False))
    found = [_test_module_in(name, lambda path: path.stem != "test_name") for _, name in got]
    assert found == [
        "tests.test_torchrun",
        "tests.test_cli",
        "tests.test_x",
        "tests.client.test_b",
        None,
        None,
        None,
    ]


if __name__ == "__main__":
    print("\n".join(cross_package_private_imports()))


def test_the_readme_fits_in_300_lines() -> None:
    """What it is, the quick starts, the smallest examples and the headline figures; the
    rest lives in docs/ (issue 37: a README a newcomer reads to the end)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move detail to docs/"
