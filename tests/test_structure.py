"""The package layout the README promises: dependencies run one way, config and solver are plain
data, no entry point imports another, and what the entry points share imports none of them."""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("config", "solver", "kernels", "model", "experiments")


def modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of the project's packages (subpackages too)."""
    out = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                parts = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = os.path.join(folder, name)
    return out


def project_imports() -> dict[str, set[str]]:
    """Module -> project modules it imports (module level and inside functions), from the source."""
    graph = {}
    for mod, path in modules().items():
        is_package = path.endswith("__init__.py")
        here = mod.split(".") if is_package else mod.split(".")[:-1]
        tree = ast.parse(open(path).read())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:  # relative to this module's package
                    base = ".".join(here[: len(here) - node.level + 1])
                    target = f"{base}.{node.module}" if node.module else base
                    deps |= {target} if node.module else {f"{base}.{a.name}" for a in node.names}
                elif node.module and node.module.split(".")[0] in PACKAGES:
                    deps.add(node.module)
                    deps |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import module`
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
        known = set(modules())
        graph[mod] = {d for d in deps if d != mod and d in known}
    return graph


def entry_points() -> set[str]:
    """Modules run with python -m: a package's __main__, or a module with a __main__ guard."""
    out = set()
    for mod, path in modules().items():
        source = open(path).read()
        if mod.endswith(".__main__") or 'if __name__ == "__main__":' in source:
            out.add(mod)
    return out


def test_the_import_graph_has_no_circle():
    graph = project_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if d not in graph or d == m.rsplit(".", 1)[0]:
                continue  # a module's own package (its __init__ re-exports)
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
        if mod.startswith("config"):
            assert not top, f"{mod} imports {top}: config imports nothing of ours"
        if mod.startswith("kernels"):
            assert not top, f"{mod} imports {top}: kernels import nothing of ours"
        if mod.startswith("solver"):
            assert top <= {"config"}, f"{mod} imports {top}: solver is plain data and imports only config"
        if not mod.startswith("experiments"):
            assert "experiments" not in top, f"{mod} imports experiments: nothing imports the entry points"


def test_no_entry_point_imports_another_and_the_shared_part_imports_none():
    graph, mains = project_imports(), entry_points()
    assert {"experiments.train.__main__", "experiments.ablation.__main__", "experiments.gpu_check.__main__"} <= mains
    for mod in mains:
        others = (graph[mod] & mains) - {mod}
        assert not others, f"entry point {mod} imports entry point(s) {sorted(others)}: share code through a component"
    for mod, deps in graph.items():
        if mod.startswith("experiments.common"):
            outside = {d for d in deps if d.startswith("experiments.") and not d.startswith("experiments.common")}
            assert not outside, f"{mod} imports {sorted(outside)}: experiments.common imports no other part of experiments"


def test_config_and_solver_import_no_torch():
    # a fresh interpreter: this test process has torch loaded already
    code = (
        "import importlib, pkgutil, sys, config, solver\n"
        "for p in (config, solver):\n"
        "    for m in pkgutil.iter_modules(p.__path__): importlib.import_module(p.__name__ + '.' + m.name)\n"
        "print(sorted({n.split('.')[0] for n in sys.modules} & {'torch', 'triton', 'kernels', 'model', 'experiments'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_config_is_the_standard_library_alone():
    for mod, path in modules().items():
        if not mod.startswith("config"):
            continue
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            for n in names:
                top = n.split(".")[0]
                assert top in sys.stdlib_module_names or top == "__future__" or top == "config", f"{mod} imports {n}"
