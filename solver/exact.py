"""Exact child solver (MILP, scipy's HiGHS) for small instances: the yardstick of the heuristic."""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from .children import ChildProblem
from .cluster import ceil_div


def candidate_blocks(parent_size: int, node_size: int) -> list[tuple[int, int]]:
    """Every aligned power-of-two block (offset, size) inside one node of the parent."""
    out, c = [], 1
    while c <= node_size:
        out += [(o, c) for o in range(0, parent_size, c)]
        c *= 2
    return out


def solve_exact(p: ChildProblem, time_limit: float = 20.0) -> float:
    """Optimal slowest-child time over all node-local children and assignments.

    Variables: y[b] (block b is a child), x[i, b] (sample i in block b), z (makespan).
    The latency term fixed of a used child is folded in through y[b].
    """
    blocks = candidate_blocks(p.parent_size, p.node_size)
    n, nb = len(p.lengths), len(blocks)
    nx = n * nb
    nvar = nb + nx + 1
    zi = nvar - 1

    def xi(i, b):
        return nb + i * nb + b

    rows, lo, hi = [], [], []

    def add(coeffs, lb, ub):
        r = np.zeros(nvar)
        for j, v in coeffs:
            r[j] += v
        rows.append(r)
        lo.append(lb)
        hi.append(ub)

    for r in range(p.parent_size):  # every rank in exactly one child
        add([(b, 1.0) for b, (o, c) in enumerate(blocks) if o <= r < o + c], 1, 1)
    for i in range(n):  # every sample in exactly one child
        add([(xi(i, b), 1.0) for b in range(nb)], 1, 1)
    big = float(p.linear.sum() + max(p.per_token.values()) * p.lengths.sum()) + 1.0
    for b, (_, c) in enumerate(blocks):
        for i in range(n):  # x <= y
            add([(xi(i, b), 1.0), (b, -1.0)], -np.inf, 0)
        # token budget per rank (chunks rounded up, as the heuristic counts them)
        add([(xi(i, b), float(ceil_div(int(p.lengths[i]), c))) for i in range(n)], -np.inf, p.budget)
        # makespan: load / c + fixed <= z   (only binding when the block is used)
        coeffs = [(xi(i, b), (float(p.linear[i]) + p.per_token[c] * float(p.lengths[i])) / c) for i in range(n)]
        add(coeffs + [(b, p.fixed[c] + big), (zi, -1.0)], -np.inf, big)
    cost = np.zeros(nvar)
    cost[zi] = 1.0
    integrality = np.ones(nvar)
    integrality[zi] = 0
    res = milp(
        cost,
        constraints=LinearConstraint(np.array(rows), lo, hi),
        integrality=integrality,
        bounds=Bounds(np.zeros(nvar), np.r_[np.ones(nvar - 1), np.inf]),
        options={"time_limit": time_limit, "mip_rel_gap": 1e-6},
    )
    if res.x is None:
        return float("inf")
    return float(res.x[zi])
