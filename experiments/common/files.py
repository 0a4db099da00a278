"""Files and folders of a run: the output folder checked before any work, and a data file's identity."""

from __future__ import annotations

import hashlib
import os
import tempfile

from .errors import InputError


def check_output_dir(path: str, flag: str = "--out") -> None:
    """The folder results go to can be written: it is a folder (or can be made one) and a file
    can be created in it. Checked first, so a run never ends by losing its results."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise InputError(f"{flag} {path!r} is a file, not a folder: name a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise InputError(f"{flag} {path!r} cannot be written: {e.strerror or e}") from None


def file_identity(path: str | None) -> dict | None:
    """A data file's identity: its size and the sha256 of all of it, read in 1 MiB blocks (the same
    file copied to every node gives the same identity; a change anywhere in it, a different one)."""
    if not path:
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"name": os.path.basename(path), "bytes": os.path.getsize(path), "sha256": h.hexdigest()[:16]}
