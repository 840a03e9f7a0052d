"""The house's arrows run one way (docs/architecture.md, "Layout"): the ground floor (``common``) imports no
component, no two packages import each other, in particular ``backend`` and ``profiler`` (the
runtimes that both use live in ``common.runtimes``), and no two files import each other, directly or
around a circle (GUIDE: "No two files import each other"). Imports are read with ``ast``, lazy ones
inside functions included, so a cycle cannot hide behind an import done at call time."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("common", "backend", "frontend", "globalsched", "profiler", "nexus", "harness")


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
    """``nexus`` (the CLI) is imported only by the development harness above it, and nothing of the
    product imports the harness."""
    users = {p: files for p, deps in GRAPH.items() for d, files in deps.items() if d == "nexus"}
    assert set(users) <= {"harness"}, users
    harness_users = {p: files for p, deps in GRAPH.items() for d, files in deps.items() if d == "harness"}
    assert harness_users == {}, harness_users


def test_the_harness_is_not_shipped():
    """The wheel's packages (pyproject's find include) leave the harness out."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not any(pattern.startswith("harness") for pattern in include), include
    assert "nexus*" in include


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


# ---- circles between files --------------------------------------------------------------------------


def _module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the project's packages (a package is its __init__)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


MODULES = _module_files()


def imported_modules(module: str, source: str, is_package: bool, known) -> set[str]:
    """The modules of ``known`` that ``module`` (whose text is ``source``) names in an import
    statement, at the top or inside a function.

    ``from p import x`` counts as an import of ``p.x`` when that is a module, else of ``p`` itself;
    ``import p.q`` of the longest known prefix; relative imports are resolved against the module's
    package. Parent packages that Python imports on the way are not counted: they are not what the
    file asked for."""
    package = module if is_package else module.rpartition(".")[0]

    def deepest(name: str) -> str | None:
        while name:
            if name in known:
                return name
            name = name.rpartition(".")[0]
        return None

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            resolved = deepest(target)
            if resolved and resolved != module:
                found.add(resolved)
    return found


FILE_GRAPH = {m: imported_modules(m, path.read_text(), path.name == "__init__.py", MODULES)
              for m, path in MODULES.items()}


def file_cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components)


def test_no_two_files_import_each_other():
    cycles = file_cycles(FILE_GRAPH)
    assert cycles == [], {c: {m: sorted(FILE_GRAPH[m] & set(c)) for m in c} for c in cycles}


def test_the_file_circle_check_sees_lazy_and_relative_imports():
    """The check itself: imports inside functions and relative ones are edges, and circles are found."""
    known = {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"}
    lazy = "import os\n\ndef f():\n    from pkg.b import thing\n    import pkg.sub.c\n"
    assert imported_modules("pkg.a", lazy, False, known) == {"pkg.b", "pkg.sub.c"}
    relative = "from . import a\nfrom .. import b\nfrom ..sub import c\nfrom pkg import name_not_a_module\n"
    assert imported_modules("pkg.sub.c", relative, False, known) == {"pkg.sub", "pkg.b", "pkg"}
    assert imported_modules("pkg.sub", "from . import c\n", True, known) == {"pkg.sub.c"}
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}, "b.p": {"b.q"}, "b.q": set()}
    assert file_cycles(graph) == [("a.x", "a.y", "a.z")]
    assert file_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [("a", "b"), ("c", "d")]


def test_tests_and_benchmarks_do_not_import_each_other():
    """What both need lives in the development harness (harness/) or below it."""
    def importers(folder: str, target: str) -> list[str]:
        found = []
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                         else [])
                if any(n.split(".")[0] == target for n in names):
                    found.append(str(path.relative_to(ROOT)))
        return found

    assert importers("tests", "benchmarks") == []
    assert importers("benchmarks", "tests") == []


def test_no_test_module_imports_another():
    """A helper two test files need lives in a module that is not a test file (tests/components.py,
    tests/e2e/load_under_faults.py, ...): importing a test file drags in its fixtures and collection."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            found += [f"{path.relative_to(ROOT)} imports {n}" for n in names
                      if n.startswith("tests.") and n.rpartition(".")[2].startswith("test_")]
    assert found == []
