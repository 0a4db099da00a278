"""python -m experiments.advise: the decision, held to the ablation run separately on the same
settings (each point's figures) and to its own rule (the least whole-run time among the candidates,
or the baseline where none saves --min-gain on every seed); and the table of what ran on a GPU,
held to the GPU tests it names."""

import ast
import json
import os

import pytest

import experiments.ablation.__main__ as ablation
import experiments.advise.__main__ as advise
from experiments.common.gpu_pieces import EVERY_MODE, KIND_PIECES, PIECES, gpu_status, pieces_of
from solver.cost import sparse_cost
from solver.modes import MODE_TABLE, REFERENCE, mode_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--model", "tiny", "--workload", "tiny", "--world-size", "8", "--gpus-per-node", "2", "--tokens-per-rank", "32", "--steps", "25"]


@pytest.fixture(scope="module")
def decision(tmp_path_factory):
    out = tmp_path_factory.mktemp("advise")
    result = advise.main([*SMALL, "--seeds", "2", "--vary-ratio", "1", "--vary-fill", "0.5", "--no-progress", "--out", str(out)])
    return result, out


@pytest.mark.slow  # the decision's runs start processes
def test_advise_gives_each_modes_whole_run_as_the_ablation_does(decision, tmp_path):
    """The main run's figures are the ablation's --whole-run over the same seeds, mode by mode, and
    the controls are left out of the candidates."""
    result, _ = decision
    _, summary = ablation.main([*SMALL, "--seeds", "2", "--whole-run", "--no-progress", "--out", str(tmp_path / "a")])
    controls = {m.name for m in MODE_TABLE if m.control}
    assert set(result["modes"]) == set(summary["whole_run"]["over_seeds"]) - controls and REFERENCE in result["modes"]
    for m, e in result["modes"].items():
        assert e["whole_run_pct"] == pytest.approx(summary["whole_run"]["over_seeds"][m])
        assert e["selected_steps_pct"] == pytest.approx(summary["over_seeds"][m]["time_change_pct"])


@pytest.mark.slow  # the decision's runs start processes
def test_each_sensitivity_point_is_the_ablation_at_that_ratio_or_fill(decision, tmp_path):
    result, _ = decision
    points = {(p["factor"], p["value"]): p for p in result["sensitivity"]}
    own = result["config"]  # the run's own ratio and fill (the tiny workload sets its batch in tokens)
    assert set(points) == {("ratio", 1.0), ("ratio", own["hardware"]["inter_intra_ratio"]), ("fill", 0.5), ("fill", own["fill"])}
    for (factor, value), flag in ((("ratio", 1.0), ["--ratio", "1"]), (("fill", 0.5), ["--fill", "0.5"])):
        _, s = ablation.main([*SMALL, *flag, "--seeds", "1", "--whole-run", "--no-progress", "--out", str(tmp_path / factor)])
        for m, v in points[(factor, value)]["whole_run"].items():
            assert v == pytest.approx(s["whole_run"]["over_seeds"][m]["mean"]), (factor, m)


@pytest.mark.slow  # the decision's runs start processes
def test_the_recommendation_is_the_least_whole_run_time_that_pays_on_every_seed(decision):
    result, _ = decision
    modes = result["modes"]
    others = [m for m in modes if m != REFERENCE]
    least = min(others, key=lambda m: (modes[m]["whole_run_pct"]["mean"], modes[m]["plan_ms_per_step"]))  # ties: the faster planner
    if modes[least]["whole_run_pct"]["max"] <= -result["min_gain_pct"]:
        assert result["pays"] and result["recommended"] == least
        rest = sorted((m for m in others if m != least), key=lambda m: (modes[m]["whole_run_pct"]["mean"], modes[m]["plan_ms_per_step"]))
        assert result["runner_up"] == rest[0]
    else:
        assert not result["pays"] and result["recommended"] == REFERENCE


@pytest.mark.slow  # the decision's runs start processes
def test_no_mode_pays_is_said_plainly_and_the_baseline_recommended(tmp_path, capsys):
    result = advise.main([*SMALL, "--seeds", "1", "--min-gain", "99", "--vary-ratio", "1", "--vary-fill", "0.5", "--no-progress",
                          "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert not result["pays"] and result["recommended"] == REFERENCE
    assert "no mode pays here" in out and "run the baseline" in out


@pytest.mark.slow  # the decision's runs start processes
def test_advise_writes_its_figures_and_a_plot(decision):
    result, out = decision
    with open(out / "advise.json") as f:
        written = json.load(f)
    assert written["recommended"] == result["recommended"] and written["provenance"]["commit"]
    assert (out / "advise.png").stat().st_size > 0


@pytest.mark.parametrize(
    "flag, message",
    [
        (["--vary-ratio", "1,0"], r"advise.vary_ratio=|--vary-ratio"),
        (["--vary-fill", "1.5"], r"--vary-fill"),
        (["--min-gain", "-1"], r"--min-gain"),
    ],
)
def test_a_bad_sensitivity_setting_is_one_line(flag, message, tmp_path):
    with pytest.raises(SystemExit, match=message) as e:
        advise.main([*SMALL, *flag, "--out", str(tmp_path)])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "flag, message",
    [
        (["--seeds", "2"], r"--seeds is not read: --trace=.* is one fixed workload"),
        (["--sensitivity-seeds", "2"], r"--sensitivity-seeds is not read: --trace="),
        (["--vary-fill", "0.5"], r"--vary-fill is not read: --trace=.* no fill is varied"),
    ],
)
def test_settings_a_trace_makes_unread_are_refused(flag, message, tmp_path):
    """A trace is one fixed workload: more seeds, or fills, would be recorded and never used."""
    trace = tmp_path / "t.csv"
    trace.write_text("step,length\n0,40\n0,30\n")
    with pytest.raises(SystemExit, match=message):
        advise.main([*SMALL[:8], "--trace", str(trace), *flag, "--out", str(tmp_path / "o")])


def _test_functions(path: str) -> dict[str, list[str]]:
    """Test function -> the names of its decorators' attributes (the gpu marker gives 'gpu'), and
    the module's pytestmark's, from the source."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    module_marks = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            module_marks += [n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute)]
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            marks = [n.attr for d in node.decorator_list for n in ast.walk(d) if isinstance(n, ast.Attribute)]
            out[node.name] = marks + module_marks
    return out


def test_every_gpu_test_the_table_names_exists_and_carries_the_gpu_marker():
    named = [t for p in PIECES.values() for t in p.tests]
    assert named, "the table names no GPU test"
    for test in named:
        path, name = test.split("::")
        functions = _test_functions(path)
        assert name in functions, f"{test}: no such test"
        assert "gpu" in functions[name], f"{test} does not carry the gpu marker: pytest -m gpu would not run it"


def test_a_piece_that_ran_names_its_run_and_the_gpu_tests_that_check_it():
    for name, p in PIECES.items():
        if p.ran:
            assert p.tests, f"{name}: a result on a GPU with no test that produced it"
            assert "2026" in p.ran, f"{name}: a GPU result without its date"


def test_every_kind_and_mode_names_pieces_of_the_table_and_a_plugin_kind_never_ran():
    for kind in KIND_PIECES:
        for m in MODE_TABLE:
            names = pieces_of(m, sparse_cost(kind))
            assert set(names) <= set(PIECES), (kind, m.name)
            assert set(EVERY_MODE) <= set(names)
    halo, window = mode_of("halo"), sparse_cost("sliding_window")
    assert "neighbour sends across GPUs" in pieces_of(halo, window)
    assert "redistribution across GPUs" in pieces_of(mode_of("redistribute"), window)
    unknown = type("K", (), {"name": "strided", "first_key": None})()
    ran, never = gpu_status(pieces_of(mode_of("repack"), unknown))
    assert "strided" in never and "planner" not in ran + never
