import os
import sys

# Triton must see this before it is imported anywhere (kernels/_triton.py does the same).
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402
import torch  # noqa: E402

_empty = torch.empty


def _nan_empty(*args, **kwargs):
    t = _empty(*args, **kwargs)
    if t.is_floating_point():
        t.fill_(float("nan"))
    return t


@pytest.fixture
def poison_empty(monkeypatch):
    """Fresh buffers start as NaN, so an element a kernel forgets to write fails loudly."""
    monkeypatch.setattr(torch, "empty", _nan_empty)
