"""Files and folders of a run: the output folder checked before any work, and a data file's identity."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile

from .errors import InputError


def check_output_dir(path: str, flag: str = "--out", need: int = 0) -> None:
    """The folder results go to can be written: it is a folder (or can be made one), a file can be
    created in it, and its disk has `need` bytes free (what the run will write there, estimated).
    Checked first, so a run never ends by losing its results."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise InputError(f"{flag} {path!r} is a file, not a folder: name a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
        free = shutil.disk_usage(path).free
    except OSError as e:
        raise InputError(f"{flag} {path!r} cannot be written: {e.strerror or e}") from None
    if free < need:
        raise InputError(
            f"{flag} {path!r} has {free / 2**20:.1f} MiB free on its disk, and the run writes about {need / 2**20:.1f} MiB there: "
            f"free space, or give another {flag}"
        )


def sha256_of(path: str) -> str:
    """The sha256 of all of a file, read in 1 MiB blocks: checkpoints, results pairs, data files."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_identity(path: str | None) -> dict | None:
    """A data file's identity: its size and the sha256 of all of it (the same file copied to every
    node gives the same identity; a change anywhere in it, a different one)."""
    if not path:
        return None
    return {"name": os.path.basename(path), "bytes": os.path.getsize(path), "sha256": sha256_of(path)[:16]}


_LOCKS: dict[str, int] = {}  # folder -> its open descriptor, held (and so locked) until the process ends


def lock_folder(path: str, flag: str = "--out") -> None:
    """Take this process's exclusive lock on the folder a run writes into (an flock on the folder
    itself: no file is added to it; the kernel releases it when the process ends, however it
    ends): a second run started on the same folder is refused in one line, instead of both running
    and one replacing the other's results or checkpoints. Taking a lock this process holds is a
    no-op."""
    key = os.path.realpath(path)
    if key in _LOCKS:
        return
    try:
        os.makedirs(path, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise InputError(f"{flag} {path!r} cannot be opened to lock it ({e.strerror or e})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = lock_holder(fd)
        os.close(fd)
        raise InputError(
            f"{flag} {path!r} is in use by another run ({holder}): two runs writing into one folder would replace each other's "
            f"files; wait for it to end, or give another {flag}"
        ) from None
    _LOCKS[key] = fd


def lock_holder(fd: int) -> str:
    """Who holds the flock on the open folder `fd`: "process PID: COMMAND", read from the kernel's
    table of locks (/proc/locks: each lock's holder and its file's device and inode) and the
    holder's /proc/PID/cmdline; where those cannot be read (not Linux, another PID namespace),
    says so rather than guess."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            pids = [line.split()[4] for line in f if line.split()[1:2] == ["FLOCK"] and inode in line.split()[5:6]]
    except (OSError, IndexError):
        pids = []
    if not pids:
        return "a live process holds its lock; its holder could not be read from /proc/locks"
    pid = pids[0]
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = " ".join(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
    except OSError:
        command = "its command could not be read"
    return f"process {pid} holds its lock: {command}"
