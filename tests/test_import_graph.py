"""No import circles among the modules of hf_moe_offload.

The graph is read from the source (no import runs): every `import` and `from ... import` statement counts, including
those inside functions, since a lazy import that closes a circle only hides it, and those under `if TYPE_CHECKING:`
(they never run, but a type that names its user back is the same entanglement for a reader). Importing `a.b.c` also runs the packages `a` and `a.b`, so those
count as imported too, except a package that contains the importing module (Python has already started it).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "hf_moe_offload"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def _module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _import_nodes(tree: ast.AST):
    """Every import statement of the tree, at any depth, `if TYPE_CHECKING:` blocks included."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `module` imports, directly or through their packages' `__init__`."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets.add(origin)
            targets.update(f"{origin}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    own_packages = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1 + is_package)}
    found = set()
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name in modules and name not in own_packages and name != module:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _module_names()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_graph_sees_lazy_imports_and_packages():
    """The reader must see what it is there to catch: a function-level import, one under `if TYPE_CHECKING:` and a
    package's `__init__`."""
    graph = import_graph()
    assert "hf_moe_offload.offload" in graph["hf_moe_offload.jobs.arguments"]  # `from ..offload import ...`
    assert graph["hf_moe_offload.offload"] >= {"hf_moe_offload.offload.api"}
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    lazy = ast.parse("def f():\n    from .x import y\nif TYPE_CHECKING:\n    from .z import w\n")
    assert sorted(node.module for node in _import_nodes(lazy)) == ["x", "z"]


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import circles among hf_moe_offload modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _package_rules() -> dict[str, list[str]]:
    """Each package's "May import:" paragraph of its `__init__` docstring: the package's modules (relative to
    hf_moe_offload; a name allows its submodules too) that the package's own modules may import."""
    rules = {}
    for name, path in _module_names().items():
        if path.name != "__init__.py" or name == PACKAGE:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        _, found, allowed = doc.partition("May import:")
        if found:
            allowed = allowed.split("\n\n")[0].replace("\n", " ")
            rules[name] = [] if "nothing" in allowed else [
                f"{PACKAGE}.{word.strip(' `.')}" for word in allowed.split(",")]
    return rules


def test_every_package_says_what_it_may_import_and_keeps_to_it():
    """A package's modules import, outside the package and its subpackages, only what its docstring allows (the
    paragraph is read, so a reader of the `__init__` is told the truth)."""
    rules = _package_rules()
    packages = [name for name, path in _module_names().items() if path.name == "__init__.py" and name != PACKAGE]
    assert sorted(rules) == sorted(packages), "packages without a 'May import:' paragraph"
    graph = import_graph()
    breaches = []
    for module, targets in graph.items():
        owner = max((p for p in packages if module == p or module.startswith(p + ".")), key=len, default=None)
        if owner is None:
            continue
        for target in targets:
            if target == owner or target.startswith(owner + "."):
                continue
            # Importing `a.b.c` runs the packages `a` and `a.b`: an allowed module's packages come with it.
            if not any(target == a or target.startswith(a + ".") or a.startswith(target + ".") for a in rules[owner]):
                breaches.append(f"{module} imports {target}, outside what {owner} may import")
    assert not breaches, "\n".join(sorted(breaches))
