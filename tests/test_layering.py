"""The house's layout holds: no Python file over 600 lines, no import circle among our modules,
and the boundaries of DESIGN.md between roles (read from the source, function-local and
type-checking imports included, so a lazy import cannot hide a dependency)."""

import ast
import os
import subprocess
import sys
from typing import Dict, List, Set

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 600
# the package, and the top-level directories installed as part of it (setup.py's package_dir)
PACKAGE_DIRS = {"laminar_mcore": "laminar_mcore", "kernels": "laminar_mcore.kernels"}

# (importer, imported): a module under the first may import nothing under the second
FORBIDDEN = [
    ("controller", "trainer"),  # the controller talks to the trainer only over its API
    ("relay", "rollout"),  # relays move buckets; they know no engine code
    ("relay", "trainer"),
    ("relay", "controller"),
    ("rollout", "trainer"),  # engines never import the trainer ...
    ("rollout", "controller"),
    ("trainer", "rollout"),  # ... nor the trainer engine code
    ("trainer", "controller"),  # (but its client: ALLOWED)
    ("weights", "trainer"), ("weights", "rollout"), ("weights", "relay"),
    ("weights", "controller"),
    ("data", "trainer"), ("data", "rollout"), ("data", "relay"), ("data", "controller"),
]
# the trainer reaches the controller through its client only
ALLOWED = {("trainer", "laminar_mcore.controller.client")}


def _modules() -> Dict[str, tuple]:
    """module name -> (path, is_package) for every module of the package."""
    found = {}
    for top, name in PACKAGE_DIRS.items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, top))
                parts = [name] + rel[:-3].split(os.sep)
                package = parts[-1] == "__init__"
                if package:
                    parts = parts[:-1]
                found[".".join(parts)] = (os.path.join(dirpath, f), package)
    return found


MODULES = _modules()


def _known(name: str) -> str:
    """The longest prefix of ``name`` that is one of our modules ('' if none)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in MODULES:
        parts.pop()
    return ".".join(parts)


def _imports(module: str) -> Set[str]:
    """Our modules that ``module`` imports anywhere in its source."""
    path, package = MODULES[module]
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    names: List[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for a in node.names:
                # ``from pkg import submodule`` depends on the submodule, not on pkg's body
                sub = f"{source}.{a.name}"
                names.append(sub if sub in MODULES else source)
    return {m for m in map(_known, names) if m and m != module}


GRAPH = {m: _imports(m) for m in MODULES}


def _in(module: str, package: str) -> bool:
    prefix = f"laminar_mcore.{package}"
    return module == prefix or module.startswith(prefix + ".")


def test_no_python_file_is_over_600_lines():
    long = []
    for top in ("laminar_mcore", "kernels", "tools", "tests", "examples"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    with open(path, encoding="utf-8") as fh:
                        n = sum(1 for _ in fh)
                    if n > MAX_LINES:
                        long.append(f"{os.path.relpath(path, ROOT)}: {n} lines")
    assert not long, f"split along a real seam: {long}"


def test_no_import_circle_among_our_modules():
    # Tarjan's strongly connected components: any of more than one module is a circle
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
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
                circles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(GRAPH)))
    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not circles, f"import circles (move what they share to a neutral module): {circles}"


def test_roles_import_across_no_forbidden_boundary():
    assert GRAPH, "no modules found"
    crossings = sorted(
        f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps
        for importer, imported in FORBIDDEN
        if _in(m, importer) and _in(d, imported) and (importer, d) not in ALLOWED)
    assert not crossings, crossings


@pytest.mark.parametrize("module, absent", [
    ("laminar_mcore.controller.role", ("laminar_mcore.trainer", "megatron")),
    ("laminar_mcore.relay.server", ("laminar_mcore.rollout", "laminar_mcore.trainer",
                                    "megatron")),
])
def test_a_role_loads_without_the_code_it_must_not_need(module, absent):
    """A controller host needs no Megatron; a relay process loads no engine code."""
    code = ("import sys, importlib; importlib.import_module(%r); "
            "print('\\n'.join(sorted(sys.modules)))" % module)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=300, check=True).stdout.split()
    loaded = [m for m in out if any(m == a or m.startswith(a + ".") for a in absent)]
    assert not loaded, f"{module} loads {loaded}"
