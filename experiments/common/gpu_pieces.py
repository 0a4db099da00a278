"""What has run on a GPU: the pieces a mode's step uses, each with what ran on a GPU and its
result, or None where it never has, and the GPU tests that check it (pytest -m gpu, run by
python3 -m experiments.gpu_check). The table is kept by hand beside the GPU checks: a run of
gpu_check on a new device is added here with its date and result (docs/benchmarks.md holds its
figures). experiments.advise prints each mode's pieces from it; tests/test_gpu_pieces.py holds
every named test to exist and carry the gpu marker.
"""

from __future__ import annotations

from dataclasses import dataclass

from solver.kinds import SparseKind
from solver.modes import Mode

# the one GPU run so far: one H200, torch 2.11 and Triton 3.6, the files of commit e73394d (docs/benchmarks.md)
H200_RUN = "one H200, 2026-12-04"


@dataclass(frozen=True)
class Piece:
    what: str  # the piece, in words
    ran: str | None  # what ran on a GPU and its result; None: it never has
    tests: tuple[str, ...] = ()  # the GPU tests that check it: file::function
    host: bool = False  # runs on the host CPU alone (no GPU involved)


PIECES: dict[str, Piece] = {
    "planner": Piece("the planner (every mode's plans, on the host)", None, host=True),
    "exchange kernels": Piece(
        "Triton pack/unpack of the Ulysses exchanges (and the layout change folded into them)",
        f"{H200_RUN}: bit-exact against the torch reference in every mode, dtype and head size; 0.90-0.96 of a device copy",
        (
            "tests/test_gpu.py::test_triton_pack_unpack_bit_exact_on_the_gpu",
            "tests/test_gpu.py::test_the_devices_registers_equal_the_machine_code_read_on_a_cpu",
        ),
    ),  # fmt: skip
    "all-to-alls across GPUs": Piece(
        "the Ulysses and the experts' all-to-alls between GPUs (NCCL)",
        None,  # one GPU has been lent so far: every exchange between ranks has run on gloo, on CPUs
    ),
    "neighbour sends across GPUs": Piece("the halo exchange's keys and values, or a linear layer's states, sent between GPUs", None),
    "redistribution across GPUs": Piece("the hidden states' own all-to-all at a full/sparse boundary, between GPUs", None),
    "full attention": Piece(
        "varlen full attention on CUDA (torch's kernel)",
        f"{H200_RUN}: within twice the torch path's bf16 error against fp64",
        ("tests/test_attention.py::test_cuda_backend_error_at_most_twice_torch_error",),
    ),
    "flash-attn": Piece(
        "flash-attn's varlen kernels (optional)",
        None,  # not installed on the GPU that ran: its tests skipped
        ("tests/test_attention.py::test_cuda_backend_error_at_most_twice_torch_error",),
    ),
    "sparse attention": Piece(
        "windowed and chunked attention on CUDA, with halo keys",
        f"{H200_RUN}: within twice the torch path's bf16 error against fp64",
        ("tests/test_attention.py::test_cuda_backend_with_halo_keys_error_at_most_twice_torch_error",),
    ),
    "gated delta rule": Piece(
        "fla's chunked gated delta rule (Gated DeltaNet layers)",
        f"{H200_RUN}: the forward equal to the CPU path in float64; fla refused the backward under Triton 3.6 on Hopper "
        f"(the layer then runs the project's blockwise form)",
        ("tests/test_gpu.py::test_the_gated_deltanet_layer_on_flas_kernel_matches_the_cpu_path",),
    ),  # fmt: skip
    "kimi delta attention": Piece("fla's chunked KDA rule (Kimi Delta Attention layers)", None),
    "experts": Piece(
        "the experts' grouped GEMM",
        f"{H200_RUN}: within twice the bf16 error of the loop over experts",
        ("tests/test_gpu.py::test_grouped_gemm_error_at_most_twice_the_expert_loops",),
    ),
    "training step": Piece(
        "a whole training step (the tiny model, repack+solver, one GPU)",
        f"{H200_RUN}: bf16 losses within 0.5% of fp32's over three steps",
        ("tests/test_gpu.py::test_bf16_training_on_one_gpu_matches_fp32",),
    ),
}

# the sparse layers' GPU piece of each registered kind (a kind not listed has no GPU record)
KIND_PIECES = {
    "sliding_window": "sparse attention",
    "chunked": "sparse attention",
    "gated_delta": "gated delta rule",
    "kda": "kimi delta attention",
}
EVERY_MODE = ("planner", "exchange kernels", "all-to-alls across GPUs", "full attention", "experts", "training step")


def pieces_of(mode: Mode, kind: SparseKind) -> list[str]:
    """The pieces a step of `mode` uses with the sparse kind `kind` (names of PIECES; a kind
    without a GPU record is named as itself, and has never run on one)."""
    names = [*EVERY_MODE, KIND_PIECES.get(kind.name, kind.name)]
    if mode.needs_reach or (mode.cheapest and kind.first_key is not None):  # halo children: keys or states from neighbours
        names.append("neighbour sends across GPUs")
    if not mode.folded:
        names.append("redistribution across GPUs")
    return names


def gpu_status(names: list[str]) -> tuple[list[str], list[str]]:
    """(the pieces that have run on a GPU, those that never have), the host's left out."""
    ran, never = [], []
    for n in names:
        piece = PIECES.get(n)
        if piece is not None and piece.host:
            continue
        (ran if piece is not None and piece.ran else never).append(n)
    return ran, never
