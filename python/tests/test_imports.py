"""The python/gpushm package has no import circle: drawn from every import
statement in its modules (those inside functions too, which only put the
circle off until the call), its modules form a graph without a cycle."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "gpushm"


def imports(pkg: Path) -> dict:
    """module name -> the set of the package's modules it imports. The
    package's __init__ is "gpushm"; "from . import x" names submodule x
    when there is one, else something of __init__'s."""
    mods = {p.stem: p for p in pkg.glob("*.py")}
    graph = {}
    for stem, path in mods.items():
        me = "gpushm" if stem == "__init__" else stem
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
        graph[me] = out
    return graph


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
