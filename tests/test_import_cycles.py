"""No import cycle among the modules of any of the project's packages (common/, proxy/, the
workers', deploy/, benchmarks/, tests/), type-only ones included.

A cycle is where the folder tree stops being the architecture diagram: two modules each need the
other, so neither can be read, tested or replaced alone. The graph is read from the source (every
`import` and `from ... import` anywhere in a module: at the top, under `TYPE_CHECKING`, or inside
a function, where an import is often put to dodge a cycle at run time), so what it checks does
not depend on which optional libraries load here. An edge goes to the module named (a submodule
when `from package import name` names one), not to the packages above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "proxy", "prefill_server", "decode_server", "deploy", "benchmarks", "tests")


def module_names(package: str) -> dict[str, Path]:
    names = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level - 1` above this one
                anchor = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {target for target in found if target in known and target != name}


def import_graph(package: str) -> dict[str, set[str]]:
    names = module_names(package)
    return {name: imports_of(name, path, set(names)) for name, path in names.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_in(package):
    found = cycles(import_graph(package))
    assert not found, f"import cycles among {package}'s modules:\n" + "\n".join(
        " ↔ ".join(c) for c in found
    )


if __name__ == "__main__":  # print the cycles, for a look while cutting them
    for package in PACKAGES:
        for component in cycles(import_graph(package)):
            print(" ↔ ".join(component))
