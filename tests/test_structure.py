"""The package layout the README promises: dependencies run one way, solver is plain data."""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("solver", "kernels", "model", "experiments")


def project_imports() -> dict[str, set[str]]:
    """Module -> project modules it imports (module level and inside functions), from the source."""
    graph = {}
    for pkg in PACKAGES:
        for name in sorted(os.listdir(os.path.join(ROOT, pkg))):
            if not name.endswith(".py"):
                continue
            mod = f"{pkg}.{name[:-3]}" if name != "__init__.py" else pkg
            tree = ast.parse(open(os.path.join(ROOT, pkg, name)).read())
            deps = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    if node.level:  # relative: inside this package
                        base = pkg if node.level == 1 else ""
                        target = f"{base}.{node.module}" if node.module else base
                        deps |= {target} if node.module else {f"{base}.{a.name}" for a in node.names}
                    elif node.module and node.module.split(".")[0] in PACKAGES:
                        deps.add(node.module)
                elif isinstance(node, ast.Import):
                    deps |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
            graph[mod] = {d for d in deps if d != mod}
    return graph


def test_the_import_graph_has_no_circle():
    graph = project_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue  # a package's __init__ re-export resolved to the package itself
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(d) :] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_dependencies_run_one_way():
    graph = project_imports()
    for mod, deps in graph.items():
        top = {d.split(".")[0] for d in deps} - {mod.split(".")[0]}
        if mod.startswith("kernels"):
            assert not top, f"{mod} imports {top}: kernels import nothing of ours"
        if mod.startswith("solver"):
            assert not top, f"{mod} imports {top}: solver is plain data and imports no other package of ours"
        if not mod.startswith("experiments"):
            assert "experiments" not in top, f"{mod} imports experiments: nothing imports the entry points"


def test_solver_imports_no_torch():
    # a fresh interpreter: this test process has torch loaded already
    code = (
        "import importlib, pkgutil, sys, solver\n"
        "for m in pkgutil.iter_modules(solver.__path__): importlib.import_module('solver.' + m.name)\n"
        "print(sorted({n.split('.')[0] for n in sys.modules} & {'torch', 'triton', 'kernels', 'model', 'experiments'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
