import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402


def pytest_configure(config):
    """Triton's interpreter runs every kernel test on CPU tensors; it must be chosen before Triton
    is first imported (collection imports it). `pytest -m gpu` on a CUDA machine compiles the
    kernels instead: those tests run on the GPU (tests/test_gpu.py)."""
    import torch  # noqa: PLC0415

    if not (config.getoption("markexpr") == "gpu" and torch.cuda.is_available()):
        os.environ.setdefault("TRITON_INTERPRET", "1")


# CI is deterministic: the same examples every run (a green run stays green). Locally the
# default profile explores with fresh random examples each run; pick one with HYPOTHESIS_PROFILE.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "explore"))


@pytest.fixture
def poison_empty():
    """Fresh buffers start as NaN, so an element a kernel forgets to write fails loudly."""
    from kernels.reference import nan_poisoned_empty  # noqa: PLC0415  (after pytest_configure chose the interpreter)

    with nan_poisoned_empty():
        yield


@pytest.fixture
def small_disk(tmp_path):
    """A folder on a 256 KiB tmpfs of its own: a disk that fills (root only; skipped where mounting is
    not allowed). Unmounted afterwards."""
    import subprocess  # noqa: PLC0415

    path = tmp_path / "disk"
    path.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"a tmpfs cannot be mounted here ({p.stderr.strip() or p.returncode}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
