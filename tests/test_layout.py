"""The package's shape: no import cycle, no module over 450 lines, no function over 80, and `import cprag`
loads no torch (the model loads when a command needs it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "cprag"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80  # from the decorators down; a CLI command's from its body (its option declarations aside)


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its file, function bodies (lazy imports) included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in names:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
    return targets


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on_stack, groups, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return groups


def test_no_import_cycle():
    found = modules()
    # a package's __init__ re-exporting its children is not a cycle of theirs: parents are left out as targets
    graph = {name: {t for t in imported(name, path, set(found)) if not name.startswith(t + ".")}
             for name, path in found.items()}
    assert cycles(graph) == []


def test_modules_and_functions_are_short():
    long_modules, long_functions = [], []
    for name, path in modules().items():
        lines = path.read_text().count("\n")
        if lines > MAX_MODULE_LINES:
            long_modules.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                if name.startswith("cprag.cli"):
                    start = node.body[0].lineno
                length = node.end_lineno - start + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}.{node.name}: {length} lines")
    assert long_modules == []
    assert long_functions == []


def test_importing_cprag_loads_no_torch():
    code = ("import sys, cprag, cprag.cli; "
            "print(sorted(m for m in ('torch', 'transformers', 'lancedb') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
