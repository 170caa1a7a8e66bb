"""The layering rules of docs/design.md ("Contracts"), read from the source so that they stay
true once nobody is looking:

- the llama.cpp edge (flylocal/llama) reaches the decoding core through its contracts alone;
- outside the edge, nothing asks a model what it happens to have: no getattr/hasattr on a
  target, a runtime, a context or a model (what they offer is declared in
  flylocal/decoding/contracts.py);
- no two modules import each other, however far round (an import inside a function counts:
  it ties the two as much)."""

from __future__ import annotations

import ast
from pathlib import Path

import flylocal

ROOT = Path(flylocal.__file__).parent
EDGE = ROOT / "llama"
# a name in the object a getattr/hasattr reads: a model, in one of its guises
MODELISH = {"target", "targets", "runtime", "rt", "context", "ctx", "model", "models", "draft", "sequence", "seq",
            "view", "vocab", "vocabulary"}


def sources(under: Path):
    for path in sorted(under.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def names_in(node: ast.AST) -> set[str]:
    """Every name and attribute the expression `node` reads (`self.target.context`: self,
    target, context)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def probes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, source) of each getattr/hasattr whose object names a model."""
    found = []
    for n in ast.walk(tree):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")
                and n.args and {name.lower() for name in names_in(n.args[0])} & MODELISH):
            found.append((n.lineno, ast.unparse(n)))
    return found


def core_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of each import of the decoding core other than its contracts."""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("flylocal.decoding"):
            if n.module == "flylocal.decoding":
                found += [(n.lineno, f"flylocal.decoding.{a.name}") for a in n.names if a.name != "contracts"]
            elif n.module != "flylocal.decoding.contracts":
                found.append((n.lineno, n.module))
        elif isinstance(n, ast.Import):
            found += [(n.lineno, a.name) for a in n.names
                      if a.name.startswith("flylocal.decoding") and a.name != "flylocal.decoding.contracts"]
    return found


def test_the_edge_imports_only_the_contracts_from_the_core():
    bad = [f"{path.relative_to(ROOT.parent)}:{line}: {what}" for path, tree in sources(EDGE)
           for line, what in core_imports(tree)]
    assert not bad, "flylocal/llama reaches the core past its contracts:\n" + "\n".join(bad)


def test_nothing_outside_the_edge_probes_a_model():
    bad = [f"{path.relative_to(ROOT.parent)}:{line}: {code}" for path, tree in sources(ROOT)
           if EDGE not in path.parents for line, code in probes(tree)]
    assert not bad, ("a model is asked what it happens to have; declare it in flylocal/decoding/contracts.py "
                     "instead:\n" + "\n".join(bad))


def test_the_scanners_see_what_they_look_for():
    """The two rules above fail on the code they are written against."""
    tree = ast.parse("r = getattr(self.target, 'decoded_on', None)\nok = hasattr(models.target, 'n_seq')\n"
                     "fine = getattr(req, 'max_tokens', None)\nalso = getattr(os, 'O_CLOEXEC', 0)\n")
    assert [line for line, _ in probes(tree)] == [1, 2]
    tree = ast.parse("from flylocal.decoding.costs.meter import CpuLoad\nfrom flylocal.decoding import contracts\n"
                     "from flylocal.decoding.contracts import Target\nimport flylocal.decoding.engine\n"
                     "from flylocal.decoding import batch, contracts\n")
    assert core_imports(tree) == [(1, "flylocal.decoding.costs.meter"), (4, "flylocal.decoding.engine"),
                                  (5, "flylocal.decoding.batch")]


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, known: set[str]) -> set[str]:
    """The project's modules `tree` imports, anywhere in it: `from a.b import c` names a.b.c
    where that is a module, else a.b."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            for a in n.names:
                out.add(f"{n.module}.{a.name}" if f"{n.module}.{a.name}" in known else n.module)
        elif isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
    return out & known


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of `graph` with more than one module (Tarjan's)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

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
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_round_a_circle():
    trees = {module_of(path): tree for path, tree in sources(ROOT)}
    known = set(trees)
    graph = {m: imported(tree, known) - {m} for m, tree in trees.items()}
    assert not cycles(graph), "import circles: " + "; ".join(" <-> ".join(c) for c in cycles(graph))


def test_the_circle_finder_finds_circles():
    known = {"p.a", "p.b", "p.c", "p.d"}
    tree = ast.parse("from p import b\ndef f():\n    import p.c\nfrom p.d import thing\n")
    assert imported(tree, known) == {"p.b", "p.c", "p.d"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
