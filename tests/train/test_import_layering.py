"""No import circles in train/, model/, plan/ and serve/export, and no function-level import hiding one.

The import graph is read from the source, so a circle shows up here even where the interpreter happens
to get through it in one import order. Every import counts (one inside a function too: it is the circle
it hides), except those under `if TYPE_CHECKING:`, which never run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import runyard

SRC = Path(runyard.__file__).parent
CHECKED = ["train", "model", "plan", "serve/export.py", "evaluate"]
# Files that must not import inside functions (optional extras would be the one exception).
NO_LOCAL_IMPORTS = [
    "train/checkpoint", "train/parallel.py", "train/loop.py", "train/metrics.py", "train/rng.py", "model",
    "plan/sizing.py", "serve/export.py", "serve/engine.py", "data/loader.py", "evaluate", "cli",
]


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


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def module_imports(path: Path) -> set[str]:
    """The runyard modules `path` imports when it is imported."""
    out: set[str] = set()
    body = [n for n in ast.parse(path.read_text()).body if not _is_type_checking(n)]
    for node in (n for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Import | ast.ImportFrom)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if module_path(f"{node.module}.{a.name}") else node.module
                     for a in node.names]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] == "runyard" and module_path(n))
    return out


def local_imports(path: Path) -> list[str]:
    """Imports inside functions: `file:line module`."""
    found = []
    for func in ast.walk(ast.parse(path.read_text())):
        if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(func):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} {ast.unparse(node)}")
    return found


def files_under(entries: list[str]) -> list[Path]:
    files = []
    for entry in entries:
        p = SRC / entry
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return files


def test_no_import_circles_through_train_model_plan_and_export():
    graph: dict[str, set[str]] = {}
    todo = [module_name(p) for p in files_under(CHECKED)]
    while todo:
        name = todo.pop()
        if name in graph:
            continue
        graph[name] = {d for d in module_imports(module_path(name)) if not name.startswith(d + ".")}
        todo += graph[name]
    checked = {module_name(p) for p in files_under(CHECKED)}
    circles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                circle = stack[stack.index(dep):] + [dep]
                if checked & set(circle):
                    circles.append(" -> ".join(circle))
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles:\n" + "\n".join(circles)
    assert "runyard.train.checkpoint.training" in graph["runyard.train.loop"] | {
        d for d in graph["runyard.train.checkpoint"]}
    assert not any(d.startswith("runyard.train.checkpoint") for d in graph["runyard.train.parallel"]), \
        "parallel knows processes and collectives, nothing of checkpoints"


@pytest.mark.parametrize("path", files_under(NO_LOCAL_IMPORTS), ids=lambda p: str(p.relative_to(SRC)))
def test_no_function_level_imports(path):
    assert local_imports(path) == []
