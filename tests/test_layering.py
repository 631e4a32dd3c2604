"""The house's layout holds: no Python file over 500 lines, no import circle among our modules,
and the boundaries of DESIGN.md between roles (read from the source, function-local and
type-checking imports included, so a lazy import cannot hide a dependency), directly and
through every chain of imports."""

import ast
import os
import subprocess
import sys
from typing import Dict, List, Set

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 500  # a module of the package
MAX_TEST_LINES = 600  # a test, tool or example file
# the package, and the top-level directories installed as part of it (setup.py's package_dir)
PACKAGE_DIRS = {"laminar_mcore": "laminar_mcore", "kernels": "laminar_mcore.kernels"}

ROLES = ("trainer", "rollout", "relay", "controller", "agents")
# packages every role may use: they import no role
NEUTRAL = ("algos", "data", "weights", "models", "kernels")
# (importer, imported), the nevers: a module under the first imports nothing under the second,
# neither itself nor through any chain of our modules
FORBIDDEN = [
    ("trainer", "rollout"),  # the trainer and the engines never import each other
    ("rollout", "trainer"),
    ("controller", "trainer"),  # the controller talks to the trainer only over its API
    ("trainer", "controller"),  # (but its client: ALLOWED)
    ("rollout", "controller"),
    # the controller reaches agents only through the episode plug-in, by a dotted-name string
    ("controller", "agents"),
    ("rollout", "agents"),
    ("trainer", "agents"),
    # relays move buckets; they know no engine, trainer, controller or agent code
    ("relay", "trainer"), ("relay", "rollout"), ("relay", "controller"), ("relay", "agents"),
    ("sim", "trainer"),  # the simulator models the trainer, it does not run it
    *[(package, role) for package in NEUTRAL for role in ROLES],
]
# (importer, module) that crosses a never on purpose: the trainer reaches the controller
# through its client only
ALLOWED = {("trainer", "laminar_mcore.controller.client")}
ALLOWED_THROUGH_A_CHAIN = ALLOWED


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


def test_no_python_file_is_over_500_lines():
    """500 lines for the package's modules, 600 for tests, tools and examples."""
    long = []
    for top in ("laminar_mcore", "kernels", "tools", "tests", "examples"):
        limit = MAX_LINES if top in PACKAGE_DIRS else MAX_TEST_LINES
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    with open(path, encoding="utf-8") as fh:
                        n = sum(1 for _ in fh)
                    if n > limit:
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


def _reached(package: str) -> Dict[str, str]:
    """Our modules reachable from those under ``package`` through GRAPH: each -> its importer
    on one chain ('' for the package's own)."""
    via = {m: "" for m in MODULES if _in(m, package)}
    todo = list(via)
    while todo:
        m = todo.pop()
        for d in GRAPH[m]:
            if d not in via:
                via[d] = m
                todo.append(d)
    return via


@pytest.mark.parametrize("importer, imported", FORBIDDEN, ids=[f"{a}->{b}" for a, b in FORBIDDEN])
def test_no_never_is_crossed_through_a_chain(importer, imported):
    """A never holds through every chain of imports (sim -> bench -> trainer crosses it as
    surely as a direct import): nothing reachable from ``importer`` is under ``imported``."""
    via = _reached(importer)
    chains = []
    for m in sorted(via):
        if _in(m, imported) and (importer, m) not in ALLOWED_THROUGH_A_CHAIN:
            chain = [m]
            while via[chain[-1]]:
                chain.append(via[chain[-1]])
            chains.append(" -> ".join(reversed(chain)))
    assert not chains, chains


@pytest.mark.parametrize("module, absent", [
    ("laminar_mcore.controller.role", ("laminar_mcore.trainer", "megatron")),
    ("laminar_mcore.relay.server", ("laminar_mcore.rollout", "laminar_mcore.trainer",
                                    "megatron")),
    ("laminar_mcore.sim.calibrate", ("laminar_mcore.trainer", "megatron")),
])
def test_a_role_loads_without_the_code_it_must_not_need(module, absent):
    """A controller host needs no Megatron; a relay process loads no engine code; the
    simulator's calibration loads no trainer."""
    code = ("import sys, importlib; importlib.import_module(%r); "
            "print('\\n'.join(sorted(sys.modules)))" % module)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=300, check=True).stdout.split()
    loaded = [m for m in out if any(m == a or m.startswith(a + ".") for a in absent)]
    assert not loaded, f"{module} loads {loaded}"
