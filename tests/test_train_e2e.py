"""The training driver end to end under torchrun: 8 gloo ranks, emulated nodes of 2, tiny model."""

import os
import subprocess
import sys

import numpy as np
import pytest

from experiments.data import TokenFileSource, load_offsets
from experiments.results import read_run
from solver import PlanError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(nproc: int, *args, timeout=240):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "experiments.train",
        "--model",
        "tiny",
        "--gpus-per-node",
        "2",
        "--timeout",
        "60",
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def losses(folder):
    rows, _ = read_run(folder)
    return {r["step"]: r["loss"] for r in rows}


def test_three_modes_same_losses_results_parse_and_resume_matches(tmp_path):
    runs = {}
    for mode in ("baseline", "repack", "repack+solver"):
        extra = ["--save-every", "2", "--ckpt-dir", str(tmp_path / "ck_full")] if mode == "repack+solver" else []
        p = torchrun(8, "--mode", mode, "--steps", "4", "--out", str(tmp_path / mode), *extra)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "loss" in p.stdout and "MFU" in p.stdout
        runs[mode] = losses(tmp_path / mode)
        rows, summary = read_run(str(tmp_path / mode))
        assert summary["engine"] == "torch" and summary["context"]["commit"]
        assert all(r["engine"] == "torch" and r["mode"] == mode for r in rows)
    base = runs["baseline"]
    assert len(base) == 4
    for mode in ("repack", "repack+solver"):
        np.testing.assert_allclose([runs[mode][s] for s in sorted(base)], [base[s] for s in sorted(base)], rtol=1e-5)
    # interrupted after 2 steps, then resumed: exactly the uninterrupted losses on CPU
    ck = tmp_path / "ck_resume"
    p = torchrun(
        8,
        "--mode",
        "repack+solver",
        "--steps",
        "4",
        "--save-every",
        "2",
        "--ckpt-dir",
        str(ck),
        "--stop-after",
        "2",
        "--out",
        str(tmp_path / "part"),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    p = torchrun(8, "--mode", "repack+solver", "--steps", "4", "--ckpt-dir", str(ck), "--resume", "--out", str(tmp_path / "resumed"))
    assert p.returncode == 0, p.stderr[-3000:]
    resumed = losses(tmp_path / "resumed")
    assert resumed == runs["repack+solver"]
    assert not any(f.endswith(".tmp") for f in os.listdir(ck))


def test_a_sample_too_long_for_the_cluster_fails_fast_with_its_reason(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("step,length\n0,10\n0,100000\n")
    p = torchrun(2, "--trace", str(trace), "--steps", "1", "--out", str(tmp_path / "o"), timeout=120)
    assert p.returncode != 0
    assert "failed: PlanError: step 0: sample id=1 of length=100000 cannot be placed" in p.stderr


def test_corrupt_token_files_are_clear_errors(tmp_path):
    toks = tmp_path / "tok.npy"
    np.save(toks, np.arange(20, dtype=np.uint16))
    offs = tmp_path / "off.npy"
    np.save(offs, np.array([0, 8, 5, 20]))
    with pytest.raises(PlanError, match="decrease at index 1"):
        load_offsets(str(offs), 20)
    np.save(offs, np.array([0, 8, 19]))
    with pytest.raises(PlanError, match="must start at 0 and end at the token count 20"):
        load_offsets(str(offs), 20)
    np.save(toks, np.arange(20, dtype=np.float32))
    np.save(offs, np.array([0, 8, 20]))
    with pytest.raises(PlanError, match="expected a 1-D uint16 or uint32 array"):
        TokenFileSource(str(toks), str(offs), 100, 97)
    np.save(toks, np.arange(120, 140, dtype=np.uint32))
    with pytest.raises(PlanError, match="token id 139 >= the model's vocab 97"):
        TokenFileSource(str(toks), str(offs), 100, 97)
    (tmp_path / "junk.npy").write_bytes(b"not an array")
    with pytest.raises(PlanError, match="not a readable .npy array"):
        TokenFileSource(str(tmp_path / "junk.npy"), str(offs), 100, 97)
    p = torchrun(2, "--tokens", str(tmp_path / "junk.npy"), "--doc-offsets", str(offs), "--out", str(tmp_path / "o"), timeout=120)
    assert p.returncode != 0 and "not a readable .npy array" in p.stderr


def test_token_file_steps_hold_whole_documents(tmp_path):
    toks = tmp_path / "tok.npy"
    np.save(toks, np.arange(50, dtype=np.uint16))
    offs = tmp_path / "off.npy"
    np.save(offs, np.array([0, 10, 25, 26, 50]))
    src = TokenFileSource(str(toks), str(offs), 30, 97)
    assert [src.get(i).lengths for i in range(len(src))] == [[10, 15, 1], [24]]
    assert src.get(1).tokens[0].tolist() == list(range(26, 50))
