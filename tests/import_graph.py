"""The import graph of the ``rljax`` package, from its source (``ast`` only: nothing is imported).

Every ``import`` / ``from ... import`` statement counts, at module level or deferred inside a
function (a deferred import is still a dependency; it only runs later). ``from a.b import c``
is an edge to ``a.b.c`` when that is a module of the package, else to ``a.b``; a relative
import is resolved against its package. Used by ``tests/project/test_import_layers.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import os
import re
import tokenize
from pathlib import Path
from typing import Optional

from repo_paths import REPO

PACKAGE = "rljax"


@dataclasses.dataclass(frozen=True)
class Edge:
    src: str  # importing module, e.g. "rljax.trainer.stages"
    dst: str  # imported module, e.g. "rljax.sharding.transfer"
    path: str  # repository-relative file of src
    line: int
    deferred: bool  # inside a function / class body rather than at module level
    reason: Optional[str] = None  # a deferred import's comment: on its line, or the comment line above its block


def modules(root: Path = REPO) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` file of the package."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _top_level_nodes(tree: ast.Module) -> set[int]:
    """ids of import nodes that run at import time (module body, also under if/try at module level)."""
    out, stack = set(), list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.add(id(node))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                stack.extend(getattr(node, field, []) or [])
        elif isinstance(node, ast.ExceptHandler):
            stack.extend(node.body)
    return out


def _comments(source: str) -> dict[int, str]:
    """``{line: comment text}`` of every comment in ``source``."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _reason(node: ast.stmt, lines: list[str], comments: dict[int, str], import_lines: set[int]) -> Optional[str]:
    """The comment that says why an import is deferred: on one of its own lines, else on the
    comment-only line right above the block of import lines it belongs to."""
    for ln in range(node.lineno, node.end_lineno + 1):
        if comments.get(ln):
            return comments[ln]
    ln = node.lineno - 1
    while ln in import_lines:
        ln -= 1
    if ln >= 1 and lines[ln - 1].strip().startswith("#") and comments.get(ln):
        return comments[ln]
    return None


def edges(root: Path = REPO) -> list[Edge]:
    """Every import of a package module by a package module."""
    mods = modules(root)
    out = []
    for name, path in mods.items():
        source = path.read_text()
        tree = ast.parse(source, filename=str(path))
        top = _top_level_nodes(tree)
        lines, comments = source.splitlines(), _comments(source)
        import_lines = {ln for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                        for ln in range(n.lineno, n.end_lineno + 1)}
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        rel = str(path.relative_to(root))
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
            for t in targets:
                if t == PACKAGE or t.startswith(PACKAGE + "."):
                    while t not in mods:  # `import rljax.x.y` of a name inside a module
                        t = t.rpartition(".")[0]
                    if t != name:
                        deferred = id(node) not in top
                        reason = _reason(node, lines, comments, import_lines) if deferred else None
                        out.append(Edge(name, t, rel, node.lineno, deferred, reason))
    return out


def unit(module: str) -> str:
    """The layer unit of a module: its top-level sub-package or module (``rljax.trainer.loop`` ->
    ``trainer``, ``rljax.errors`` -> ``errors``); the root package itself is ``rljax``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def declared_layers(root: Path = REPO) -> list[list[str]]:
    """The layer order written in ``rljax/__init__.py``'s docstring, top layer first.

    The indented block after the paragraph that starts ``Layers, top to bottom``: one layer a
    line, its units comma-separated before the first run of two spaces (the rest describes it).
    """
    doc = ast.get_docstring(ast.parse((root / PACKAGE / "__init__.py").read_text())) or ""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Layers, top to bottom"))
    layers, i = [], start + 1
    while i < len(lines) and not lines[i].startswith("    "):  # the heading's sentence
        i += 1
    while i < len(lines) and lines[i].startswith("    "):
        names = re.split(r"\s{2,}", lines[i].strip())[0]
        layers.append([n.strip() for n in names.split(",") if n.strip()])
        i += 1
    return layers


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each as a cycle path."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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
                out.append(_cycle_path(graph, set(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _cycle_path(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """One concrete cycle through a strongly connected component: ``[a, b, ..., a]``."""
    start = min(comp)
    prev, queue = {start: None}, [start]
    while queue:  # breadth-first back to start, inside the component
        v = queue.pop(0)
        for w in sorted(graph.get(v, ())):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
            if w in comp and w not in prev:
                prev[w] = v
                queue.append(w)
    return sorted(comp)
