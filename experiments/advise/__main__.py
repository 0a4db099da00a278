"""python -m experiments.advise: will repacking pay on my cluster? (what it does and its settings:
python -m experiments.advise --help, from experiments.advise.run.DESCRIPTION)."""

from __future__ import annotations

import json
import os
import time

from experiments.advise.run import COMMAND, advise, draw, points, render
from experiments.common import entry
from experiments.common.files import check_output_dir, lock_folder
from experiments.common.results import strict_json


def main(argv=None) -> dict:
    t0 = time.time()
    settings = entry.parse(COMMAND, argv, resolve_workload=False)  # each point resolves its workload
    opts = settings.advise
    with entry.user_errors():
        prepared = points(settings)  # every point's settings checked before any work, and run as checked
        check_output_dir(opts.out)
        lock_folder(opts.out)
        result = advise(settings, progress=opts.progress, prepared=prepared)
    print(render(result))
    json_path, png_path = os.path.join(opts.out, "advise.json"), os.path.join(opts.out, "advise.png")
    with entry.user_errors():
        with open(json_path, "w") as f:
            json.dump(strict_json(result), f, indent=1)
        draw(result, png_path)
    p = result["provenance"]
    print(f"\nwrote {json_path} and {png_path}  (commit {p['commit']}, {p['device']}, {time.time() - t0:.0f} s)")
    return result


if __name__ == "__main__":
    main()
