"""python -m experiments.ablation: the paper's ablation on the embedded simulator (what it does and
its settings: python -m experiments.ablation --help, from experiments.ablation.run.DESCRIPTION)."""

from __future__ import annotations

import time

from experiments.ablation.run import COMMAND, print_tables
from experiments.common import entry
from experiments.common.ablation import run_ablation
from experiments.common.files import check_output_dir, lock_folder
from experiments.common.results import ROW_BYTES, write_run
from solver.modes import MODES


def main(argv=None):
    t0 = time.time()
    settings = entry.parse(COMMAND, argv)  # every input checked before any work, and before anything is written
    opts = settings.ablation
    with entry.user_errors():
        # the most it writes: a row of every step of every seed in every mode (ROW_BYTES each, at most)
        check_output_dir(opts.out, need=opts.seeds * settings.workload.steps * len(MODES) * ROW_BYTES)
        lock_folder(opts.out)  # a second ablation into the same folder is refused, not run over this one
        seeds = list(range(settings.workload.seed, settings.workload.seed + opts.seeds))
        rows, summary = run_ablation(settings, seeds, progress=opts.progress)
    print_tables(rows, summary)
    with entry.user_errors():
        csv_path, json_path = write_run(opts.out, rows, summary)
    p = summary["provenance"]
    print(f"\nwrote {csv_path} and {json_path}  (commit {p['commit']}, {p['device']}, {time.time() - t0:.1f} s)")
    return rows, summary


if __name__ == "__main__":
    main()
