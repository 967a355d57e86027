"""No module reaches into another module's private names (``x._name``), or into another package's
private modules (``rljax.reward._plugin``) or private names (``from rljax.models.hf import _f``).

``ast`` only. An attribute ``X._y`` counts when ``X`` is not ``self`` / ``cls`` and not a name
this module defines at its top level (its own classes and objects may use their privates). What
remains is listed in :data:`ALLOWED`, each entry with its reason; a new entry needs one too.
"""

import ast

import import_graph as G

#: ``(file, "X._y" or imported module / name)`` -> why it is allowed.
ALLOWED = {
    ("rljax/reward/_worker.py", "os._exit"): "os._exit is the documented way to end a worker process without cleanup",
    ("rljax/data/_source.py", "tqdm_utils._active"): "TFDS keeps its progress-bar switch private; saved and restored "
                                                      "around a build to silence it",
    ("rljax/trace/prefetch.py", "x._npy_value"): "jax keeps a jax.Array's host copy in _npy_value (np.asarray fills "
                                                 "it the same way) and has no public setter; the prefetch thread's "
                                                 "copy must be the one every later host read of the array takes",
}


def _defined_at_top(tree: ast.Module) -> set:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def violations(root=G.REPO) -> list:
    out = []
    mods = G.modules(root)
    for name, path in mods.items():
        rel = str(path.relative_to(root))
        tree = ast.parse(path.read_text())
        own = _defined_at_top(tree)
        unit = G.unit(name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name):
                x = node.value.id
                if x not in ("self", "cls") and x not in own:
                    out.append((rel, node.lineno, f"{x}.{node.attr}"))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rljax."):
                target = node.module
                parts = target.split(".")
                other = G.unit(target) != unit
                if other and len(parts) > 2 and any(_private(p) for p in parts[2:]):
                    out.append((rel, node.lineno, target))  # another package's private module
                elif other:
                    for a in node.names:
                        if _private(a.name) and f"{target}.{a.name}" not in mods:
                            out.append((rel, node.lineno, f"{target}.{a.name}"))
    return out


def test_no_reaching_into_other_modules_privates():
    found = [(f, line, what) for f, line, what in violations() if (f, what) not in ALLOWED]
    msgs = [f"{f}:{line}: {what} reaches into another module's private name: make it public where it lives (no "
            f"underscore, exported by its package) and use that, or add ({f!r}, {what!r}) to ALLOWED in "
            f"tests/project/test_private_access.py with the reason" for f, line, what in found]
    assert not msgs, "\n".join(msgs)


def test_every_allowed_entry_is_still_needed():
    used = {(f, what) for f, _, what in violations()}
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED entries no longer needed (remove them from tests/project/test_private_access.py): {stale}"
