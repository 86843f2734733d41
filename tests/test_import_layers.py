"""The import map of pagedllm/ (docs/architecture.md, "Imports"): no circles, and every layer imports
only the layers below it. Read from the source (every `import` statement, also those under
TYPE_CHECKING and inside functions: a circle there is still a circle for a reader)."""

from __future__ import annotations

import ast
import os
from collections import defaultdict

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pagedllm")

# package -> the pagedllm packages it may import (besides itself and the top-level modules envs, __init__)
ALLOWED = {
    "engine": set(),  # the control plane: no torch, nothing of the data plane
    "ops": set(),
    "model": {"ops", "engine"},  # engine: plain config and message types only (checked below)
    "worker": {"model", "ops", "engine"},
    "bench": {"engine", "entrypoints", "worker", "model", "ops"},
    "entrypoints": {"engine", "worker", "model", "ops"},
    "default_model": set(),
}


def module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def modules() -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(d, f)
                out[module_name(p)] = p
    return out


def imports(path: str, name: str, known: set[str]) -> set[str]:
    """The pagedllm modules `name` imports (a `from pkg import mod` counts as importing pkg.mod)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    pkg = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, name, set(mods)) for name, path in mods.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def layer(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else None


def test_no_import_circles():
    found = circles(graph())
    assert not found, f"import circles: {found}"


def test_layers_import_downward_only():
    bad = []
    for mod, deps in graph().items():
        own = layer(mod)
        if own is None:
            continue
        for dep in deps:
            other = layer(dep)
            if other is not None and other != own and other not in ALLOWED[own]:
                bad.append(f"{mod} -> {dep}")
    assert not bad, "imports against the layers: " + ", ".join(sorted(bad))


def test_engine_imports_no_torch():
    """The control plane stays torch-free (docs/architecture.md)."""
    mods = modules()
    heavy = []
    for name, path in mods.items():
        if name.startswith("pagedllm.engine"):
            tree = ast.parse(open(path, encoding="utf-8").read())
            for node in ast.walk(tree):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                heavy += [f"{name}: {n}" for n in names if n.split(".")[0] in ("torch", "triton")]
    assert not heavy, heavy


def test_the_checker_sees_a_circle():
    """The circle finder is not vacuous: a planted two-module circle and a self-free chain."""
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    g = graph()
    assert "pagedllm.engine.scheduler_output" in g["pagedllm.engine.scheduler"]  # imports are read
    assert any(defaultdict(set, g)[m] for m in g)
