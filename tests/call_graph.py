"""A static call graph of Python modules, enough to say what a module's functions reach: a
call is resolved through the module's own definitions and imports (`settings_for(...)`,
`request.settings_for(...)`), `self`/`super()` methods through the class and its bases, and
a method called on what is named a server, a session or a target to the class it is here
(Server, Session, the llama.cpp runtime). A method called on anything else is kept by its
name alone, so that a step reached through an unknown receiver is still seen."""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

FLYLOCAL = Path(__file__).resolve().parents[1] / "flylocal"
# receiver's last name -> (module, class) its methods are looked up in
RECEIVERS = {"server": ("flylocal.front.serve.app", "Server"), "session": ("flylocal.session", "Session"),
             "target": ("flylocal.llama.runtime", "Runtime")}


@dataclass
class Module:
    name: str
    functions: dict[str, ast.AST] = field(default_factory=dict)     # "f" or "Class.f" -> its def
    bases: dict[str, list[tuple[str, str]]] = field(default_factory=dict)   # class -> (module, class) of its bases
    imported: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # local name -> (module, name or None)


def module_path(name: str, extra: dict[str, Path]) -> Path | None:
    """The file of a module of flylocal's (or of `extra`); None for any other. Found on disk,
    not imported: reading a module runs none of it."""
    if name in extra:
        return extra[name]
    if name != "flylocal" and not name.startswith("flylocal."):
        return None
    base = FLYLOCAL.parent / name.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


class Graph:
    """Modules read on demand (`extra`: module name -> file, for modules outside the path or
    written by a test)."""

    def __init__(self, extra: dict[str, Path] | None = None):
        self.extra = extra or {}
        self.modules: dict[str, Module | None] = {}

    def module(self, name: str) -> Module | None:
        if name not in self.modules:
            path = module_path(name, self.extra)
            self.modules[name] = None if path is None else self.read(name, ast.parse(path.read_text()))
        return self.modules[name]

    def read(self, name: str, tree: ast.Module) -> Module:
        m = Module(name)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                m.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        m.functions[f"{node.name}.{item.name}"] = item
                m.bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
        for node in ast.walk(tree):         # imports inside functions count as well
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    whole = f"{node.module}.{a.name}"
                    is_module = module_path(whole, self.extra) is not None
                    m.imported[a.asname or a.name] = (whole, None) if is_module else (node.module, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    m.imported[a.asname or a.name.split(".")[0]] = (a.name if a.asname else a.name.split(".")[0], None)
        m.bases = {cls: [self.where(m, b) for b in names] for cls, names in m.bases.items()}
        return m

    def where(self, m: Module, name: str) -> tuple[str, str]:
        """(module, name) that `name` means in module `m`."""
        if name in m.imported and m.imported[name][1] is not None:
            return m.imported[name]          # type: ignore[return-value]
        return m.name, name

    def method(self, module: str, cls: str, name: str) -> tuple[str, str] | None:
        """(module, "Class.name") of a method, looked up in `cls` and its bases."""
        m = self.module(module)
        if m is None:
            return None
        if f"{cls}.{name}" in m.functions:
            return module, f"{cls}.{name}"
        for base_module, base in m.bases.get(cls, ()):
            found = self.method(base_module, base, name)
            if found is not None:
                return found
        return None

    def calls(self, module: str, qualname: str) -> list[tuple[str, str]]:
        """What one function calls: (module, qualified name), or ("?", method) for a method of
        an unknown receiver."""
        m = self.module(module)
        cls = qualname.split(".")[0] if "." in qualname else None
        out = []
        for node in ast.walk(m.functions[qualname]):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name):
                mod, name = self.where(m, f.id)
                target = self.module(mod)
                if target is not None and name in target.functions:
                    out.append((mod, name))
                elif target is not None and f"{name}.__init__" in target.functions:
                    out.append((mod, f"{name}.__init__"))
            elif isinstance(f, ast.Attribute):
                out.append(self.attribute(m, cls, f))
        return [c for c in out if c is not None]

    def attribute(self, m: Module, cls: str | None, f: ast.Attribute) -> tuple[str, str] | None:
        v = f.value
        if isinstance(v, ast.Name) and v.id in m.imported and m.imported[v.id][1] is None:
            mod = m.imported[v.id][0]
            target = self.module(mod)
            return (mod, f.attr) if target is not None and f.attr in target.functions else None
        if cls is not None and isinstance(v, ast.Name) and v.id == "self":
            return self.method(m.name, cls, f.attr) or ("?", f.attr)
        if cls is not None and isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
            for base_module, base in m.bases.get(cls, ()):
                found = self.method(base_module, base, f.attr)
                if found is not None:
                    return found
        last = v.attr if isinstance(v, ast.Attribute) else v.id if isinstance(v, ast.Name) else None
        if last in RECEIVERS:
            return self.method(*RECEIVERS[last], f.attr) or ("?", f.attr)
        return "?", f.attr

    def reaching(self, module: str, steps: set[tuple[str, str]], through: set[tuple[str, str]]) -> list[list]:
        """Each path from a function of `module` to one of `steps` (("?", name): any method of
        that name called on an unknown receiver), not passing through `through`."""
        found = []
        for qualname in self.module(module).functions:
            start = (module, qualname)
            seen, queue = {start}, deque([[start]])
            while queue:
                path = queue.popleft()
                for callee in self.calls(*path[-1]) if path[-1][0] != "?" else ():
                    if callee in steps:
                        found.append(path + [callee])
                    elif callee not in seen and callee not in through and callee[0] != "?":
                        seen.add(callee)
                        queue.append(path + [callee])
        return found
