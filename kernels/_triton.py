"""The one place that imports Triton.

Without CUDA, Triton kernels run through Triton's interpreter, which must be switched on before
`triton` is first imported: importing Triton through this module guarantees that. Set
TRITON_INTERPRET yourself to override (0 to force compilation, 1 to force the interpreter).
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

__all__ = ["triton", "tl", "INTERPRETED"]
