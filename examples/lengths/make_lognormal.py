"""Write a file of log-normal document lengths, one a line (gzipped where the name ends in .gz):
the file the README's and docs/results.md's decision reads.

    python examples/lengths/make_lognormal.py examples/lengths/lognormal-20k.txt.gz   # 20,000 lengths, median 2,000

The lengths: n draws of a log-normal of median `median` and sigma `sigma`, rounded and clipped to
[shortest, longest], from numpy's default generator seeded with `seed` (the same file on every
machine for one numpy).
"""

from __future__ import annotations

import argparse
import gzip

import numpy as np


def lognormal_lengths(n: int = 20_000, median: float = 2000, sigma: float = 1.2, shortest: int = 16, longest: int = 200_000,
                      seed: int = 0) -> np.ndarray:  # fmt: skip
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, n)), shortest, longest).astype(np.int64)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the file to write (.gz: gzipped)")
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--median", type=float, default=2000)
    p.add_argument("--sigma", type=float, default=1.2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    text = "".join(f"{x}\n" for x in lognormal_lengths(a.n, a.median, a.sigma, seed=a.seed)).encode()
    if a.out.endswith(".gz"):
        with open(a.out, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as z:
            z.write(text)
    else:
        with open(a.out, "wb") as f:
            f.write(text)


if __name__ == "__main__":
    main()
