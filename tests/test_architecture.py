"""The package's shape, read from the source with `ast` (nothing imported): no import cycle among
flashlet's modules, and no flashlet import hidden inside a function, where it would hide one.

Imports under `if TYPE_CHECKING:` are not counted: they never run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (importing module, or "*" for any; imported module or package) -> why the import waits until
# the function runs. Anything else is imported at the top of its module.
LOCAL_IMPORTS_ALLOWED = {
    ("*", "flashlet.kernels"): "Triton kernels: a CPU install may lack Triton, and whether "
                               "Triton interprets (TRITON_INTERPRET) is fixed at their import",
    ("flashlet.attention", "flashlet.attention.flashinfer_backend"):
        "the flashinfer package is optional: imported when that backend is chosen",
    ("flashlet.attention", "flashlet.attention.triton_backend"):
        "imports Triton: only when that backend is chosen",
    ("flashlet.runner.model_runner", "flashlet.attention.triton_backend"):
        "imports Triton: only where the fused path attends with a triton backend of its own",
    ("flashlet.__main__", "flashlet.llm"):
        "a command line: flag errors come before the engine's import, which takes seconds",
}


def package_modules(root: Path, package: str = "flashlet") -> dict[str, Path]:
    """Dotted module name -> source file, for every module of `package` under `root`."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The package modules an import statement loads (a `from m import name` loads m.name
    where that is a module, else m)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif node.level == 0 and node.module:
        names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                 else node.module for a in node.names]
    else:
        names = []  # relative imports: the project writes none (the rewrite tool would miss them)
    return [_nearest_module(name, modules) for name in names if _nearest_module(name, modules)]


def _nearest_module(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def module_imports(path: Path, modules: dict[str, Path]) -> list[tuple[int, str, bool]]:
    """(line, imported package module, inside a function) for each import in the file that
    runs (those under `if TYPE_CHECKING:` never do)."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(ast.Module(body=[other], type_ignores=[]), in_function)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((child.lineno, name, in_function)
                             for name in _imported_names(child, modules))
            visit(child, in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules its top-level imports load, their packages' __init__ included
    (except the importer's own packages, which are already loading)."""
    graph = {}
    for module, path in modules.items():
        targets = set()
        for _, name, in_function in module_imports(path, modules):
            if in_function:
                continue
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in modules and not f"{module}.".startswith(f"{target}."):
                    targets.add(target)
        graph[module] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def local_imports(modules: dict[str, Path]) -> list[tuple[str, int, str]]:
    """(importer, line, imported module) for each package import inside a function."""
    return [(module, line, name) for module, path in modules.items()
            for line, name, in_function in module_imports(path, modules) if in_function]


def allowed_by(importer: str, imported: str) -> tuple[str, str] | None:
    for key in LOCAL_IMPORTS_ALLOWED:
        who, what = key
        if who in ("*", importer) and (imported == what or imported.startswith(f"{what}.")):
            return key
    return None


def test_flashlet_has_no_import_cycle():
    cycle = find_cycle(import_graph(package_modules(ROOT)))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_flashlet_import_inside_a_function_except_the_allowed():
    hidden = [f"{importer}:{line} imports {name}"
              for importer, line, name in local_imports(package_modules(ROOT))
              if allowed_by(importer, name) is None]
    assert not hidden, ("import these at the top of the module (or add an entry, with its "
                        "reason, to LOCAL_IMPORTS_ALLOWED):\n" + "\n".join(hidden))


def test_every_allowed_local_import_is_still_used():
    used = {allowed_by(importer, name) for importer, _, name in local_imports(package_modules(ROOT))}
    assert set(LOCAL_IMPORTS_ALLOWED) <= used, set(LOCAL_IMPORTS_ALLOWED) - used


def _write(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package_modules(root, "pkg")


def test_the_reader_finds_a_cycle_and_a_hidden_import(tmp_path):
    modules = _write(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg.sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "import pkg.c\n",
        "c.py": "from pkg import a\n\ndef f():\n    from pkg.sub.b import x\n",
    })
    assert find_cycle(import_graph(modules)) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    assert local_imports(modules) == [("pkg.c", 4, "pkg.sub.b")]


@pytest.mark.parametrize("guard", ["TYPE_CHECKING", "typing.TYPE_CHECKING"])
def test_the_reader_skips_type_checking_imports_and_the_importers_own_package(tmp_path, guard):
    modules = _write(tmp_path, {
        "__init__.py": "from pkg import a\n",
        "a.py": f"import typing\nfrom typing import TYPE_CHECKING\nif {guard}:\n"
                "    from pkg import b\nelse:\n    import pkg.c\n",
        "b.py": "import pkg.a\n",
        "c.py": "",
    })
    graph = import_graph(modules)
    assert graph["pkg.a"] == {"pkg.c"}  # not b (type checking only), not pkg (a's own package)
    assert find_cycle(graph) is None
