"""Every notebook executes on CPU without error (outputs are not committed)."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

import experiments.ablation.__main__ as ablation
from experiments.ablation import sweep

NB_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
NOTEBOOKS = sorted(f for f in os.listdir(NB_DIR) if f.endswith(".ipynb"))


def test_notebooks_are_committed_without_outputs():
    for name in NOTEBOOKS:
        nb = nbformat.read(os.path.join(NB_DIR, name), as_version=4)
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), name


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path, monkeypatch):
    results = tmp_path / "results"
    monkeypatch.setenv("REPACK_RESULTS", str(results))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("REPACK_NOTEBOOK_STEPS", "30")  # the sparse kinds' ablations and the decision: a smoke run
    monkeypatch.setenv("REPACK_NOTEBOOK_SEEDS", "1")
    monkeypatch.setenv("REPACK_NOTEBOOK_RANKS", "32")
    if name == "ablation.ipynb":
        # a short ablation for the notebook to read (with none it runs the default one: ~1 minute)
        ablation.main(["--seeds", "2", "--steps", "30", "--out", str(results / "ablation"), "--no-progress", "--no-whole-run"])
        sweep.main(["--factors", "fill,ratio", "--seeds", "1", "--steps", "8", "--out", str(results / "sweep")])
    nb = nbformat.read(os.path.join(NB_DIR, name), as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": NB_DIR}}).execute()
