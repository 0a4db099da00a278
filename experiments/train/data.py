"""Training data for the driver: per-step documents (lengths and token ids), resumable.

Sources: the synthetic workload generator (lengths) with seeded random tokens; a length trace
with seeded random tokens; or a token file: a numpy array of uint16/uint32 token ids (loaded
memory-mapped) with a companion array of document offsets [n_docs + 1] (int64, starting at 0,
non-decreasing, ending at the token count). Documents are streamed whole into steps of about
`tokens_per_step` tokens; nothing is cut, padded or dropped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from experiments.common.errors import InputError
from experiments.common.workload import iter_steps, random_tokens


@dataclass
class StepBatch:
    step: int
    tokens: dict[int, np.ndarray]  # sample id -> token ids

    @property
    def lengths(self) -> list[int]:
        return [len(self.tokens[i]) for i in sorted(self.tokens)]


class LengthSource:
    """Steps from precomputed per-step lengths (generator or trace) with random tokens."""

    def __init__(self, steps: list[list[int]], vocab: int, seed: int, numbers: list[int] | None = None):
        self.steps, self.vocab, self.seed = steps, vocab, seed
        self.numbers = list(range(len(steps))) if numbers is None else list(numbers)  # a trace's own step numbers

    def __len__(self):
        return len(self.steps)

    def lengths(self, step: int) -> tuple[int, list[int]]:
        """(number, sample lengths) of the step at position `step`, without making its tokens."""
        return self.numbers[step], list(self.steps[step])

    def get(self, step: int) -> StepBatch:
        """The step at position `step`, named by its number (a trace's, or the position)."""
        if step >= len(self.steps):
            raise InputError(f"step {step} is past the data ({len(self.steps)} steps)")
        number = self.numbers[step]
        return StepBatch(number, random_tokens(self.steps[step], self.vocab, self.seed, number))


class GeneratedSource:
    """Steps of the synthetic workload, generated as the run reaches them (the generator is
    sequential: a step is made once every step before it is): a run of many steps holds a few at
    a time, and starts at once. Tokens are random, a pure function of (seed, step)."""

    KEEP = 4  # steps kept behind the furthest one made: the run plans one step ahead

    def __init__(self, workload, vocab: int):
        self.workload, self.vocab, self.seed = workload, vocab, workload.seed
        self._steps = iter_steps(workload)
        self._made: dict[int, list[int]] = {}
        self._next = 0

    def __len__(self):
        return self.workload.steps

    def _lengths(self, step: int) -> list[int]:
        if step >= len(self):
            raise InputError(f"step {step} is past the data ({len(self)} steps)")
        if step < self._next - self.KEEP:
            raise ValueError(f"step {step} was made and dropped: the run reads its steps in order")
        while self._next <= step:
            self._made[self._next] = next(self._steps)
            self._made.pop(self._next - self.KEEP - 1, None)
            self._next += 1
        return self._made[step]

    def lengths(self, step: int) -> tuple[int, list[int]]:
        return step, list(self._lengths(step))

    def get(self, step: int) -> StepBatch:
        return StepBatch(step, random_tokens(self._lengths(step), self.vocab, self.seed, step))


class TokenFileSource:
    """Steps of whole documents from a token file; step i is a pure function of the file and i."""

    def __init__(self, tokens_path: str, offsets_path: str, tokens_per_step: int, vocab: int):
        self.tokens = load_token_file(tokens_path, vocab)
        self.offsets = load_offsets(offsets_path, len(self.tokens))
        lengths = np.diff(self.offsets)
        if (lengths == 0).any():
            bad = int(np.nonzero(lengths == 0)[0][0])
            raise InputError(f"document {bad} of {offsets_path!r} is empty; documents need at least one token")
        # steps as ranges of documents, streamed whole
        self.bounds = [0]
        total = 0
        for d, n in enumerate(lengths):
            if total and total + n > tokens_per_step:
                self.bounds.append(d)
                total = 0
            total += int(n)
        self.bounds.append(len(lengths))

    def __len__(self):
        return len(self.bounds) - 1

    def lengths(self, step: int) -> tuple[int, list[int]]:
        """(number, document lengths) of step `step`, without reading its tokens."""
        a, b = self.bounds[step], self.bounds[step + 1]
        return step, np.diff(self.offsets[a : b + 1]).tolist()

    def get(self, step: int) -> StepBatch:
        if step >= len(self):
            raise InputError(f"step {step} is past the token file ({len(self)} steps)")
        a, b = self.bounds[step], self.bounds[step + 1]
        return StepBatch(
            step, {i: np.asarray(self.tokens[self.offsets[d] : self.offsets[d + 1]], dtype=np.int64) for i, d in enumerate(range(a, b))}
        )


def load_token_file(path: str, vocab: int) -> np.ndarray:
    if not os.path.exists(path):
        raise InputError(f"token file {path!r} does not exist")
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise InputError(f"token file {path!r} is not a readable .npy array ({e})") from None
    if arr.dtype not in (np.uint16, np.uint32) or arr.ndim != 1:
        raise InputError(f"token file {path!r} holds {arr.dtype} of shape {arr.shape}; expected a 1-D uint16 or uint32 array")
    if len(arr) and int(arr.max()) >= vocab:
        raise InputError(f"token file {path!r} has token id {int(arr.max())} >= the model's vocab {vocab}")
    return arr


def load_offsets(path: str, n_tokens: int) -> np.ndarray:
    if not os.path.exists(path):
        raise InputError(f"document offsets file {path!r} does not exist")
    try:
        off = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise InputError(f"document offsets {path!r} is not a readable .npy array ({e})") from None
    if off.ndim != 1 or len(off) < 2 or not np.issubdtype(off.dtype, np.integer):
        raise InputError(f"document offsets {path!r}: expected a 1-D integer array [n_docs + 1], got {off.dtype} {off.shape}")
    if off[0] != 0 or off[-1] != n_tokens:
        raise InputError(
            f"document offsets {path!r} must start at 0 and end at the token count {n_tokens}; "
            f"they run from {int(off[0])} to {int(off[-1])}"
        )
    if (np.diff(off) < 0).any():
        bad = int(np.nonzero(np.diff(off) < 0)[0][0])
        raise InputError(f"document offsets {path!r} decrease at index {bad} ({int(off[bad])} -> {int(off[bad + 1])})")
    return off.astype(np.int64)
