"""The provenance every result carries: git commit, device, time, host, Python, and the command
that produced it (so experiments.report can say how to rerun it)."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys


def git_commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True, timeout=5
        )
        if sha.returncode != 0:
            return "unknown"
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


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
    return {
        "command": command_line(),
        "commit": git_commit(),
        "device": device_name(),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
    }
