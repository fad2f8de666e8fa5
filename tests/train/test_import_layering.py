"""The import graph of the whole of src/runyard, read from the source: no file circle, no folder-level
cycle, the layer order DESIGN.md states (and the few lower parts a part must still not use: FORBIDDEN), a
market that never imports torch, and no function-level import where one would hide a circle.

The graph is read from the source, so a circle shows up here even where the interpreter happens to get
through it in one import order. Every import counts (one inside a function too: it is the circle it
hides), except those under `if TYPE_CHECKING:`, which never run. A failure names the importing file, its
line and the imported module."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

import runyard

SRC = Path(runyard.__file__).parent

# Highest first (DESIGN.md's layer order): a module may import from its own layer's other folders (if no cycle results) and from any
# layer below, never from one above. `errors` is the root module errors.py; `runyard` the package itself.
LAYERS = [
    ["__main__"],
    ["cli"],
    # maintain is the tenant's upkeep of a served model: it reads drift, buys retraining through serve's
    # market retrainer, and rolls out through the market.
    ["run", "maintain"],
    # tracking mirrors what train and evaluate write into the run directory; run starts it.
    ["train", "serve", "evaluate", "tracking"],
    # The control plane runs jobs as `runyard` processes and never imports the trainer; serving's
    # retrainer submits through its client.
    ["control"],
    ["reproduce"],
    ["plan"],
    ["model", "data"],
    ["spec"],
    ["market"],
    ["system", "errors", "runyard"],
]
RANK = {folder: len(LAYERS) - i for i, layer in enumerate(LAYERS) for folder in layer}
# Lower layers a part must not import all the same, and why.
FORBIDDEN = {
    ("train", "plan"): "training runs what the plan decided and reads the spec and the model registry "
                       "(a stage's model: model/stage_model.py), never the planner",
}
# What the market may import at all: it runs on hosts without torch (`pip install runyard[market]`).
MARKET_MAY_IMPORT = {"market", "system", "errors", "runyard"}
# Files that must not import inside functions (optional extras would be the one exception).
NO_LOCAL_IMPORTS = [
    "train/checkpoint", "train/parallel.py", "train/loop.py", "train/metrics.py", "train/rng.py", "model",
    "plan/sizing.py", "model/hf", "serve/engine.py", "data/loader.py", "evaluate", "cli", "spec", "system",
    "run",
]
# What those files may import inside a function all the same: modules that only some runs use and whose
# import alone costs about a second of every run's start (measured: DTensor 1.2 s, FSDP2 and DCP with
# it, pipelining 1 s). Each is a leaf of torch, or a runyard module that only subclasses one of them, so
# deferring it can hide no cycle between runyard's own files.
DEFERRED_IMPORTS = (
    "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint",
    "torch.distributed.pipelining", "runyard.train.checkpoint.dcp_storage",
)


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    imported: str
    path: Path
    line: int
    local: bool  # inside a function

    def __str__(self) -> str:
        where = "inside a function" if self.local else "at module level"
        return f"{self.path.relative_to(SRC.parent)}:{self.line} imports {self.imported} ({where})"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str) -> Path | None:
    base = SRC.parent.joinpath(*name.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def folder_of(name: str) -> str:
    """The folder a module lives in, as a dotted package name (`runyard.train.checkpoint`); a module at the
    package root (errors.py, __main__.py) is a part of its own."""
    path = module_path(name)
    if path.name == "__init__.py" or path.parent == SRC:
        return name
    return name.rpartition(".")[0]


def top_folder(name: str) -> str:
    """The top-level part a module belongs to: its folder under runyard/, or a root module's name."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "runyard"


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _resolve_from(path: Path, node: ast.ImportFrom) -> str | None:
    if node.level == 0:
        return node.module
    base = module_name(path).split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def imports_of(path: Path) -> tuple[Import, ...]:
    """The runyard modules `path` imports, each with its line and whether it is inside a function."""
    tree = ast.parse(path.read_text())
    local_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                   for n in ast.walk(f)}
    found = []
    for stmt in (s for s in tree.body if not _is_type_checking(s)):
        for node in ast.walk(stmt):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = _resolve_from(path, node)
                names = [f"{module}.{a.name}" if module_path(f"{module}.{a.name}") else module for a in node.names]
            else:
                continue
            importer = module_name(path)
            for name in names:
                if name and name.split(".")[0] == "runyard" and module_path(name) and not importer.startswith(name + "."):
                    found.append(Import(importer, name, path, node.lineno, id(node) in local_nodes))
    return tuple(found)


@cache
def all_files() -> tuple[Path, ...]:
    return tuple(sorted(SRC.rglob("*.py")))


@cache
def all_imports() -> tuple[Import, ...]:
    """Every runyard import of every source file: parsed when a test first asks (not at collection, which
    every xdist worker does)."""
    return tuple(imp for path in all_files() for imp in imports_of(path))


def find_cycles(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Every strongly connected component with more than one node, as a cycle through it (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(edges.get(node, {})):
            if dep not in index:
                strongconnect(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(edges):
        if node not in index:
            strongconnect(node)
    return [_cycle_within(sorted(c), edges) for c in components]


def _cycle_within(component: list[str], edges: dict[str, dict[str, Import]]) -> list[str]:
    """One cycle through the component's first node, by breadth-first search back to it."""
    members, start = set(component), component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for dep in sorted(edges.get(node, {})):
                if dep not in members:
                    continue
                if dep == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if dep not in previous:
                    previous[dep] = node
                    nxt.append(dep)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def describe(cycle: list[str], edges: dict[str, dict[str, Import]]) -> str:
    return " -> ".join(cycle) + "\n" + "\n".join(f"    {edges[a][b]}" for a, b in zip(cycle, cycle[1:], strict=False))


def graph(key) -> dict[str, dict[str, Import]]:
    """Edges between `key(module)` nodes, each with one import that makes it (the first found)."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in all_imports():
        a, b = key(imp.importer), key(imp.imported)
        if a != b:
            edges.setdefault(a, {}).setdefault(b, imp)
    return edges


def test_no_file_circles():
    edges = graph(lambda name: name)
    cycles = find_cycles(edges)
    assert not cycles, "import circles between files:\n" + "\n".join(describe(c, edges) for c in cycles)


def sibling_parts(a: str, b: str) -> tuple[str, str]:
    """The two children of the deepest folder holding both modules that contain each: a file of that
    folder, or a subfolder taken whole. `runyard.train.loop` and `runyard.train.checkpoint.store` are
    `runyard.train.loop` and `runyard.train.checkpoint`; `runyard.plan.sizing` and `runyard.model.config`
    are `runyard.plan` and `runyard.model`."""
    pa, pb = a.split("."), b.split(".")
    common = 0
    while common < min(len(pa), len(pb)) - 1 and pa[common] == pb[common]:
        common += 1
    return ".".join(pa[: common + 1]), ".".join(pb[: common + 1])


def test_no_folder_level_cycles():
    """Within each folder, at every depth, its files and its subfolders (each taken whole) import each
    other without a cycle: no train <-> plan at the top, no train.checkpoint <-> train.loop below."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in all_imports():
        a, b = sibling_parts(imp.importer, imp.imported)
        if a != b and not imp.importer.startswith(b + ".") and not imp.imported.startswith(a + "."):
            edges.setdefault(a, {}).setdefault(b, imp)
    cycles = find_cycles(edges)
    assert not cycles, "import cycles between folders:\n" + "\n".join(describe(c, edges) for c in cycles)


def test_every_top_level_part_has_a_layer():
    parts = {top_folder(module_name(p)) for p in all_files()}
    assert parts - set(RANK) == set(), f"parts of src/runyard with no layer in LAYERS: {parts - set(RANK)}"


def test_layer_order():
    upward = [imp for imp in all_imports()
              if RANK[top_folder(imp.imported)] > RANK[top_folder(imp.importer)]]
    assert not upward, "imports of a higher layer (" + " > ".join("/".join(layer) for layer in LAYERS) + "):\n" + \
        "\n".join(f"  {imp}" for imp in upward)


def forbidden_imports(imports) -> list[str]:
    return [f"  {imp}: {FORBIDDEN[top_folder(imp.importer), top_folder(imp.imported)]}" for imp in imports
            if (top_folder(imp.importer), top_folder(imp.imported)) in FORBIDDEN]


def test_no_forbidden_imports():
    bad = forbidden_imports(all_imports())
    assert not bad, "imports a lower layer that this part must not use:\n" + "\n".join(bad)


def test_market_imports_neither_torch_nor_the_trainer():
    bad = [f"{imp}" for imp in all_imports()
           if top_folder(imp.importer) == "market" and top_folder(imp.imported) not in MARKET_MAY_IMPORT]
    for path in (SRC / "market").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            bad += [f"{path.relative_to(SRC.parent)}:{node.lineno} imports {n}" for n in names
                    if n.split(".")[0] == "torch"]
    assert not bad, "the market must run without torch and without the trainer:\n" + "\n".join(bad)


def test_the_checks_see_a_planted_cycle_and_an_upward_import():
    """The checks are only as good as the graph: a cycle and an upward import made on purpose are found."""
    planted = {"a": {"b": None}, "b": {"c": None}, "c": {"a": None}, "d": {"a": None}}
    assert find_cycles(planted) == [["a", "b", "c", "a"]]
    assert any(imp.importer == "runyard.cli" or imp.importer.startswith("runyard.cli.") for imp in all_imports())
    assert RANK["cli"] > RANK["train"] > RANK["plan"] > RANK["model"] > RANK["spec"] > RANK["system"]
    planted_import = Import("runyard.train.loop", "runyard.plan.sizing", SRC / "train" / "loop.py", 1, False)
    assert forbidden_imports([planted_import]) == [
        f"  {planted_import}: {FORBIDDEN['train', 'plan']}"]


def test_train_loop_checkpoints_through_the_interface():
    loop = {imp.imported for imp in imports_of(SRC / "train" / "loop.py")}
    assert "runyard.train.checkpoint" in loop or "runyard.train.checkpoint.training" in loop
    parallel = {imp.imported for imp in imports_of(SRC / "train" / "parallel.py")}
    assert not any(d.startswith("runyard.train.checkpoint") for d in parallel), \
        "parallel knows processes and collectives, nothing of checkpoints"


def _files_under(entries: list[str]) -> list[Path]:
    files = []
    for entry in entries:
        p = SRC / entry
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return files


def _deferred(node: ast.Import | ast.ImportFrom) -> bool:
    def named(module: str) -> bool:
        return any(module == d or module.startswith(d + ".") for d in DEFERRED_IMPORTS)

    if isinstance(node, ast.Import):
        return all(named(a.name) for a in node.names)
    # `from PACKAGE import MODULE` (from torch.distributed import pipelining) names MODULE
    return named(node.module or "") or all(named(f"{node.module}.{a.name}") for a in node.names)


def local_imports(path: Path) -> list[str]:
    """Every import inside a function (of any module, runyard's or not) but the DEFERRED_IMPORTS:
    `file:line import`."""
    found, name = [], path.relative_to(SRC) if path.is_relative_to(SRC) else path.name
    for func in ast.walk(ast.parse(path.read_text())):
        if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            found += [f"{name}:{node.lineno} {ast.unparse(node)}" for node in ast.walk(func)
                      if isinstance(node, ast.Import | ast.ImportFrom) and not _deferred(node)]
    return found


def test_deferred_imports_are_only_the_named_heavy_modules(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from torch.distributed.fsdp import fully_shard\n"
                       "    from torch.distributed import pipelining\n"
                       "    from runyard.train.checkpoint import dcp_storage\n"
                       "    from runyard.train.checkpoint import training\n"
                       "    from runyard.train import loop\n    import json\n")
    found = [line.split(" ", 1)[1] for line in local_imports(planted)]
    assert found == ["from runyard.train.checkpoint import training", "from runyard.train import loop", "import json"]


@pytest.mark.parametrize("path", _files_under(NO_LOCAL_IMPORTS), ids=lambda p: str(p.relative_to(SRC)))
def test_no_function_level_imports(path):
    assert local_imports(path) == []
