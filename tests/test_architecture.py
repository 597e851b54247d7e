"""The package's shape: its import graph has no circle, its layers import only downwards, and no
daemon or client module grows past about 800 lines (docs/ARCHITECTURE.md).

The graph is read from the source with `ast`, not by importing: every `import infinity.x`,
`from infinity.x import y` and relative import of every module under infinity/ is an edge,
including those inside functions and under `if TYPE_CHECKING:`. A function-local import is still
a dependency (it runs the first time the function does, and then the same circle can bite), and a
type-checking one is a circle for mypy and for the reader, so both count. `from infinity.x import
y` points at the module infinity/x/y.py (or the package infinity/x/y/) when there is one, else at
infinity.x itself. Importing a submodule also runs its parent packages' __init__ files; that is
not counted as an edge of the importer (each package's own imports are edges of the package).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "infinity"
MAX_LINES = 800

Graph = dict[str, set[str]]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _all_modules() -> dict[str, Path]:
    """Every Python module of the package, by dotted name."""
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _compiled_modules() -> set[str]:
    """Extension modules (infinity._native): they import nothing of the package, but
    `from infinity import _native` names them, not the package."""
    return {_module_name(path.with_name(path.name.split(".")[0] + ".py"))
            for path in PACKAGE.rglob("*.so")}


def _imports_in(source: str, module: str, *, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that the source of `module` imports, wherever the import statement
    stands (module level, inside a function, under TYPE_CHECKING)."""

    def owner(name: str) -> str | None:
        """`name` if it is a module, else the nearest enclosing module (an attribute's owner)."""
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "infinity":
                    found.add(owner(alias.name) or alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # `from . import x` in a package's __init__ is relative to the package itself,
                # in a plain module to the package that holds it.
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "infinity":
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                found.add(submodule if submodule in known else owner(target) or target)
    found.discard(module)
    return found


def import_graph() -> Graph:
    """module -> the package's modules it imports, for every module of the package."""
    modules = _all_modules()
    known = set(modules) | _compiled_modules()
    graph: Graph = {name: set() for name in known}
    for name, path in modules.items():
        graph[name] = _imports_in(path.read_text(), name, is_package=path.name == "__init__.py",
                                  known=known)
    return graph


def find_cycle(graph: Graph) -> list[str] | None:
    """One import circle as the list of its modules (the first repeated at the end), or None."""
    visiting: list[str] = []
    on_path: set[str] = set()
    done: set[str] = set()

    def visit(module: str) -> list[str] | None:
        visiting.append(module)
        on_path.add(module)
        for imported in sorted(graph.get(module, ())):
            if imported in on_path:
                return visiting[visiting.index(imported):] + [imported]
            if imported not in done:
                cycle = visit(imported)
                if cycle:
                    return cycle
        visiting.pop()
        on_path.discard(module)
        done.add(module)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def reachable_from(graph: Graph, module: str) -> set[str]:
    """Every module that importing `module` can load, directly or through others."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for imported in graph.get(todo.pop(), ()):
            if imported not in seen:
                seen.add(imported)
                todo.append(imported)
    return seen


def _in_layer(module: str, layer: str) -> bool:
    return module == f"infinity.{layer}" or module.startswith(f"infinity.{layer}.")


def test_the_graph_counts_relative_function_local_and_type_checking_imports() -> None:
    # The reader of the graph must see every kind of import, or a circle could hide in one.
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import wire\n"
        "from .paths import RuntimeLayout\n"
        "if TYPE_CHECKING:\n"
        "    from infinity.client import Client\n"
        "def late():\n"
        "    import infinity.daemon.loop\n"
        "    from infinity import errors, __version__\n"
    )
    known = {"infinity", "infinity.errors", "infinity.client", "infinity.daemon",
             "infinity.daemon.loop", "infinity.protocol", "infinity.protocol.wire",
             "infinity.protocol.paths", "infinity.protocol.dtypes"}
    found = _imports_in(source, "infinity.protocol.dtypes", is_package=False, known=known)
    assert found == {"infinity.protocol.wire", "infinity.protocol.paths", "infinity.client",
                     "infinity.daemon.loop", "infinity.errors", "infinity"}


def test_the_graph_covers_every_module_of_the_package() -> None:
    graph = import_graph()
    # The tier manager's modules, the dispatcher and the client's, among all the others.
    for module in ("infinity", "infinity.daemon.catalog", "infinity.daemon.durability",
                   "infinity.daemon.eviction", "infinity.daemon.loads", "infinity.daemon.growth",
                   "infinity.daemon.restore", "infinity.daemon.residency",
                   "infinity.daemon.tiers", "infinity.daemon.policy",
                   "infinity.daemon.dispatch", "infinity.client.client", "infinity.cli.main"):
        assert module in graph
    assert "infinity.client" in graph["infinity"]  # the lazy `infinity.connect`


def test_the_import_graph_of_the_package_has_no_circle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_no_daemon_or_client_module_passes_800_lines() -> None:
    too_long = {}
    for folder in ("daemon", "client"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                too_long[str(path.relative_to(ROOT))] = lines
    assert too_long == {}, f"modules over {MAX_LINES} lines: {too_long}"


def test_client_monitor_and_torch_never_import_the_daemon() -> None:
    graph = import_graph()
    for layer in ("client", "monitor", "torch"):
        for module in sorted(m for m in graph if _in_layer(m, layer)):
            daemon = sorted(m for m in reachable_from(graph, module) if _in_layer(m, "daemon"))
            assert daemon == [], f"{module} imports {daemon}"


def test_the_protocol_imports_nothing_from_the_layers_above_it() -> None:
    graph = import_graph()
    above = ("client", "daemon", "monitor", "torch", "cli")
    for module in sorted(m for m in graph if _in_layer(m, "protocol")):
        reached = sorted(m for m in reachable_from(graph, module)
                         if any(_in_layer(m, layer) for layer in above))
        assert reached == [], f"{module} imports {reached}"
