"""The python/gpushm package is layered, and has no import circle: drawn
from every import statement in its modules (those inside functions too,
which only put the circle off until the call), its modules form a graph
without a cycle, and the client core imports no feature: neither channels,
the allocator, publish, the composed Client, nor torch, transformers or
safetensors, the package's or the library."""

import ast
import importlib.util
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "gpushm"


# The client core: the connection (_core), segments and bundles, and what
# they stand on. gpushm._client composes it with the features into Client.
CORE = {"_core", "_segment", "_bundle", "_mapping", "_view", "_dlpack", "_tensors", "_info", "_errors", "_trust",
        "_cuda"}
# What the core never imports: the features and what composes them, and
# the integrations (the package's torch, transformers and safetensors).
FEATURES = {"_channel", "_alloc", "_publish", "_client", "gpushm", "torch", "transformers", "safetensors", "testing",
            "run"}
# Libraries no module of the core imports, even inside a function.
FRAMEWORKS = {"torch", "transformers", "safetensors"}
# Names that say nothing of what a module gives: a module is named for
# what it gives.
VAGUE = {"_types", "types", "_utils", "utils", "_common", "common", "_helpers", "helpers"}


def imports(pkg: Path, external: bool = False) -> dict:
    """module name -> the set of the package's modules it imports (with
    external, the top-level names of what it imports from outside the
    package instead). The package's __init__ is "gpushm"; "from . import
    x" names submodule x when there is one, else something of __init__'s."""
    mods = {p.stem: p for p in pkg.glob("*.py")}
    graph = {}
    for stem, path in mods.items():
        me = "gpushm" if stem == "__init__" else stem
        out, outside = set(), set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] != "gpushm":
                outside.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                outside |= {a.name.split(".")[0] for a in node.names if a.name.split(".")[0] != "gpushm"}
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module is None:
                    out |= {a.name if a.name in mods else "gpushm" for a in node.names}
                elif node.level == 1:
                    out.add(node.module.split(".")[0])
                elif node.level == 0 and node.module and node.module.split(".")[0] == "gpushm":
                    parts = node.module.split(".")
                    if len(parts) > 1:
                        out.add(parts[1])
                    else:
                        out |= {a.name if a.name in mods else "gpushm" for a in node.names}
                elif node.level > 1:
                    raise AssertionError(f"{path.name}:{node.lineno}: an import from outside the package")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    parts = a.name.split(".")
                    if parts[0] == "gpushm":
                        out.add(parts[1] if len(parts) > 1 else "gpushm")
        out.discard(me)
        graph[me] = outside if external else out
    return graph


def reach(graph: dict, start: str) -> set:
    """Every module start imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def cycles(graph: dict) -> list:
    """Every strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    graph = imports(PKG)
    assert {"_client", "_channel", "torch", "transformers"} <= graph.keys()
    # The package's __init__ imports the client: nothing of the package may
    # import the package itself back.
    assert "_client" in graph["gpushm"]
    found = cycles(graph)
    assert not found, "import circles in python/gpushm: " + "; ".join(
        " <-> ".join(g) + " (" + ", ".join(f"{m} imports {sorted(graph[m] & set(g))}" for m in g) + ")" for g in found)


def test_the_check_finds_a_circle(tmp_path):
    # The check itself: a package whose modules import each other, one of
    # them inside a function, is a circle.
    (tmp_path / "__init__.py").write_text("from ._a import f\n")
    (tmp_path / "_a.py").write_text("from . import _b\n\ndef f():\n    return _b.g()\n")
    (tmp_path / "_b.py").write_text("def g():\n    from ._a import f\n    return f\n")
    (tmp_path / "_c.py").write_text("import gpushm._a\n")
    graph = imports(tmp_path)
    assert graph == {"gpushm": {"_a"}, "_a": {"_b"}, "_b": {"_a"}, "_c": {"_a"}}
    assert cycles(graph) == [["_a", "_b"]]


def test_the_core_names_no_feature():
    graph = imports(PKG)
    assert CORE <= graph.keys(), f"core modules missing: {sorted(CORE - graph.keys())}"
    # The core reaches only the core: what it needs of a feature (a
    # channel's role kept across reconnections) comes through its hook,
    # Core._hold.
    for m in sorted(CORE):
        assert not reach(graph, m) & FEATURES, f"{m} reaches {sorted(reach(graph, m) & FEATURES)}: {m} imports {sorted(graph[m])}"
        assert reach(graph, m) <= CORE, f"{m} reaches {sorted(reach(graph, m) - CORE)}, outside the core"
    outside = imports(PKG, external=True)
    for m in sorted(CORE):
        assert not outside[m] & FRAMEWORKS, f"{m} imports {sorted(outside[m] & FRAMEWORKS)}"
    # The package composes the core with its features.
    assert {"_core", "_channel", "_bundle", "_publish"} <= graph["_client"]
    assert not VAGUE & graph.keys(), f"modules named for nothing they give: {sorted(VAGUE & graph.keys())}"


def test_the_layer_check_finds_a_feature(tmp_path):
    # The check itself: a core module that imports a feature inside a
    # function, or torch, is found.
    (tmp_path / "_core.py").write_text("from . import _segment\n\ndef f():\n    from . import _channel\n")
    (tmp_path / "_segment.py").write_text("def g():\n    import torch.cuda\n")
    (tmp_path / "_channel.py").write_text("")
    graph = imports(tmp_path)
    assert reach(graph, "_core") & FEATURES == {"_channel"}
    assert imports(tmp_path, external=True)["_segment"] == {"torch"}


def test_typed():
    # The package says it is typed (PEP 561), and its wheels carry it.
    assert (PKG / "py.typed").is_file()
    spec = importlib.util.spec_from_file_location("gpushm_build", PKG.parent / "_build" / "gpushm_build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert "gpushm/py.typed" in {name for name, _, _ in build.client_files()}
