"""The package's layers only point down, and no modules import each other in a cycle.

Every `import` counts, also those inside functions: a lazy import that points up is still a seam
in the wrong place.
"""

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mira"

# Bottom to top; a module may import from its own floor and the floors below. A floor's entry is a
# subpackage or a top-level module of `mira`; "mira" is the package's own __init__.
LAYERS = [
    ["errors"],
    ["models"],
    ["store", "charts"],
    ["kernels"],
    ["cache"],
    ["predict"],
    ["runtime"],
    ["bench", "eval", "serve", "cli_args"],
    ["cli", "mira"],
]
FLOOR = {part: floor for floor, parts in enumerate(LAYERS) for part in parts}


def _module_name(path: Path, root: Path) -> str:
    parts = ("mira", *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path) -> set[str]:
    """The mira modules `path` imports, absolute (`from mira.x import y` gives mira.x.y when that is a module)."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {module for module in found if module == "mira" or module.startswith("mira.")}


@functools.cache
def _graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the mira modules it imports, for the package at `root`."""
    modules = {_module_name(path, root): path for path in root.rglob("*.py")}
    return {name: {m for m in _imports(path, root) if m in modules and m != name} for name, path in modules.items()}


def _part(module: str) -> str:
    return module.split(".")[1] if "." in module else "mira"


def test_every_module_sits_on_a_floor():
    assert sorted({_part(m) for m in _graph()} - set(FLOOR)) == []


@pytest.mark.parametrize("module", sorted(_graph()))
def test_imports_point_down(module):
    up = sorted(t for t in _graph()[module] if FLOOR[_part(t)] > FLOOR[_part(module)])
    assert up == [], f"{module} imports from a higher layer: {up}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_check_sees_an_upward_import_and_a_cycle(tmp_path):
    """The checks above fail where they should: a store module importing the runtime, two modules in a loop."""
    fake = tmp_path / "mira"
    for name, text in {"__init__.py": "", "store/__init__.py": "", "store/a.py": "from mira.runtime.b import x\n",
                       "runtime/__init__.py": "", "runtime/b.py": "from mira.store import a\n"}.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    graph = _graph(fake)
    assert graph["mira.store.a"] == {"mira.runtime.b"}
    assert FLOOR[_part("mira.runtime.b")] > FLOOR[_part("mira.store.a")]
    assert _cycles(graph) == [["mira.runtime.b", "mira.store.a", "mira.runtime.b"]]
