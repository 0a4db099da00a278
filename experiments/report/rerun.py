"""python -m experiments.report --rerun: every block's figures from one clean commit, in one command.

The docs' blocks cite the commands that wrote their results (each provenance line). After a change
that moves figures, every block is rerun at one commit so that the docs cite one: this runs every
command the provenance lines name, once each, from the folder that holds --results (so each
command's `--out results/...` lands there), then the report renders. The commands run in the
order of their cost: the ablation and its variants, the sweeps, the benchmarks, then the emulated
cluster (each `torchrun --nnodes=N --nproc-per-node=G -m ...` line, as the emulated nodes ran it,
is launched again through `python -m experiments.calibrate.emulate --nodes N --gpus-per-node G`);
about three hours on the development machine, which must be otherwise idle (the benchmarks and
the emulated cluster time what they run). A block rendered from a CUDA machine's run (GPU_BLOCKS:
`python3 -m experiments.gpu_check` on a lent GPU) cannot be rerun here and is named. It refuses
to start from a checkout whose files differ from its commit: their results would cite a dirty
tree, not the commit. A command that fails stops the rerun, naming it; what ran before it stays,
and a rerun started again at the same commit resumes: a command whose results under --results
already cite this commit (read as the report reads them) is named and not run again (delete its
results to rerun it).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

from experiments.common.errors import USER_ERRORS, InputError
from experiments.common.provenance import git_commit, shown_commit
from experiments.report.check import ROOT, _blocks, _commands, command_env, doc_paths
from experiments.report.tables import NAMED, RENDERERS

GPU_BLOCKS = ("kernel-bench",)  # blocks rendered from a run on a CUDA machine
EMULATE = "experiments.calibrate.emulate"
# the order commands run in, by their module: the quick ones first, the emulated cluster last
ORDER = ("experiments.ablation", "experiments.ablation.sweep", "experiments.bench", EMULATE)


def _module(argv: list[str]) -> str:
    return argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""


def runnable(cmd: str) -> list[str]:
    """The argv that reruns a provenance line's command here: `python -m ...` with this Python;
    a node's `torchrun --nnodes=N --nproc-per-node=G -m MODULE ARGS` through the emulated cluster
    of N nodes of G ranks. InputError for any other launcher."""
    parts = shlex.split(cmd)
    if parts[:2] == ["python", "-m"] or parts[:2] == ["python3", "-m"]:
        return [sys.executable, *parts[1:]]
    if parts[:1] == ["torchrun"]:
        opts = dict(p.removeprefix("--").split("=", 1) for p in parts[1:] if p.startswith("--") and "=" in p)
        if "-m" not in parts or not {"nnodes", "nproc-per-node"} <= set(opts):
            raise InputError(f"{cmd!r}: a torchrun line without --nnodes=N, --nproc-per-node=G and -m MODULE cannot be rerun here")
        rest = parts[parts.index("-m") :]
        return [sys.executable, "-m", EMULATE, "--nodes", opts["nnodes"], "--gpus-per-node", opts["nproc-per-node"], "--", *rest]
    raise InputError(f"{cmd!r}: neither `python -m ...` nor `torchrun ... -m ...`: no way to rerun it here")


def plan(docs: str, block) -> tuple[list[str], list[str]]:
    """(every command the docs' blocks name, once each, in ORDER; what cannot run here: the GPU
    blocks' commands, each with its block). `block`: the report's marker grammar."""
    todo: list[str] = []
    elsewhere: list[str] = []
    for p in doc_paths(docs):
        for name, args, _, prov in _blocks(open(p, encoding="utf-8").read(), block):
            for cmd in _commands(prov):
                if name in GPU_BLOCKS:
                    elsewhere.append(f"{os.path.basename(p)}: {name} {' '.join(args)} (`{cmd}`, on a CUDA machine)")
                elif cmd not in todo:
                    todo.append(cmd)

    def rank(cmd: str) -> int:
        module = _module(runnable(cmd))
        # another module runs with the benchmarks, before the emulated cluster
        return max((i for i, m in enumerate(ORDER) if module == m or module.startswith(m + ".")), default=ORDER.index("experiments.bench"))

    return sorted(todo, key=rank), elsewhere  # stable: the docs' order within a rank


def cited(docs: str, results: str, commit: str, block) -> set[str]:
    """The commands whose results under `results` already cite `commit`: each table block of the
    docs read as the report reads it (the figures' blocks and those drawn from code aside), and a
    source's command kept where its commit, as the report shows it, is `commit`. A block of several
    runs whose whole cannot be read yet (one run still to come) is read run by run. Results that
    are missing or cannot be read cite nothing."""

    def sources(name: str, args: list[str]) -> list[dict]:
        try:
            return RENDERERS[name](*(os.path.join(results, a) for a in args))[1]
        except (*USER_ERRORS, OSError, ValueError, KeyError, TypeError):
            return []

    done: set[str] = set()
    for p in doc_paths(docs):
        for name, args, _, _ in _blocks(open(p, encoding="utf-8").read(), block):
            if name not in RENDERERS or name in NAMED or name in GPU_BLOCKS or not args:
                continue
            prov = sources(name, args) or [s for a in args if len(args) > 1 for s in sources(name, [a])]
            done |= {s["command"] for s in prov if s.get("command") and shown_commit(s) == commit}
    return done


def rerun(docs: str, results: str, block, out=sys.stdout, commit: str | None = None) -> list[str]:
    """Run plan(docs)'s commands from the folder holding `results`; the failures (empty: all ran).
    InputError before anything runs: a results folder not named `results` (the project's own
    where a command runs on the emulated cluster), a dirty checkout (its `commit`: this
    checkout's by default), a command that cannot be rerun here."""
    results = os.path.abspath(results)
    if os.path.basename(results) != "results":
        raise InputError(f"--results {results!r}: the commands write under results/ of the folder they run in; name it results")
    commit = commit or git_commit()
    if commit.endswith("-dirty"):
        raise InputError(f"the checkout's files differ from its commit ({commit}): commit them first, or the results cite a dirty tree")
    planned, elsewhere = plan(docs, block)
    argvs = {c: runnable(c) for c in planned}  # every command checked before the first runs
    at_commit = cited(docs, results, commit, block)  # a rerun started again resumes
    todo = [c for c in planned if c not in at_commit]
    kept = [c for c in planned if c in at_commit]
    nodes = [c for c in todo if c.startswith("torchrun")]
    if nodes and os.path.dirname(results) != ROOT:
        raise InputError(
            f"`{nodes[0]}` runs on the emulated cluster, whose nodes run in the project's folder and write under its results/: "
            f"rerun into {os.path.join(ROOT, 'results')}, not {results}"
        )
    print(f"rerunning {len(todo)} command(s) at commit {commit}, from {os.path.dirname(results)}:", file=out)
    for i, cmd in enumerate(todo, 1):
        print(f"  {i}. {cmd}", file=out)
    for e in elsewhere:
        print(f"  not rerun here: {e}", file=out)
    for c in kept:
        print(f"  not rerun, its results already cite commit {commit} (delete them to rerun it): {c}", file=out)
    env = command_env()
    for i, cmd in enumerate(todo, 1):
        start = time.monotonic()
        print(f"[{i}/{len(todo)}] {cmd}", file=out, flush=True)
        done = subprocess.run(argvs[cmd], cwd=os.path.dirname(results), env=env)
        print(f"[{i}/{len(todo)}] exit {done.returncode} after {time.monotonic() - start:.0f} s", file=out, flush=True)
        if done.returncode != 0:
            return [f"`{cmd}` failed (exit {done.returncode}); {len(todo) - i} command(s) after it not run"]
    return []
