"""A result names the commit whose files it ran, also from a copy whose git folder is older than its
files (a device machine's), and the report cites it by that commit."""

import json
import os
import subprocess

import pytest

from experiments.common.provenance import commit_of_tree, git_commit, shown_commit, working_tree
from experiments.report.__main__ import provenance_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git(cwd, *args) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A repository with two commits: A (one file), B (that file changed, another added)."""
    for k, v in {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}.items():
        monkeypatch.setenv(k, v)
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q")
    (r / ".gitignore").write_text("results/\n")
    (r / "a.py").write_text("x = 1\n")
    git(r, "add", "-A")
    git(r, "commit", "-qm", "A")
    (r / "a.py").write_text("x = 2\n")
    (r / "b.py").write_text("y = 3\n")
    git(r, "add", "-A")
    git(r, "commit", "-qm", "B")
    return r, git(r, "rev-parse", "--short", "HEAD~1"), git(r, "rev-parse", "--short", "HEAD")


def test_a_clean_checkout_names_its_commit_and_that_commits_tree(repo):
    r, _, b = repo
    (r / "results").mkdir()
    (r / "results" / "out.csv").write_text("ignored\n")  # what a run writes is ignored by git
    assert git_commit(str(r)) == b
    assert working_tree(str(r)) == git(r, "rev-parse", "HEAD^{tree}")
    assert shown_commit({"commit": b, "tree": working_tree(str(r))}, str(r)) == b


def test_a_copy_whose_git_is_older_than_its_files_is_cited_by_the_commit_of_its_files(repo, tmp_path):
    r, a, b = repo
    copy = tmp_path / "copy"  # B's files over a git folder that knows only up to A, its index A's
    subprocess.run(["cp", "-a", str(r), str(copy)], check=True)
    git(copy, "reset", "-q", "--mixed", a)
    git(copy, "reflog", "expire", "--expire=now", "--all")
    (copy / ".git" / "ORIG_HEAD").unlink(missing_ok=True)
    status, index = git(copy, "status", "--porcelain"), (copy / ".git" / "index").read_bytes()
    prov = {"commit": git_commit(str(copy)), "tree": working_tree(str(copy))}
    assert prov["commit"] == f"{a}-dirty"
    assert prov["tree"] == git(r, "rev-parse", "HEAD^{tree}")  # B's files, b.py untracked there included
    assert git(copy, "status", "--porcelain") == status and (copy / ".git" / "index").read_bytes() == index
    assert git(copy, "rev-parse", "--short", "HEAD") == a
    assert shown_commit(prov, str(r)) == b  # resolved where the history holds B
    assert commit_of_tree(prov["tree"], str(copy)) is None  # the copy's git never saw B
    assert commit_of_tree(git(r, "rev-parse", "HEAD~1^{tree}"), str(r)) == a


def test_files_that_are_no_commits_keep_their_dirty_name(repo, tmp_path):
    r, a, _ = repo
    (r / "a.py").write_text("x = 4\n")  # a change no commit holds
    prov = {"commit": git_commit(str(r)), "tree": working_tree(str(r))}
    assert prov["commit"].endswith("-dirty") and prov["tree"]
    assert shown_commit(prov, str(r)) == prov["commit"]
    (r / "a.py").write_text("x = 2\n")
    (r / "stray.py").write_text("z = 5\n")  # B's tracked files, and one git does not ignore and no commit has
    git(r, "reset", "-q", "--mixed", a)
    prov = {"commit": git_commit(str(r)), "tree": working_tree(str(r))}
    assert shown_commit(prov, str(r)) == f"{a}-dirty"
    assert shown_commit({"commit": f"{a}-dirty"}, str(r)) == f"{a}-dirty"  # a result from before trees were recorded


def test_the_report_cites_a_dirty_run_whose_files_are_a_commit_by_that_commit():
    tree = git(ROOT, "rev-parse", "HEAD^{tree}")
    line = provenance_line([{"command": "python -m x", "commit": "0000000-dirty", "tree": tree, "device": "gpu", "where": "w"}])
    cited = line.split("commit ", 1)[1].split(",", 1)[0]
    assert cited != "0000000-dirty" and git(ROOT, "rev-parse", f"{cited}^{{tree}}") == tree
    stale = provenance_line([{"command": "python -m x", "commit": "0000000-dirty", "tree": "0" * 40, "device": "gpu", "where": "w"}])
    assert "commit 0000000-dirty, gpu" in stale


def test_report_rerun_plans_every_blocks_command_once_the_emulated_cluster_last_and_names_the_gpu_block():
    """report --rerun's plan on the project's docs, against the commands read off the docs' provenance
    lines directly: each once (the report's own aside), none of the GPU block's; the ablation's
    before the sweeps', those before the benchmarks', the emulated cluster's last; a node's torchrun
    line launched again through the emulated cluster of its nodes and ranks."""
    import re
    import sys

    from experiments.report.__main__ import BLOCK
    from experiments.report.rerun import EMULATE, plan, runnable

    docs = os.path.join(ROOT, "docs")
    named = set()
    for f in [*(os.path.join(docs, n) for n in os.listdir(docs) if n.endswith(".md")), os.path.join(ROOT, "README.md")]:
        for line in re.findall(r"^<sub>Rendered by .*</sub>$", open(f, encoding="utf-8").read(), re.M):
            named |= {c for c in re.findall(r"`([^`]+)`", line) if c.startswith(("python", "torchrun"))}
    named.discard("python -m experiments.report")
    todo, elsewhere = plan(docs, BLOCK)
    gpu = {c for c in named if "gpu_check" in c}
    assert len(todo) == len(set(todo)) and set(todo) == named - gpu and gpu
    assert len(elsewhere) == 1 and "kernel-bench" in elsewhere[0]
    modules = [runnable(c)[2] for c in todo]
    stage = [0 if m == "experiments.ablation" else 1 if m == "experiments.ablation.sweep" else 3 if m == EMULATE else 2 for m in modules]
    assert stage == sorted(stage) and stage[0] == 0 and stage[-1] == 3
    line = "torchrun --nnodes=4 --nproc-per-node=2 -m experiments.bench.groups --out results/emulated/groups-8"
    emulated = [sys.executable, "-m", EMULATE, "--nodes", "4", "--gpus-per-node", "2", "--"]
    assert runnable(line) == [*emulated, "-m", "experiments.bench.groups", "--out", "results/emulated/groups-8"]


def test_report_rerun_runs_each_command_where_results_lands_and_stops_at_the_first_that_fails(tmp_path):
    """report --rerun in a folder of docs whose blocks name three ablation runs, the second with a bad
    setting: the first writes its results under the results folder given, the second's failure
    stops the rerun naming it, the third never runs; started again at the commit the first's
    results cite, it resumes at the second (read run by run where a block's other runs are still
    to come), and at another commit it runs the first again.
    Refused before anything runs: a dirty checkout, a results folder by another name, a command
    for the emulated cluster with results outside the project (its nodes write under the
    project's), a torchrun line that names no nodes."""
    import io

    from experiments.common.errors import InputError
    from experiments.report.__main__ import BLOCK
    from experiments.report.rerun import rerun

    docs = tmp_path / "docs"
    docs.mkdir()
    blocks = []
    for name, extra in (("first", ""), ("bad", " --steps 0"), ("never", "")):
        cmd = f"python -m experiments.ablation --no-progress --no-whole-run --steps 30 --seeds 1{extra} --out results/{name}"
        prov = f"<sub>Rendered by `python -m experiments.report` from results/{name}: `{cmd}`.</sub>"
        blocks.append(f"<!-- report:ablation {name} -->\nold\n\n{prov}\n<!-- /report -->\n")
    (docs / "a.md").write_text("\n".join(blocks))
    results = tmp_path / "results"
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        failed = rerun(str(docs), str(results), BLOCK, out=out, commit="0899376")
    assert (results / "first" / "summary.json").exists()
    assert len(failed) == 1 and "--steps 0" in failed[0] and "1 command(s) after it not run" in failed[0]
    assert not (results / "bad").exists() and not (results / "never").exists()
    # started again at the commit its results cite, the rerun resumes: the first is named and kept
    summary = results / "first" / "summary.json"
    kept = json.loads(summary.read_text())
    kept["provenance"]["commit"] = "1234567"
    summary.write_text(json.dumps(kept))
    with open(log, "w") as out:
        failed = rerun(str(docs), str(results), BLOCK, out=out, commit="1234567")
    assert (
        "already cite commit 1234567" in log.read_text()
        and "[1/2] python -m experiments.ablation --no-progress --no-whole-run --steps 30 --seeds 1 --steps 0" in log.read_text()
    )
    assert json.loads(summary.read_text()) == kept and len(failed) == 1 and "--steps 0" in failed[0]
    # a block of several runs, one still to come, is read run by run: the first's results are cited
    from experiments.report.rerun import cited

    both = "`python -m experiments.ablation --no-progress --no-whole-run --steps 30 --seeds 1 --out results/{}`"
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "b.md").write_text(
        "<!-- report:ablation-variants first never -->\nold\n\n"
        f"<sub>Rendered by `python -m experiments.report` from {both.format('first')}; {both.format('never')}.</sub>\n<!-- /report -->\n"
    )
    assert cited(str(tmp_path / "two"), str(results), "1234567", BLOCK) == {both.format("first").strip("`")}
    assert cited(str(tmp_path / "two"), str(results), "0899376", BLOCK) == set()
    with open(log, "w") as out:  # at another commit it runs again
        rerun(str(docs), str(results), BLOCK, out=out, commit="0899376")
    assert json.loads(summary.read_text())["provenance"]["commit"] != "1234567"
    with pytest.raises(InputError, match="differ from its commit"):
        rerun(str(docs), str(results), BLOCK, out=io.StringIO(), commit="0899376-dirty")
    with pytest.raises(InputError, match="name it results"):
        rerun(str(docs), str(tmp_path / "elsewhere"), BLOCK, out=io.StringIO(), commit="0899376")
    first = "python -m experiments.ablation --no-progress --no-whole-run --steps 30 --seeds 1 --out results/first"
    node = "torchrun --nnodes=2 --nproc-per-node=2 -m experiments.bench.groups --out results/emulated/groups-4"
    (docs / "a.md").write_text(blocks[0].replace(first, node))
    with pytest.raises(InputError, match="rerun into .*results, not"):  # its nodes write under the project's results/
        rerun(str(docs), str(results), BLOCK, out=io.StringIO(), commit="0899376")
    (docs / "a.md").write_text(
        blocks[0].replace("python -m experiments.ablation", "torchrun --standalone --nproc-per-node 2 -m experiments.ablation")
    )
    with pytest.raises(InputError, match="cannot be rerun here"):
        rerun(str(docs), str(results), BLOCK, out=io.StringIO(), commit="0899376")
