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


def mode_name_uses(path: str, names: set[str]) -> list[str]:
    """Where a module compares, indexes or slices mode names: a mode name's string constant in a
    comparison (==, !=, in, not in, also inside a tuple or set compared against), as a subscript's
    index, or a slice of a tuple of modes or one of its modes by a fixed position (MODES[1:],
    PAPER_MODES[1])."""
    tree = ast.parse(open(path).read())
    out = []

    def is_name(node) -> bool:
        return isinstance(node, ast.Constant) and node.value in names

    def holds_name(node) -> bool:
        return is_name(node) or (isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(is_name(e) for e in node.elts))

    for node in ast.walk(tree):
        where = f"{os.path.relpath(path, ROOT)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Compare) and any(holds_name(x) for x in [node.left, *node.comparators]):
            out.append(f"{where}: compares a mode name")
        elif isinstance(node, ast.Subscript):
            if holds_name(node.slice):
                out.append(f"{where}: indexes by a mode name")
            if isinstance(node.value, ast.Name) and node.value.id.endswith("MODES"):
                if isinstance(node.slice, ast.Slice):
                    out.append(f"{where}: slices {node.value.id}")
                elif isinstance(node.slice, ast.Constant) or isinstance(node.slice, ast.UnaryOp):
                    out.append(f"{where}: takes a mode of {node.value.id} by its position")
    return out


def test_only_the_mode_table_compares_indexes_or_slices_mode_names():
    """How a step runs is data (solver.modes): outside the table's module (and the tests), no code
    branches on a mode's name, indexes a result by one, or slices a list of modes; it reads the
    mode's record or the plan."""
    from solver.modes import MODES

    names = set(MODES)
    found = []
    for mod, path in modules().items():
        if mod != "solver.modes":
            found += mode_name_uses(path, names)
    assert not found, "\n".join(found)


def test_the_mode_name_check_finds_what_it_looks_for(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        'if plan.mode == "redistribute": pass\nx = over["baseline"]\ny = m in ("halo", "other")\nz = MODES[:3]\n'
        'ok = make_plan(s, c, cost, "repack")\nw = PAPER_MODES[1]\nv = MODES[-1]\nfine = [MODES[i] for i in order]\n'
    )
    got = mode_name_uses(str(path), {"redistribute", "baseline", "halo", "repack"})
    assert [g.split(": ", 1)[1] for g in got] == [
        "compares a mode name",
        "indexes by a mode name",
        "compares a mode name",
        "slices MODES",
    ] + [
        "takes a mode of PAPER_MODES by its position",
        "takes a mode of MODES by its position",
    ]


def test_every_entry_point_parses_and_fails_one_way():
    """Every entry point reads its command line through experiments.common.entry.parse (checked and
    prepared) and ends a user's error through it (one line, exit code 2): none parses its COMMAND
    itself or exits with a message of its own."""
    own = []
    for mod in sorted(entry_points()):
        source = open(modules()[mod]).read()
        if "COMMAND.parse(" in source:
            own.append(f"{mod}: parses its command line itself")
        if 'sys.exit(f"error' in source or 'sys.exit("error' in source:
            own.append(f"{mod}: exits with an error line of its own")
        if "entry.parse(" not in source:
            own.append(f"{mod}: does not parse through experiments.common.entry")
    assert not own, "\n".join(own)


def test_what_other_entry_points_share_lives_in_common_not_in_an_entry_points_package():
    """experiments/common/ holds what several entry points use; no entry point's package imports
    another's (the benchmarks and the report once took the memory estimate and the random tokens
    from experiments/train/)."""
    graph = project_imports()
    crossing = []
    for mod, deps in graph.items():
        parts = mod.split(".")
        if parts[0] != "experiments" or len(parts) < 2 or parts[1] == "common":
            continue
        for d in deps:
            dp = d.split(".")
            if dp[0] == "experiments" and len(dp) > 1 and dp[1] not in ("common", parts[1]):
                crossing.append(f"{mod} imports {d}")
    assert not crossing, "\n".join(crossing)


def test_every_section_of_the_config_tree_lives_in_config():
    """docs/configuration.md: one tree of sections in config/ (the entry points' own in
    config.entries), so a reader finds every setting in one place."""
    outside = []
    for mod, path in modules().items():
        if mod.startswith("config"):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", getattr(b, "attr", None)) == "Section" for b in node.bases):
                outside.append(f"{mod}.{node.name}")
    assert not outside, f"sections outside config/: {outside}"
