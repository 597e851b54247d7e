"""The tier manager's modules each own one job: small, and no import circle runs through them."""

import ast
from pathlib import Path

DAEMON = Path(__file__).resolve().parent.parent / "infinity" / "daemon"

# The catalog and the modules TierManager was cut into (see infinity/daemon/tiers.py).
TIER_MODULES = ["catalog", "diskcopy", "residency", "growth", "eviction", "loads", "durability",
                "restore", "tiers", "policy"]


def _daemon_imports(module: str) -> set[str]:
    """The infinity.daemon modules `module` imports, at run time or for type checking."""
    tree = ast.parse((DAEMON / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("infinity.daemon."):
                found.add(name.split(".")[2])
    return found


def test_no_import_circle_runs_through_a_tier_module() -> None:
    graph = {path.stem: _daemon_imports(path.stem) for path in DAEMON.glob("*.py")}
    for start in TIER_MODULES:
        seen: set[str] = set()
        todo = list(graph[start])
        while todo:
            module = todo.pop()
            assert module != start, f"infinity.daemon.{start} imports itself through a circle"
            if module not in seen and module in graph:
                seen.add(module)
                todo.extend(graph[module])


def test_each_tier_module_stays_small() -> None:
    for module in TIER_MODULES:
        lines = len((DAEMON / f"{module}.py").read_text().splitlines())
        assert lines <= 800, f"infinity/daemon/{module}.py has {lines} lines"
