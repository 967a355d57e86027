"""Imports only point down: no import cycle, no edge sideways or up the declared layer order.

The layer order is the block ``Layers, top to bottom`` in ``rljax/__init__.py``'s docstring.
The graph comes from the source (:mod:`import_graph`, ``ast`` only), deferred imports included:
an import inside a function is still a dependency. Each failure names the edge (file:line),
the rule it breaks and how to fix it.
"""

import collections

import pytest

import import_graph as G

HOW_TO_FIX = ("move the shared code down into the lower package (or a leaf such as rljax.errors), pass it in as an "
              "argument, or, if the layer order itself is wrong, change the 'Layers, top to bottom' block in "
              "rljax/__init__.py's docstring")


@pytest.fixture(scope="module")
def edges():
    return G.edges()


def _layer_of(layers):
    out = {}
    for i, names in enumerate(layers):
        for n in names:
            out[n] = len(layers) - 1 - i  # 0 = bottom
    return out


def test_every_package_and_module_has_a_layer():
    layers = G.declared_layers()
    assert layers, "rljax/__init__.py's docstring has no 'Layers, top to bottom' block"
    rank = _layer_of(layers)
    units = {G.unit(m) for m in G.modules()}
    missing = sorted(units - set(rank))
    assert not missing, (f"rljax.{missing[0]} is in no layer: add it to the 'Layers, top to bottom' block of "
                         f"rljax/__init__.py's docstring (one line a layer, top first), below every package that "
                         f"imports it and above every package it imports")
    stale = sorted(set(rank) - units)
    assert not stale, f"the layer block names {stale}, which are not modules or packages of rljax: remove them"


def test_no_import_cycle(edges):
    graph = collections.defaultdict(set)
    where = {}
    for e in edges:
        graph[e.src].add(e.dst)
        where.setdefault((e.src, e.dst), e)
    found = G.cycles(graph)
    msgs = []
    for cyc in found:
        steps = [where[(a, b)] for a, b in zip(cyc, cyc[1:])]
        chain = "; ".join(f"{s.src} imports {s.dst} ({s.path}:{s.line}{', deferred' if s.deferred else ''})"
                          for s in steps)
        msgs.append(f"import cycle {' -> '.join(cyc)}: {chain}. A deferred import does not break a cycle; "
                    f"{HOW_TO_FIX}")
    assert not msgs, "\n".join(msgs)


def test_imports_point_down(edges):
    layers = G.declared_layers()
    rank = _layer_of(layers)
    bad = []
    for e in edges:
        a, b = G.unit(e.src), G.unit(e.dst)
        if a == b or a not in rank or b not in rank:
            continue
        if rank[b] >= rank[a]:
            how = "sideways (same layer)" if rank[b] == rank[a] else "upward"
            bad.append(f"{e.path}:{e.line}: {e.src} imports {e.dst}{' (deferred)' if e.deferred else ''}: an {how} "
                       f"edge, rljax.{a} (layer '{', '.join(layers[len(layers) - 1 - rank[a]])}') may import only "
                       f"layers below it, and rljax.{b} is in layer '{', '.join(layers[len(layers) - 1 - rank[b]])}'; "
                       f"{HOW_TO_FIX}")
    assert not bad, "\n".join(bad)


#: What may justify importing a package module inside a function rather than at the top.
DEFER_REASONS = ("an import cycle is not one: a deferred import does not break it (test_no_import_cycle); what may "
                 "defer is a genuinely heavy or environment-sensitive import: TensorFlow / TFDS, torch, "
                 "transformers, wandb, mlflow, orbax or flax where the importer stays without them, or JAX "
                 "before the launcher / preflight has configured it")


def test_deferred_imports_say_why(edges):
    """An import of a package module inside a function carries a one-line reason (a comment on its
    line, or on the comment line above its block of imports); the others belong at the top."""
    bad = sorted({(e.path, e.line, e.src, e.dst) for e in edges if e.deferred and not e.reason})
    assert not bad, "\n".join(f"{p}:{ln}: {s} imports {d} inside a function with no reason: move it to the top of "
                               f"the module, or say why in a comment on that line ({DEFER_REASONS})"
                               for p, ln, s, d in bad)


def test_the_graph_sees_deferred_and_relative_imports(tmp_path):
    """The walker itself: a deferred import and a relative one are edges; a cycle through them is found."""
    pkg = tmp_path / "rljax"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""x\n\nLayers, top to bottom:\n\n    a  top\n    b  bottom\n"""\n')
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "m.py").write_text("from . import n\n")
    (pkg / "a" / "n.py").write_text("def f():\n    from rljax.b import g\n\n\ndef h():\n    # heavy: b loads torch\n"
                                    "    import rljax.b\n    from rljax.b import k  # and so does k\n")
    (pkg / "b.py").write_text("import rljax.a.m\n")
    es = G.edges(tmp_path)
    pairs = {(e.src, e.dst, e.deferred) for e in es}
    assert ("rljax.a.m", "rljax.a.n", False) in pairs and ("rljax.a.n", "rljax.b", True) in pairs
    reasons = sorted((e.line, e.reason) for e in es if e.src == "rljax.a.n")
    assert reasons == [(2, None), (7, "heavy: b loads torch"), (8, "and so does k")], reasons
    graph = collections.defaultdict(set)
    for e in es:
        graph[e.src].add(e.dst)
    assert G.cycles(graph) == [["rljax.a.m", "rljax.a.n", "rljax.b", "rljax.a.m"]]
    assert G.declared_layers(tmp_path) == [["a"], ["b"]]
