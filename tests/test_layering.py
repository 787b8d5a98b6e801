"""The module graph: layers in one direction, no import cycles, no private reach-ins.

A module's layer is its folder (`cacheclip_rag/<layer>/...`); the package's top-level modules are
the base (config, select_config, hardware, paths: what every layer shares) and the facade (the engine and the
package's public names). Layers, lowest first:

    base < models, storage < corpus < request < selectors < engine < offline < serving < cli
         < analysis (the seam the harness uses) < harness (`benchmarks/cacheclip_bench`)

A module imports from its own layer or a lower one only. The harness is a package of its own and
reaches the library through two doors only: the public names (`cacheclip_rag`) and the analysis
seam (`cacheclip_rag.analysis`); nothing in the library imports either of those two upper layers.
models and storage are peers that never import each other: a store holds bytes and knows no model. The request path (models, storage,
corpus, request, selectors, the engine) therefore imports nothing of serving, offline or the harness.

The graph is read from the source with `ast`, so an import hidden inside a function or under
`if TYPE_CHECKING:` counts like any other for the layers. For cycles, a type-only import (under
`if TYPE_CHECKING:`) within one folder is left out: two types of one layer that name each other
(a `Prepared` request carries its `Selector`, whose `plan` takes a `Prepared`) are not a cycle
at run time; across folders it counts.
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
    "cacheclip_bench": ROOT / "benchmarks" / "cacheclip_bench",
}
RANK = {"base": 0, "models": 1, "storage": 1, "corpus": 2, "request": 3, "selectors": 4, "engine": 5, "offline": 6,
        "serving": 7, "cli": 8, "analysis": 9, "harness": 10}
BASE = {"config", "select_config", "hardware", "paths"}
FACADE = {"engine"}
SEAM = "analysis"
HARNESS_DOORS = {"cacheclip_rag", "cacheclip_rag.analysis"}
REQUEST_PATH = {"models", "storage", "corpus", "request", "selectors", "engine", "base"}


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


def layer(module: str) -> str | None:
    """The layer of a module of cacheclip_rag or of the harness (None for the kernels and the
    integrations)."""
    parts = module.split(".")
    if parts[0] == "cacheclip_bench":
        return "harness"
    if parts[0] != "cacheclip_rag":
        return None
    if len(parts) == 1 or parts[1] in FACADE:
        return "engine"
    if parts[1] in BASE:
        return "base"
    return parts[1]


def _owner(name: str) -> str | None:
    """The project module an imported name belongs to (the longest known prefix), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_only(tree: ast.AST) -> set[int]:
    """ids of the import statements under `if TYPE_CHECKING:`."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def _imports(module: str, path: Path, runtime: bool = False) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import statement in the file; runtime:
    without the type-only imports of the module's own folder."""
    is_package = path.name == "__init__.py"
    out = []
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_only(tree) if runtime else set()
    folder = module.rpartition(".")[0] if not is_package else module
    for node in ast.walk(tree):
        if id(node) in skip:
            level = getattr(node, "level", 0)
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if level == 1 or (not level and all(n.startswith(folder + ".") for n in names)):
                continue
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


def _is_project_import(node: ast.AST, alias: ast.alias) -> bool:
    """Whether `alias` of an import statement names a module or object of this project."""
    if isinstance(node, ast.Import):
        return _owner(alias.name) is not None
    return node.level > 0 or _owner(node.module or "") is not None


def _graph(runtime: bool = False) -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        deps = {_owner(target) for target, _ in _imports(module, path, runtime)}
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


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module of the same or a higher layer in another folder."""
    bad = []
    for module, deps in sorted(graph.items()):
        here = layer(module)
        for dep in sorted(deps):
            there = layer(dep)
            if here is not None and there is not None and there != here and RANK[there] >= RANK[here]:
                bad.append(f"{module} ({here}) imports {dep} ({there})")
    return bad


def test_the_finder_sees_imports_inside_functions_and_type_checking_blocks():
    graph = _graph()
    # engine imports its stages at the top; the CLI imports most commands' modules inside functions.
    assert "cacheclip_rag.request.prepare" in graph["cacheclip_rag.engine"]
    assert len(graph["cacheclip_rag.cli"]) >= 4
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_lives_in_a_known_layer():
    layers = {layer(m) for m in MODULES} - {None}
    assert layers <= set(RANK), f"folders without a rank: {sorted(layers - set(RANK))}"
    top = sorted(m for m, path in MODULES.items() if path.parent == PACKAGES["cacheclip_rag"] and path.name != "__init__.py")
    assert top == sorted(f"cacheclip_rag.{name}" for name in BASE | FACADE | {SEAM})


def test_the_layer_check_catches_an_upward_import():
    graph = {"cacheclip_rag.storage.store": {"cacheclip_rag.models.loading"},
             "cacheclip_rag.request.execute": {"cacheclip_bench.ttft", "cacheclip_rag.storage.store"},
             "cacheclip_bench.ttft": {"cacheclip_rag.request.execute"}}
    assert _upward(graph) == ["cacheclip_rag.request.execute (request) imports cacheclip_bench.ttft (harness)",
                              "cacheclip_rag.storage.store (storage) imports cacheclip_rag.models.loading (models)"]


def test_imports_go_down_the_layers_only():
    assert _upward(_graph()) == []


def test_the_request_path_imports_no_serving_offline_or_eval_code():
    graph = _graph()
    above = {"serving", "offline", "cli", "analysis", "harness"}
    offenders = {m: sorted(d for d in deps if layer(d) in above) for m, deps in graph.items() if layer(m) in REQUEST_PATH}
    assert {m: d for m, d in offenders.items() if d} == {}


def test_the_harness_reaches_the_library_through_its_public_names_and_the_analysis_seam_only():
    graph = _graph()
    harness = [m for m in graph if layer(m) == "harness"]
    assert len(harness) >= 20, "the harness package was not found"
    offenders = {m: sorted(d for d in deps if d.startswith("cacheclip_rag") and d not in HARNESS_DOORS)
                 for m, deps in graph.items() if m in harness}
    assert {m: d for m, d in offenders.items() if d} == {}
    # and the library never reaches back: no module of cacheclip_rag imports the harness or its seam
    library = {m: sorted(d for d in deps if layer(d) in ("harness", SEAM)) for m, deps in graph.items()
               if m.startswith("cacheclip_rag") and m != "cacheclip_rag.analysis"}
    assert {m: d for m, d in library.items() if d} == {}


def test_storage_imports_no_model_code():
    graph = _graph()
    model_code = {"models", "corpus", "request", "selectors"}
    offenders = {m: sorted(d for d in deps if layer(d) in model_code) for m, deps in graph.items() if layer(m) == "storage"}
    assert {m: d for m, d in offenders.items() if d} == {}


def test_no_import_cycles():
    assert _cycles(_graph(runtime=True)) == []


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
                   for a in node.names if _is_project_import(node, a)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and isinstance(node.value, ast.Name) and node.value.id in aliases:
                used.append(f"{module} uses {node.value.id}.{node.attr}")
    assert used == []


def test_no_module_of_the_library_is_over_400_lines():
    """A module past 400 lines holds more than one job; split it along its seams."""
    long = {m: n for m, path in MODULES.items() if layer(m) not in (None, "harness")
            and (n := len(path.read_text().splitlines())) > 400}
    assert long == {}
