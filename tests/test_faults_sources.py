"""Every data-source flag an entry point takes, given alone and in every pair: each combination is
either refused in one line or reads every flag it was given. The yardstick of "read" is what the
run consumes, not what it records: the steps (and, for the driver, the tokens) it would run. A flag
is read when changing its value alone changes them; a flag recorded in summary.json and ignored
would leave them as they were (tests/test_faults_silent.py has the cases that once did)."""

import itertools

import numpy as np
import pytest

import experiments.ablation.__main__ as ablation
import experiments.ablation.sweep as sweep
import experiments.train.__main__ as train
from experiments.common import entry
from experiments.common.ablation import seed_workloads
from experiments.common.errors import USER_ERRORS
from experiments.common.workload import workload_steps
from experiments.train.driver import check_options, run_data


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two values of every file flag, each a valid file that gives other documents than the other."""
    d = tmp_path_factory.mktemp("sources")
    rng = np.random.default_rng(0)
    out = {}
    for i in (1, 2):
        lengths = d / f"lengths{i}.txt"
        lengths.write_text("\n".join(str(n) for n in rng.integers(3 * i, 100, 50)) + "\n")
        trace = d / f"trace{i}.csv"
        trace.write_text("step,length\n" + "".join(f"{s},{n}\n" for s in range(4) for n in rng.integers(1, 20 * i, 3)))
        tokens = d / f"tokens{i}.npy"
        np.save(tokens, rng.integers(0, 97, 400).astype(np.uint16))
        offsets = d / f"offsets{i}.npy"
        np.save(offsets, np.concatenate([[0], np.sort(rng.choice(np.arange(1, 400), 60 + 10 * i, replace=False)), [400]]).astype(np.int64))
        replay = d / f"replay{i}"  # an ablation whose steps the driver replays: seeds 0 and 1 select other steps
        common = ["--model", "tiny", "--workload", "tiny", "--world-size", "8", "--gpus-per-node", "2", "--tokens-per-rank", "32"]
        ablation.main(
            [
                *common,
                "--ep",
                "1",
                "--seeds",
                "1",
                "--seed",
                str(i),
                "--steps",
                "20",
                "--out",
                str(replay),
                "--no-progress",
                "--no-whole-run",
            ]
        )
        out.update(
            {
                ("--lengths", i): [str(lengths)],
                ("--trace", i): [str(trace)],
                ("--tokens", i): [str(tokens)],
                ("--doc-offsets", i): [str(offsets)],
                ("--replay", i): [str(replay), "--mode", "all"],
            }
        )
    for flag, one, two in (("--body-median", "5", "9"), ("--long-max", "100", "50"), ("--fill", "0.5", "0.9"), ("--seeds", "1", "2")):
        out[(flag, 1)], out[(flag, 2)] = [one], [two]
    out[("--clip-to-cluster", 1)], out[("--clip-to-cluster", 2)] = "--clip-to-cluster", "--no-clip-to-cluster"
    return out


def _argv(files, combo, changed=None) -> list[str]:
    argv = []
    for flag in combo:
        value = files[(flag, 2 if flag == changed else 1)]
        argv += [value] if isinstance(value, str) else [flag, *value]
    return argv


def _ablation_data(base, argv, parse_command=ablation.COMMAND):
    settings = entry.parse(parse_command, [*base, *argv])
    if "sweep" in settings.sections:  # as the sweep's main: its factors read before its first point
        sweep.check_factors(settings)
    return [
        workload_steps(w) for w in seed_workloads(settings, list(range(settings.workload.seed, settings.workload.seed + _seeds(settings))))
    ]


def _seeds(settings) -> int:
    return (settings.sections.get("ablation") or settings.sections["sweep"]).seeds


def _train_data(base, argv):
    settings = entry.parse(train.COMMAND, [*base, *argv], resolve_workload=False)
    check_options(settings)
    from experiments.common.settings import prepare

    s, source, step_ids = run_data(prepare(settings))
    return [(b.step, [t.tolist() for _, t in sorted(b.tokens.items())]) for b in (source.get(k) for k in step_ids)]


ENTRY_POINTS = {
    "ablation": (
        lambda base, argv: _ablation_data(base, argv),
        ["--model", "tiny", "--workload", "tiny", "--world-size", "2", "--gpus-per-node", "2", "--tokens-per-rank", "32", "--steps", "20"],
        ("--lengths", "--trace", "--body-median", "--long-max", "--clip-to-cluster", "--fill", "--seeds"),
    ),
    "sweep": (
        lambda base, argv: _ablation_data(base, argv, sweep.COMMAND),
        ["--model", "tiny", "--workload", "tiny", "--world-size", "2", "--gpus-per-node", "2", "--tokens-per-rank", "32", "--steps", "20"]
        + ["--factors", "ratio"],
        ("--lengths", "--trace", "--body-median", "--long-max", "--clip-to-cluster", "--fill", "--seeds"),
    ),
    "train": (
        _train_data,
        ["--tokens-per-rank", "64", "--steps", "20"],
        ("--lengths", "--trace", "--tokens", "--doc-offsets", "--replay", "--body-median", "--long-max", "--clip-to-cluster", "--fill"),
    ),
}


def _run(data, base, argv, tmp_path):
    """(what the run consumes, None), or (None, the one-line refusal)."""
    try:
        return data([*base, "--out", str(tmp_path / "out")], argv), None
    except entry.UserExit as e:
        return None, str(e)
    except USER_ERRORS as e:
        return None, str(e)


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_every_data_source_flag_alone_and_in_pairs_is_read_or_refused_in_one_line(name, files, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    data, base, flags = ENTRY_POINTS[name]
    combos = [(f,) for f in flags] + list(itertools.combinations(flags, 2))
    read, refused = [], []
    for combo in combos:
        consumed, refusal = _run(data, base, _argv(files, combo), tmp_path)
        if refusal is not None:
            assert "\n" not in refusal and refusal.strip(), f"{combo}: a refusal of more than one line: {refusal!r}"
            refused.append(combo)
            continue
        for flag in combo:  # read: its other value alone changes what the run consumes
            other, why = _run(data, base, _argv(files, combo, changed=flag), tmp_path)
            assert why is None, f"{combo}: {flag}'s other value was refused where its first was taken: {why}"
            assert other != consumed, f"{combo}: {flag} was given and taken, but changing it changes nothing the run reads"
        read.append(combo)
    # the yardstick can fail: every flag alone is read somewhere, and some pairs are refused
    assert {c[0] for c in read if len(c) == 1} >= set(flags) - {"--tokens", "--doc-offsets"}, read
    assert refused, "no combination refused: the sources never conflict?"
