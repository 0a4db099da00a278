"""The provenance every result carries: git commit and the tree of the files it ran, device, time,
host, Python, and the command that produced it (so experiments.report can say how to rerun it)."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def _git(args: list[str], cwd: str, env: dict | None = None) -> str | None:
    """git's output, stripped, or None where git is missing, fails or is not a repository here."""
    try:
        p = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def git_commit(root: str = HERE) -> str:
    """HEAD's short hash, with -dirty where a tracked file differs from it; unknown outside git."""
    sha = _git(["rev-parse", "--short", "HEAD"], root)
    if sha is None:
        return "unknown"
    dirty = _git(["status", "--porcelain", "--untracked-files=no"], root)
    return sha + ("-dirty" if dirty else "")


def working_tree(root: str = HERE, clean: bool | None = None) -> str:
    """The git tree hash of the files this run reads: HEAD's tree where no tracked file differs from
    HEAD; else the tree git would commit from every file here it does not ignore (written through a
    temporary index, so neither the index nor HEAD moves). A copy of the repository whose git folder
    is older than its files (a device machine's) names in a dirty commit the commit its git knew; its
    tree is the commit whose files it ran, which the report finds (commit_of_tree). Empty outside git.
    `clean`: whether git_commit found no tracked file differing from HEAD, where the caller knows."""
    if clean is None:
        clean = _git(["status", "--porcelain", "--untracked-files=no"], root) == ""
    if clean:
        return _git(["rev-parse", "HEAD^{tree}"], root) or ""
    top = _git(["rev-parse", "--show-toplevel"], root)
    if top is None:
        return ""
    with tempfile.TemporaryDirectory(prefix="provenance-") as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": os.path.join(tmp, "index")}
        if _git(["add", "--all", "."], top, env) is None:
            return ""
        return _git(["write-tree"], top, env) or ""


def commit_of_tree(tree: str, root: str = HERE) -> str | None:
    """The newest commit (short hash) of this repository whose files are exactly `tree`, or None."""
    if not tree:
        return None
    log = _git(["log", "--all", "--format=%h %T"], root) or ""
    return next((c for c, t in (line.split() for line in log.splitlines()) if t == tree), None)


def shown_commit(prov: dict, root: str = HERE) -> str:
    """The commit a result is cited by: its own where clean; a dirty one's, where its files are a
    commit's (commit_of_tree); else as it was recorded, -dirty and all."""
    commit = prov.get("commit") or ""
    if commit.endswith("-dirty"):
        return commit_of_tree(prov.get("tree", ""), root) or commit
    return commit


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def command_line() -> str:
    """The command this process was started with, as a user would type it: python -m module args,
    or under a launcher torchrun with its node and rank counts."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if "-m" not in argv:
        return shlex.join(argv)
    module_and_args = argv[argv.index("-m") :]
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if local and world:
        head = ["torchrun", f"--nnodes={int(world) // int(local)}", f"--nproc-per-node={local}"]
    else:
        head = ["python"]
    return shlex.join(head + module_and_args)


def provenance() -> dict:
    commit = git_commit()
    return {
        "command": command_line(),
        "commit": commit,
        "tree": working_tree(clean=commit != "unknown" and not commit.endswith("-dirty")),
        "device": device_name(),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
    }
