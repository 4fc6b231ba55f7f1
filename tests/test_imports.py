"""The package's modules keep to each other's surfaces, and import each other in layers.

Every module under shmchan/ is parsed (not imported) with `ast`; the rules:

1. No module uses another shmchan module's private name: neither `from M import _x` nor
   `M._x` on a name bound to an imported shmchan module (also through `shmchan.M._x`).
   Dunder names (`__version__`) are not private, and a module's own names are its own.
2. A private *module* (`_segment`, `_lib`, `_worker`: a name starting with `_`) may be
   imported by any module of the package, but only through its declared surface: its
   `__all__`, which it must have. Using a name of it not in `__all__` is a violation, as
   a private name of a public module is.
3. The graph of shmchan-internal imports has no cycle. Every import counts, at module
   level or inside a function (a lazy import is still a dependency), except those under
   `if TYPE_CHECKING:`, which never run. `from . import m` is an edge to module `m` when
   `m` is a module, else to the package; importing a submodule implicitly loads its
   parent package, which is not counted (every module would be in a cycle with it).

Names taken from objects (`handle._seg`) are not modules' names and are not checked.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "shmchan"


@dataclass
class Module:
    name: str  # dotted: shmchan.pool.executor
    path: Path
    is_package: bool
    tree: ast.Module
    surface: set[str] | None  # __all__, if the module declares one
    edges: set[str] = field(default_factory=set)


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _private(name: str) -> bool:
    return name.startswith("_") and not _dunder(name)


def _declared_all(tree: ast.Module) -> set[str] | None:
    names: set[str] | None = None
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AugAssign | ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            value = node.value
            if isinstance(value, ast.List | ast.Tuple):
                names = (names or set()) | {
                    e.value for e in value.elts if isinstance(e, ast.Constant)
                }
    return names


def load(root: Path = PACKAGE) -> dict[str, Module]:
    mods: dict[str, Module] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        name = ".".join(parts)
        mods[name] = Module(name, path, is_package, tree, _declared_all(tree))
    return mods


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for sub in node.body:
                    out.update(id(n) for n in ast.walk(sub))
    return out


def _base(mod: Module, node: ast.ImportFrom) -> str | None:
    """The absolute module a `from X import ...` names, None if outside shmchan."""
    if node.level == 0:
        target = node.module or ""
    else:
        pkg = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        target = ".".join(pkg + ([node.module] if node.module else []))
    return target if target == "shmchan" or target.startswith("shmchan.") else None


@dataclass
class Findings:
    private: list[str] = field(default_factory=list)
    cycles: list[list[str]] = field(default_factory=list)


def _use(mods: dict[str, Module], user: Module, owner: str, name: str, where: str) -> str | None:
    """A violation if `user` may not use `owner`'s `name`, else None."""
    sub = mods.get(f"{owner}.{name}")
    if sub is not None:  # the name is a submodule: a private one must declare its surface
        if _private(name) and sub.surface is None:
            return f"{where}: private module {sub.name} has no __all__ to say what it offers"
        return None
    target = mods.get(owner)
    if target is None or owner == user.name or _dunder(name):
        return None
    if _private(name):
        return f"{where}: private name {name!r} of {owner}"
    if _private(owner.rsplit(".", 1)[-1]):
        if target.surface is None:
            return f"{where}: {owner} is a private module without __all__ (uses {name!r})"
        if name not in target.surface:
            return f"{where}: {name!r} is not in the surface (__all__) of private {owner}"
    return None


def analyse(mods: dict[str, Module]) -> Findings:
    found = Findings()
    for mod in mods.values():
        skip = _type_checking_nodes(mod.tree)
        bound: dict[str, str] = {}  # local name -> shmchan module it is bound to
        for node in ast.walk(mod.tree):
            where = f"{mod.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "shmchan" or alias.name.startswith("shmchan."):
                        if id(node) not in skip and alias.name != mod.name:
                            mod.edges.add(alias.name)
                        if alias.asname:
                            bound[alias.asname] = alias.name
                        else:
                            bound["shmchan"] = "shmchan"
            elif isinstance(node, ast.ImportFrom):
                base = _base(mod, node)
                if base is None:
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in mods:  # a submodule
                        bound[alias.asname or alias.name] = full
                        edge = full
                    else:
                        edge = base
                    if id(node) not in skip and edge != mod.name:
                        mod.edges.add(edge)
                    problem = _use(mods, mod, base, alias.name, where)
                    if problem:
                        found.private.append(problem)
        # attribute access on names bound to shmchan modules (shmchan.m._x chains too)
        for node in ast.walk(mod.tree):
            if not isinstance(node, ast.Attribute):
                continue
            chain: list[str] = []
            cur: ast.expr = node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if not isinstance(cur, ast.Name) or cur.id not in bound:
                continue
            owner = bound[cur.id]
            chain.reverse()
            # walk down through submodules: shmchan.channel._x -> (shmchan.channel, _x)
            i = 0
            while i < len(chain) - 1 and f"{owner}.{chain[i]}" in mods:
                owner = f"{owner}.{chain[i]}"
                i += 1
            if node.attr != chain[i] or len(chain) - 1 != i:
                continue  # reported when the walk reaches the inner Attribute node
            problem = _use(mods, mod, owner, chain[i], f"{mod.name}:{node.lineno}")
            if problem:
                found.private.append(problem)
    found.cycles = _cycles({m.name: m.edges & mods.keys() for m in mods.values()})
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_uses_another_modules_private_names() -> None:
    found = analyse(load())
    assert not found.private, "\n".join(found.private)


def test_the_modules_import_each_other_without_a_cycle() -> None:
    found = analyse(load())
    assert not found.cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in found.cycles)


def test_the_checker_sees_each_kind_of_violation(tmp_path: Path) -> None:
    """The rules above catch what they are meant to (a checker that finds nothing would
    pass on any code): a private name by `from` and by attribute, a name outside a
    private module's __all__, a cycle made only by a lazy import; and they let through
    a TYPE_CHECKING import, dunders, and a private module's declared surface."""
    pkg = tmp_path / "shmchan"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import A\n__version__ = '1'\n")
    (pkg / "_low.py").write_text("__all__ = ['open_it']\ndef open_it(): ...\ndef other(): ...\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import _low\n"
        "from ._low import open_it\n"
        "if TYPE_CHECKING:\n    from .b import B\n"
        "class A: ...\n"
        "_hidden = 1\n"
        "def f():\n    from . import b\n    return b._secret, _low.other\n"
    )
    (pkg / "b.py").write_text(
        "import shmchan.a as amod\nfrom .a import _hidden\nB = amod._hidden, amod.__name__\n"
        "_secret = 2\n"
    )
    found = analyse(load(pkg))
    assert sorted(p.split(": ", 1)[1] for p in found.private) == sorted(
        [
            "private name '_secret' of shmchan.b",
            "'other' is not in the surface (__all__) of private shmchan._low",
            "private name '_hidden' of shmchan.a",
            "private name '_hidden' of shmchan.a",
        ]
    )
    assert found.cycles == [["shmchan.a", "shmchan.b"]]
    (pkg / "a.py").write_text("from ._low import open_it\nclass A: ...\n")
    (pkg / "b.py").write_text("from .a import A\n")
    clean = analyse(load(pkg))
    assert clean.private == [] and clean.cycles == []
