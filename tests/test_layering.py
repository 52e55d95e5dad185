"""Import circles in kiln/, counting function-level and TYPE_CHECKING imports (parsed with ast).

The goal is none. One circle is left from before the layering work (kernels -> engine cache ->
convert/build -> models/quantization -> layers -> back), listed in ``KNOWN_CIRCLE``: this test
fails when a new circle appears or a module joins that one, and when a module leaves it
(then drop it from the list, so the circle can only shrink).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

KILN = Path(__file__).resolve().parents[1] / "kiln"

KNOWN_CIRCLE = {
    "kiln.build", "kiln.build.builder", "kiln.checkpoint.loader", "kiln.convert", "kiln.engine_cache",
    "kiln.kernels", "kiln.layers.attention", "kiln.layers.embedding", "kiln.layers.linear", "kiln.layers.mlp",
    "kiln.layers.moe", "kiln.layers.normalization", "kiln.models", "kiln.models.base", "kiln.models.bloom",
    "kiln.models.falcon", "kiln.models.gemma", "kiln.models.gemma2", "kiln.models.gpt2", "kiln.models.gpt_neox",
    "kiln.models.gptj", "kiln.models.llama", "kiln.models.llava", "kiln.models.mixtral",
    "kiln.models.native_decode", "kiln.models.opt", "kiln.models.phi", "kiln.models.phi3", "kiln.models.qwen",
    "kiln.models.qwen2_moe", "kiln.quantization", "kiln.quantization.awq", "kiln.quantization.calibration",
    "kiln.quantization.fp8", "kiln.quantization.gptq", "kiln.quantization.gptq_quantize",
    "kiln.quantization.kv_cache", "kiln.quantization.smoothquant", "kiln.quantization.weight_only",
    "kiln.runtime.attention", "kiln.runtime.kv_cache",
}


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


def test_no_import_circle_but_the_known_one_and_it_only_shrinks():
    found = circles(module_graph())
    new = [sorted(c) for c in found if not c <= KNOWN_CIRCLE]
    assert not new, f"new import circle(s): {new}"
    remaining = set().union(*found) if found else set()
    assert remaining == KNOWN_CIRCLE, f"left the circle (drop them from KNOWN_CIRCLE): {sorted(KNOWN_CIRCLE - remaining)}"
