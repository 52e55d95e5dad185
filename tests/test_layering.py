"""kiln/ stays readable: no import circle (counting function-level and TYPE_CHECKING imports,
parsed with ast), no module over 400 lines, no function over 80."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

KILN = Path(__file__).resolve().parents[1] / "kiln"


def module_graph() -> dict[str, set[str]]:
    """kiln module -> the kiln modules it imports anywhere in its file."""
    files = {}
    for path in KILN.rglob("*.py"):
        parts = list(path.relative_to(KILN.parent).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            for target in targets:
                module = known(target) if target.startswith("kiln") else None
                if module is not None and module != name:
                    graph[name].add(module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    found = [sorted(c) for c in circles(module_graph())]
    assert not found, f"import circle(s): {found}"


def test_modules_and_functions_stay_readable():
    """No module over 400 lines, no function over 80 (a longer one does several jobs)."""
    long_modules, long_functions = [], []
    for path in KILN.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > 400:
            long_modules.append(f"{path.relative_to(KILN.parent)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long_functions.append(f"{path.relative_to(KILN.parent)}:{node.lineno} {node.name}")
    assert not long_modules and not long_functions, (long_modules, long_functions)
