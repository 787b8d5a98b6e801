"""The module graph: no import cycles (function-level and type-checking imports included), the
offline evaluation code imported by nothing that serves, and no private name of one module used
from another.

The graph is read from the source with `ast`, so an import hidden inside a function or under
`if TYPE_CHECKING:` counts like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "cacheclip_rag": ROOT / "src" / "cacheclip_rag",
    "cacheclip_kernels": ROOT / "kernels" / "cacheclip_kernels",
    "langchain_cacheclip": ROOT / "integrations" / "langchain_cacheclip",
    "llama_index.llms.cacheclip": ROOT / "integrations" / "llama_index" / "llms" / "cacheclip",
}


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The project module an imported name belongs to (the longest known prefix), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import statement in the file."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: None if is_package else -1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub, []) if sub in MODULES else (base, [alias.name]))
    return out


def _is_project_import(module: str, path: Path, node: ast.AST, alias: ast.alias) -> bool:
    """Whether `alias` of an import statement names a module or object of this project."""
    if isinstance(node, ast.Import):
        return _owner(alias.name) is not None
    return node.level > 0 or _owner(node.module or "") is not None


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        deps = {_owner(target) for target, _ in _imports(module, path)}
        graph[module] = {d for d in deps if d is not None and d != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_finder_sees_imports_inside_functions_and_type_checking_blocks(tmp_path):
    graph = _graph()
    # engine imports its stages at the top; the CLI imports most commands' modules inside functions.
    assert "cacheclip_rag.prepare" in graph["cacheclip_rag.engine"]
    assert len(graph["cacheclip_rag.cli"]) >= 5
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_nothing_outside_eval_imports_eval():
    graph = _graph()
    serving = [m for m in graph if not m.startswith("cacheclip_rag.eval") and not m.startswith("cacheclip_rag.cli")]
    offenders = {m: sorted(d for d in graph[m] if d.startswith("cacheclip_rag.eval")) for m in serving}
    assert {m: d for m, d in offenders.items() if d} == {}


def test_no_private_name_of_another_module_is_used():
    used = []
    for module, path in MODULES.items():
        for target, names in _imports(module, path):
            owner = _owner(target)
            if owner is None or owner == module:
                continue
            used += [f"{module} takes {owner}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
        tree = ast.parse(path.read_text())
        aliases = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                   for a in node.names if _is_project_import(module, path, node, a)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and isinstance(node.value, ast.Name) and node.value.id in aliases:
                used.append(f"{module} uses {node.value.id}.{node.attr}")
    assert used == []
