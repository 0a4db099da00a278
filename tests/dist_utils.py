"""Spawn a gloo process group on CPU and run a test body on every rank; run the driver's ranks
under torchrun, or forked from the test's process (the same ranks without a launcher)."""

import datetime
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args):
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)  # several ranks share few cores: one thread each, as torchrun sets
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
    )
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _preload() -> None:
    """What a rank would import on its own, imported once here before the ranks fork (see run_distributed)."""
    import torch._dynamo  # noqa: F401, PLC0415
    import torch.distributed.checkpoint  # noqa: F401, PLC0415
    import torch.distributed.fsdp  # noqa: F401, PLC0415


def run_distributed(fn, world_size: int, *args):
    """Run fn(rank, world_size, *args) on `world_size` forked ranks; re-raises a rank's failure.
    Forked, not spawned: a rank starts with this process's imports (torch, the project) instead of
    importing them again, seconds per rank on a small machine; nothing here has touched a GPU.
    FSDP2, the dynamo modules its first fully_shard imports, and DCP are imported here first for
    the same reason: a rank that shards its model or writes a checkpoint would otherwise import
    them itself (DTensor, dynamo and sympy: about two seconds a rank)."""
    _preload()
    mp.start_processes(_worker, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True, start_method="fork")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun_cmd(nproc: int, *args, launcher: tuple[str, ...] = ()) -> list[str]:
    """The driver with the tiny model on `nproc` CPU ranks in emulated nodes of 2, collectives
    bounded by 60 s (args override); `launcher`: more of torchrun's own flags."""
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *launcher]
    return [*head, "-m", "experiments.train", "--model", "tiny", "--gpus-per-node", "2", "--timeout", "60", *args]


def torchrun(nproc: int, *args, timeout=240):
    return subprocess.run(torchrun_cmd(nproc, *args), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def single_rank_cmd(*args) -> list[str]:
    """The driver as one process (no launcher: world 1), the tiny model, collectives bounded by 60 s."""
    return [sys.executable, "-m", "experiments.train", "--model", "tiny", "--timeout", "60", *args]


def forked_driver(nproc: int, *args, timeout=240) -> subprocess.CompletedProcess:
    """The driver's `nproc` ranks (torchrun_cmd's settings, or single_rank_cmd's for one rank;
    `args` after them) forked from this process, as torchrun would start them but without its
    launcher: each rank is a child that joins the job at the env:// rendezvous torchrun's variables
    describe (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT; nproc == 1: none, a
    plain run), runs the driver's main in the project's root and ends as it ends (os._exit). A fork
    starts with this process's imports, where a launched rank imports torch, FSDP and the project
    again (3 s a rank here, 8 ranks on 2 cores: 24 s against 6 s forked): for tests of what the
    driver does, not of the launcher (torchrun's start, its ending of a job a rank left, a plain
    run's port: tests that launch it). Returns what subprocess.run would: the exit status (the first
    rank to fail's, else 0: as under torchrun, the others are then ended) and every rank's standard
    output and error, rank by rank; ranks still running after `timeout` seconds are killed and
    raise subprocess.TimeoutExpired."""
    from experiments.train.__main__ import main  # noqa: PLC0415 - imported once here, not in every rank

    _preload()
    cmd = torchrun_cmd(nproc, *args) if nproc > 1 else single_rank_cmd(*args)
    argv = cmd[cmd.index("experiments.train") + 1 :]
    env = {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    if nproc > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
        env.update(GROUP_RANK="0", ROLE_RANK="0", ROLE_WORLD_SIZE=str(nproc))
    with tempfile.TemporaryDirectory() as logs:
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:  # the rank: its output to its own files, the launcher's variables, the driver
                code = 1
                try:
                    for fd, name in ((1, "out"), (2, "err")):
                        f = os.open(os.path.join(logs, f"{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                        os.dup2(f, fd)
                        os.close(f)
                    # Python's streams onto those files (under pytest they are its capture's, not fds 1 and 2)
                    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the rank's until os._exit
                    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
                    os.chdir(ROOT)
                    os.environ.update(env)
                    if nproc > 1:
                        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
                    torch.set_num_threads(1)  # one thread a rank, as torchrun sets
                    main(argv)
                    code = 0
                except SystemExit as e:  # a user's error: the entry point's exit code
                    code = e.code if isinstance(e.code, int) else 1
                except BaseException:  # noqa: BLE001 - the rank's failure, printed as an uncaught one would be
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            pids.append(pid)
        codes = {}  # pid: exit status, in the order the ranks ended
        deadline = time.monotonic() + timeout
        while len(codes) < nproc:
            for pid in pids:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            failed = any(c != 0 for c in codes.values())  # as torchrun ends a job one of its ranks failed
            if len(codes) < nproc and (failed or time.monotonic() > deadline):
                for pid in pids:
                    if pid not in codes:
                        os.kill(pid, signal.SIGKILL)
                        codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                if not failed:
                    raise subprocess.TimeoutExpired(["forked_driver", str(nproc), *argv], timeout)
            time.sleep(0.05)

        def read(name):
            out = []
            for r in range(nproc):
                with open(os.path.join(logs, f"{r}.{name}"), errors="replace") as f:
                    out.append(f.read())
            return "".join(out)

        first = next((c for c in codes.values() if c != 0), 0)
        return subprocess.CompletedProcess(["forked_driver", str(nproc), *argv], first, read("out"), read("err"))


class ShardCollectives:
    """Counts the collectives FSDP2 issues (its parameter gathers and gradient reductions: the
    torch.distributed calls its default communication uses) while entered: for each, the ranks of
    its group and the bytes this rank sends in a ring collective (a gather's input, its shard, to
    each of the other ranks; a reduction's input, the whole gradient, less the share it keeps)."""

    CALLS = ("all_gather_single", "reduce_scatter_single")

    def __init__(self):
        self.sent = {name: 0.0 for name in self.CALLS}
        self.calls = {name: 0 for name in self.CALLS}

    def __enter__(self):
        self._orig = {name: getattr(dist, name) for name in self.CALLS}
        for name, f in self._orig.items():
            setattr(dist, name, self._counting(name, f))
        return self

    def __exit__(self, *exc):
        for name, f in self._orig.items():
            setattr(dist, name, f)

    def _counting(self, name, f):
        key = "input_tensor" if name == "all_gather_single" else "input"  # each call's name for it

        def call(*args, **kwargs):
            assert "group" in kwargs, f"{name} called without a group keyword: count it by its group"
            tensor = kwargs[key] if key in kwargs else args[1]
            n = dist.get_world_size(kwargs.get("group"))
            if n > 1:
                bytes_in = tensor.numel() * tensor.element_size()
                self.sent[name] += bytes_in * (n - 1) if name == "all_gather_single" else bytes_in * (n - 1) / n
                self.calls[name] += 1
            return f(*args, **kwargs)

        return call
