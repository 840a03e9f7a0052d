"""The house's arrows run one way (DESIGN.md, Layout): the ground floor (``common``) imports no
component, and no two packages import each other, in particular ``backend`` and ``profiler`` (the
runtimes that both use live in ``common.runtimes``). Imports are read with ``ast``, lazy ones inside
functions included, so a cycle cannot hide behind an import done at call time."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("common", "backend", "frontend", "globalsched", "profiler", "nexus")


def imported_packages(package: str) -> dict[str, set[str]]:
    """Top-level project packages that ``package`` imports -> the files that import them."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in PACKAGES and top != package:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


GRAPH = {p: imported_packages(p) for p in PACKAGES}


def test_every_package_imports():
    import importlib

    for p in PACKAGES:
        importlib.import_module(p)
    importlib.import_module("common.runtimes")


def test_backend_and_profiler_do_not_import_each_other():
    assert "backend" not in GRAPH["profiler"], GRAPH["profiler"].get("backend")
    assert not ("profiler" in GRAPH["backend"] and "backend" in GRAPH["profiler"])


def test_the_ground_floor_imports_no_component():
    assert set(GRAPH["common"]) == set(), GRAPH["common"]


def test_nothing_imports_the_roof():
    users = {p: files for p, deps in GRAPH.items() for d, files in deps.items() if d == "nexus"}
    assert users == {}, users


def test_no_import_cycle_between_packages():
    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for dep in GRAPH[todo.pop()]:
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    cycles = [p for p in PACKAGES if p in reach(p)]
    assert cycles == [], {p: GRAPH[p] for p in cycles}
