"""The package's layers (ARCHITECTURE.md §4): each imports only the layers below it, and no module
imports itself back through others. Every import statement counts, the lazy ones inside functions
too, except those under ``if TYPE_CHECKING:`` (annotations only)."""

import ast
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_actq"
# Lowest first. The top level (the package's __init__, __main__, demo, testing) may import
# anything.
FLOORS = {
    "fewbit": 1,
    "kernels": 2,
    "codecs": 3,
    "ops": 4,
    "adaptive": 5,
    "config": 6,
    "memory": 7,
    "integrations": 8,
    "report": 9,
}
TOP = 10


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["hf_actq", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _runtime_nodes(tree: ast.AST):
    """Every node but the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _imports(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported hf_actq module: line}."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for node in _runtime_nodes(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                if not target.startswith("hf_actq"):
                    continue
                while target not in modules:  # a name inside a module: the module
                    target = target.rsplit(".", 1)[0]
                if target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def _floor(module: str) -> int:
    parts = module.split(".")
    return FLOORS.get(parts[1], TOP) if len(parts) > 1 else TOP


def test_every_layer_imports_only_the_layers_below_it():
    upward = []
    for module, edges in _imports(_modules()).items():
        for target, line in edges.items():
            same_layer = module.split(".")[:2] == target.split(".")[:2]
            if not same_layer and _floor(target) >= _floor(module) and _floor(module) != TOP:
                upward.append(f"{module} (line {line}) imports {target}")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_module_imports_itself_back():
    graph = {m: set(edges) for m, edges in _imports(_modules()).items()}
    cycles = []
    # Tarjan's strongly connected components: any with two or more modules is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles, f"import circles: {cycles}"


def test_the_check_sees_an_upward_import_and_a_circle(tmp_path, monkeypatch):
    """The two checks above fail on a package that breaks them."""
    package = tmp_path / "hf_actq"
    for name, text in {
        "__init__.py": "",
        "codecs/__init__.py": "",
        "codecs/a.py": "def f():\n    from hf_actq.ops.b import g\n",
        "ops/__init__.py": "",
        "ops/b.py": "from hf_actq.ops.c import h\n",
        "ops/c.py": "from hf_actq.ops import b\n",
    }.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    graph = _imports(_modules())
    assert graph["hf_actq.codecs.a"] == {"hf_actq.ops.b": 2}
    with pytest.raises(AssertionError, match=r"hf_actq.codecs.a \(line 2\) imports hf_actq.ops.b"):
        test_every_layer_imports_only_the_layers_below_it()
    with pytest.raises(AssertionError, match=re.escape("['hf_actq.ops.b', 'hf_actq.ops.c']")):
        test_no_module_imports_itself_back()
