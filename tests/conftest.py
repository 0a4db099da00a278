import os
import sys

# Triton must see this before it is imported anywhere (kernels/_triton.py does the same).
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

from kernels.reference import nan_poisoned_empty  # noqa: E402


@pytest.fixture
def poison_empty():
    """Fresh buffers start as NaN, so an element a kernel forgets to write fails loudly."""
    with nan_poisoned_empty():
        yield
