import os
import sys

# Triton must see this before it is imported anywhere (kernels/_triton.py does the same).
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from kernels.reference import nan_poisoned_empty  # noqa: E402

# CI is deterministic: the same examples every run (a green run stays green). Locally the
# default profile explores with fresh random examples each run; pick one with HYPOTHESIS_PROFILE.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "explore"))


@pytest.fixture
def poison_empty():
    """Fresh buffers start as NaN, so an element a kernel forgets to write fails loudly."""
    with nan_poisoned_empty():
        yield
