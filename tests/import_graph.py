"""The import graph of relayline's own code, read from the source (no module is imported), and its
cycles.

Every import statement counts wherever it stands: at the top of a module, inside a function (a
lazy import still ties the two modules together: each needs the other to work), and under
`if TYPE_CHECKING:` (the annotation still names the other module). Two graphs are read: the
package (machines/, adapters/, specs/ as `relayline.*`) and bench/ with bench/probes/, whose
scripts import each other by their bare names (each puts bench/ on sys.path).

    python tests/import_graph.py    # every cycle, then the count
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Container, Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_FOLDERS = {"machines": "relayline.machines", "adapters": "relayline.adapters", "specs": "relayline.specs"}
MAX_CYCLES = 10_000  # the enumeration stops here: a graph this tangled needs no exact count

Graph = Mapping[str, frozenset[str]]


def package_modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its __init__)."""
    modules: dict[str, Path] = {}
    for folder, dotted in PACKAGE_FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((dotted, *parts))] = path
    return modules


def bench_modules() -> dict[str, Path]:
    """The standing benches and the probes under bench/probes/, by bare name: a probe puts bench/
    on sys.path and imports the standing ones as they import each other."""
    paths = [*sorted((ROOT / "bench").glob("*.py")), *sorted((ROOT / "bench" / "probes").glob("*.py"))]
    return {path.stem: path for path in paths}


def _imported_names(tree: ast.AST, module: str, is_package: bool, known: Container[str]) -> Iterator[str]:
    """Each dotted name the module imports, relative imports resolved: for `from X import Y`,
    X.Y when it is a module, else X (whose __init__ holds Y). A package's __init__ that runs
    only because a module inside it is imported is not an edge: it is how Python loads, not a
    dependency the code chose."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                if not is_package:
                    anchor = anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield submodule if submodule in known else base


def import_graph(modules: Mapping[str, Path]) -> dict[str, frozenset[str]]:
    """module -> the modules among `modules` it imports (itself excepted)."""
    graph: dict[str, frozenset[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        names = _imported_names(tree, module, path.name == "__init__.py", modules)
        graph[module] = frozenset(name for name in names if name in modules and name != module)
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's components with more than one module (each holds at least one cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def cycles(graph: Graph) -> list[tuple[str, ...]]:
    """Every elementary cycle, each once: it starts at its least module and returns to it (at
    most MAX_CYCLES of them)."""
    found: list[tuple[str, ...]] = []
    for component in strongly_connected(graph):
        members = set(component)
        for start in component:
            path = [start]
            # depth first from `start` through modules greater than it, so each cycle is found
            # from its least module only
            frontier = [iter(sorted(n for n in graph[start] if n in members and n >= start))]
            while frontier and len(found) < MAX_CYCLES:
                step = next(frontier[-1], None)
                if step is None:
                    frontier.pop()
                    path.pop()
                elif step == start:
                    found.append((*path, start))
                elif step not in path:
                    path.append(step)
                    frontier.append(iter(sorted(n for n in graph[step] if n in members and n >= start)))
    return found


def main() -> int:
    total = 0
    for name, modules in (("package", package_modules()), ("bench", bench_modules())):
        found = cycles(import_graph(modules))
        for cycle in found:
            print(f"{name}: {' -> '.join(cycle)}")
        print(f"{name}: {len(found)} import cycles")
        total += len(found)
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
