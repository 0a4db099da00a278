"""Faults that once lost data: a new run's checkpoints written over another run's, a resume that
cannot pass another run's checkpoint, a results folder re-run over what is there."""

import os
import shutil

import pytest

from experiments.common.errors import InputError
from experiments.report.plots import load_or_run_ablation
from experiments.train import checkpoint
from experiments.train.checkpoint import CheckpointError
from tests.dist_utils import ROOT, forked_driver, run_distributed
from tests.test_checkpoints import CFG, _model_and_opt, _nothing, _train_a_step, _weights


def _resume_body(rank, world, root):
    """Run A writes steps 2 and 4; run B's step 6 lands in the same folder and `latest` names it:
    A's --resume skips B's checkpoint, with a warning naming it, to A's newest (step 4); B's own
    resume takes step 6."""
    import torch.distributed as dist

    ck = os.path.join(root, "ck")
    a = {"model": CFG.to_dict(), "fingerprint": {"seed": 0}, "scheduler": {}, "rows": []}
    b = {**a, "fingerprint": {"seed": 1}}
    model, opt = _model_and_opt()
    _train_a_step(model, opt, 1)
    checkpoint.save(ck, 2, model, opt, a)
    _train_a_step(model, opt, 2)
    checkpoint.save(ck, 4, model, opt, a)
    at4 = _weights(model)
    other, oopt = _model_and_opt(seed=5)
    checkpoint.save(os.path.join(root, "b"), 6, other, oopt, b)
    dist.barrier()
    if rank == 0:
        shutil.copytree(os.path.join(root, "b", "step_0000006"), os.path.join(ck, "step_0000006"))
        with open(os.path.join(ck, "latest"), "w") as fh:
            fh.write("step_0000006")
    dist.barrier()
    expect_a = {"world_size": world, "model": CFG.to_dict(), "fingerprint": {"seed": 0}}
    fresh, fopt = _model_and_opt(seed=9)
    warned = (
        pytest.warns(UserWarning, match=r"step_0000006 is unusable \(.* is of another run: seed=1 there, 0 here")
        if rank == 0
        else _nothing()
    )
    with warned:
        assert checkpoint.load(ck, fresh, fopt, expect_a)["step"] == 4
    assert all(v.equal(at4[n]) for n, v in _weights(fresh).items())
    assert checkpoint.load(ck, *_model_and_opt(), {**expect_a, "fingerprint": {"seed": 1}})["step"] == 6
    # a new run (no --resume) is refused, naming whose checkpoints are there and what to do
    with pytest.raises(CheckpointError, match=r"holds checkpoints \(step_0000006, step_0000004, step_0000002\), another run's"):
        checkpoint.refuse_others(ck, {**expect_a, "fingerprint": {"seed": 7}})
    with pytest.raises(CheckpointError, match=r"this run's own, up to step 6: --resume continues it"):
        checkpoint.refuse_others(ck, {**expect_a, "fingerprint": {"seed": 1}})


@pytest.mark.slow
def test_resume_skips_another_runs_checkpoints_to_its_own_newest(tmp_path):
    run_distributed(_resume_body, 2, str(tmp_path))


@pytest.mark.slow
def test_a_new_run_never_writes_over_another_runs_checkpoints(tmp_path):
    ck = tmp_path / "ck"
    first = ("--steps", "2", "--save-every", "2", "--ckpt-dir", str(ck), "--tokens-per-rank", "64")
    p = forked_driver(1, *first, "--out", str(tmp_path / "a"))
    assert p.returncode == 0, p.stderr[-2000:]
    before = {f: os.path.getmtime(ck / f) for f in os.listdir(ck)}
    p = forked_driver(1, *first, "--seed", "1", "--out", str(tmp_path / "b"))
    assert p.returncode != 0
    assert "--ckpt-dir" in p.stderr and "holds checkpoints (step_0000002), another run's" in p.stderr
    assert "workload.seed=0 there, 1 here" in p.stderr and " loss " not in p.stdout
    assert {f: os.path.getmtime(ck / f) for f in os.listdir(ck)} == before  # untouched, `latest` too


def test_an_incomplete_results_folder_is_never_run_over(tmp_path):
    folder = tmp_path / "ablation"
    folder.mkdir()
    (folder / "steps.csv").write_text("engine,mode\n")
    with pytest.raises(InputError, match=r"holds \['steps.csv'\] but not \['summary.json'\]: an incomplete run"):
        load_or_run_ablation(str(folder))
    assert (folder / "steps.csv").read_text() == "engine,mode\n" and not (folder / "summary.json").exists()


class _Holder:
    """Another process that holds a folder's run lock (as a run writing into it does) until closed."""

    def __init__(self, *folders):
        import subprocess
        import sys

        code = "import sys\nfrom experiments.common.files import lock_folder\n" + "".join(
            f"lock_folder({str(f)!r})\n" for f in folders
        ) + "print('held', flush=True)\nsys.stdin.read()\n"  # fmt: skip
        self.p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline().strip() == "held"

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=30)


def test_a_second_run_into_a_folder_in_use_is_refused_and_the_first_keeps_its_files(tmp_path):
    import experiments.ablation.__main__ as ablation

    out = tmp_path / "o"
    holder = _Holder(out)
    try:
        with pytest.raises(SystemExit, match=r"--out '.*o' is in use by another run \(process \d+ holds its lock"):
            ablation.main(["--seeds", "1", "--steps", "3", "--out", str(out), "--no-progress", "--no-whole-run"])
        assert os.listdir(out) == []
    finally:
        holder.close()
    ablation.main(["--seeds", "1", "--steps", "3", "--out", str(out), "--no-progress", "--no-whole-run"])  # the lock went with its process
    assert {"steps.csv", "summary.json"} <= set(os.listdir(out))


@pytest.mark.slow
def test_a_training_run_into_a_checkpoint_folder_in_use_is_refused(tmp_path):
    ck = tmp_path / "ck"
    holder = _Holder(ck)
    try:
        args = ("--steps", "2", "--save-every", "2", "--ckpt-dir", str(ck), "--tokens-per-rank", "64", "--out", str(tmp_path / "a"))
        p = forked_driver(1, *args)
    finally:
        holder.close()
    assert p.returncode != 0 and " loss " not in p.stdout
    assert f"--ckpt-dir {str(ck)!r} is in use by another run" in p.stderr, p.stderr[-2000:]


def test_a_block_left_open_in_a_doc_is_refused_and_no_doc_is_touched(tmp_path, capsys):
    import experiments.report.__main__ as report

    docs = tmp_path / "docs"
    docs.mkdir()
    body = (
        "# results\n\n<!-- report:memory -->\nold table\n\nA paragraph written by hand.\n\n"
        "<!-- report:memory -->\n![figure](figures/x.png)\n<!-- /report -->\n"
    )
    (docs / "a.md").write_text(body)
    (docs / "b.md").write_text("<!-- report:memory -->\nx\n<!-- /report -->\n")  # fine on its own: not written either
    with pytest.raises(SystemExit) as exit_:
        report.main(["--docs", str(docs), "--results", str(tmp_path / "r")])
    assert exit_.value.code == 2  # a user's error, as every entry point's
    err = capsys.readouterr().err
    assert "a.md line 3: the block opened there has no closing <!-- /report --> before the next block (line 8)" in err
    assert (docs / "a.md").read_text() == body and (docs / "b.md").read_text() == "<!-- report:memory -->\nx\n<!-- /report -->\n"


def test_report_check_names_a_block_whose_figures_went_stale_and_writes_nothing(tmp_path):
    """The docs' check (report --check) against its yardstick, a fresh render: a block rendered from
    code passes as committed and fails, named with the line that differs, once a figure in it is
    typed over by hand; the doc itself is never written."""
    from experiments.report.__main__ import BLOCK, render_doc
    from experiments.report.check import check

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# memory\n\n<!-- report:memory -->\nold\n<!-- /report -->\n")
    fresh, _ = render_doc(str(docs / "a.md"), str(tmp_path / "results"), str(docs))
    (docs / "a.md").write_text(fresh)
    out = tmp_path / "log.txt"
    with open(out, "w") as log:
        assert check(str(docs), render_doc, BLOCK, out=log) == []
    stale = fresh.replace("264.2", "199.9")  # the paper model on 8 GPUs, typed over
    assert stale != fresh
    (docs / "a.md").write_text(stale)
    with open(out, "w") as log:
        problems = check(str(docs), render_doc, BLOCK, out=log)
    assert (
        len(problems) == 1 and "a.md: block memory  differs from a fresh run: committed '| `paper` | 119.25B | FSDP2 | 199.9" in problems[0]
    )
    assert (docs / "a.md").read_text() == stale


def test_a_refused_report_writes_no_figure_either(tmp_path, capsys):
    """A doc with a block left open is refused before any figure of another doc is drawn into
    docs/figures/: the docs are never left with new figures beside old tables."""
    import experiments.report.__main__ as report

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("<!-- report:figure layouts -->\nold\n<!-- /report -->\n")  # drawn from code alone
    (docs / "b.md").write_text("<!-- report:memory -->\nleft open\n")
    with pytest.raises(SystemExit) as exit_:
        report.main(["--docs", str(docs), "--results", str(tmp_path / "r"), "--no-progress"])
    assert exit_.value.code == 2
    assert "b.md line 1: the block opened there has no closing" in capsys.readouterr().err
    assert sorted(os.listdir(docs)) == ["a.md", "b.md"], "no figure (nor staging folder) was written"
    (docs / "b.md").write_text("<!-- report:memory -->\nclosed\n<!-- /report -->\n")
    assert report.main(["--docs", str(docs), "--results", str(tmp_path / "r"), "--no-progress"]) == 0
    assert sorted(os.listdir(docs)) == ["a.md", "b.md", "figures"] and os.listdir(docs / "figures") == ["layouts.png"]
    assert "](figures/layouts.png)" in (docs / "a.md").read_text()
