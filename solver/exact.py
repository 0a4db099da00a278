"""Exact solvers (MILPs, scipy's HiGHS) for small instances: the yardsticks of the heuristics. The
child problem of one parent (solve_exact) and the joint problem of a whole step (solve_joint_exact)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from .children import ChildProblem
from .cluster import Cluster, PlanError, ceil_div
from .cost import CostModel
from .layout import Group


def candidate_blocks(parent_size: int, node_size: int) -> list[tuple[int, int]]:
    """Every aligned power-of-two block (offset, size) inside one node of the parent."""
    out, c = [], 1
    while c <= node_size:
        out += [(o, c) for o in range(0, parent_size, c)]
        c *= 2
    return out


class _MinMakespan:
    """A MILP of binaries and one continuous makespan z (the last variable), minimized: rows are
    added as (coefficients, lower, upper)."""

    def __init__(self, nvar: int):
        self.nvar, self.z = nvar, nvar - 1
        self.rows, self.lo, self.hi = [], [], []

    def add(self, coeffs, lb, ub) -> None:
        r = np.zeros(self.nvar)
        for j, v in coeffs:
            r[j] += v
        self.rows.append(r)
        self.lo.append(lb)
        self.hi.append(ub)

    def solve(self, time_limit: float):
        obj = np.zeros(self.nvar)
        obj[self.z] = 1.0
        integrality = np.ones(self.nvar)
        integrality[self.z] = 0
        return milp(
            obj,
            constraints=LinearConstraint(np.array(self.rows), self.lo, self.hi),
            integrality=integrality,
            bounds=Bounds(np.zeros(self.nvar), np.r_[np.ones(self.nvar - 1), np.inf]),
            options={"time_limit": time_limit, "mip_rel_gap": 1e-6},
        )


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

    m = _MinMakespan(nvar)
    add = m.add
    for r in range(p.parent_size):  # every rank in exactly one child
        add([(b, 1.0) for b, (o, c) in enumerate(blocks) if o <= r < o + c], 1, 1)
    for i in range(n):  # every sample in exactly one child
        add([(xi(i, b), 1.0) for b in range(nb)], 1, 1)
    big = float(p.tokenwise.sum() + max(p.per_token.values()) * p.lengths.sum()) + 1.0
    for b, (_, c) in enumerate(blocks):
        for i in range(n):  # x <= y
            add([(xi(i, b), 1.0), (b, -1.0)], -np.inf, 0)
        # token budget per rank (chunks rounded up, as the heuristic counts them)
        add([(xi(i, b), float(ceil_div(int(p.lengths[i]), c))) for i in range(n)], -np.inf, p.budget)
        # makespan: load / c + fixed <= z   (only binding when the block is used)
        coeffs = [(xi(i, b), (float(p.tokenwise[i]) + p.per_token[c] * float(p.lengths[i])) / c) for i in range(n)]
        add(coeffs + [(b, p.fixed[c] + big), (zi, -1.0)], -np.inf, big)
    res = m.solve(time_limit)
    if res.x is None:
        return float("inf")
    return float(res.x[zi])


# ----- the joint problem: parents' widths and members, and the children of each wide parent ----------
@dataclass(frozen=True)
class JointOptimum:
    """The exact joint MILP's answer: its step time (PlanEstimate's), the parents as ParentPlans
    laid out widest first, and whether HiGHS proved it optimal within the time limit."""

    time: float
    parents: tuple
    proven: bool


def _slots(world: int, widest: int) -> list[tuple[int, int]]:
    """Parent slots (size, k): up to world / size parents of each power-of-two size."""
    out, p = [], 1
    while p <= min(world, widest):
        out += [(p, k) for k in range(world // p)]
        p *= 2
    return out


def solve_joint_exact(samples, cluster: Cluster, cost: CostModel, time_limit: float = 30.0) -> JointOptimum:
    """The fastest plan over every choice of parents (widths up to the heads' limit, members) and,
    for each parent wider than a node, node-local children or its own layout, priced exactly as
    PlanEstimate prices a plan. For small instances (tens of ranks, tens of samples): the
    yardstick of the parent solvers.

    Positions do not enter: power-of-two parents laid out widest first stay aligned, and so do a
    wide parent's children (each at most a node) inside it, so the problem is one of sizes
    ("slots"). Variables: y (a parent slot is used), o (a wide parent keeps its own layout), v (a
    child slot of a wide parent is used), x (sample i in a child of a parent), z (the step time).
    Symmetric slots are ordered (used first, then by tokens)."""
    cost = cost.for_cluster(cluster)
    samples = tuple(samples)
    lengths = np.array([s.length for s in samples], dtype=np.int64)
    full = np.asarray(cost.full_cost(lengths), dtype=np.float64)
    tokenwise = np.asarray(cost.tokenwise_cost(lengths), dtype=np.float64)
    node, budget, world = cluster.gpus_per_node, cluster.tokens_per_rank, cluster.world_size
    parents = _slots(world, cost.widest_group(cluster))
    # units: (parent slot, child size, child slot); child size == parent size is its own layout
    units = []
    for pi, (p, _) in enumerate(parents):
        units.append((pi, p, 0))
        if p > node:
            c = 1
            while c <= node:
                units += [(pi, c, j) for j in range(p // c)]
                c *= 2
    n, npar, nu = len(samples), len(parents), len(units)
    pairs = [(i, u) for u in range(nu) for i in range(n) if ceil_div(int(lengths[i]), units[u][1]) <= budget]
    if any(not any(i == j for j, _ in pairs) for i in range(n)):
        bad = next(i for i in range(n) if not any(i == j for j, _ in pairs))
        raise PlanError(f"sample id={samples[bad].id} of length={int(lengths[bad])} fits no group of this cluster")
    # variable layout: y[npar], w[nu] (unit used; for an own unit of a parent <= node it equals y), x[pairs], z
    nw = nu
    nvar = npar + nw + len(pairs) + 1
    zi = nvar - 1

    def yi(pi):
        return pi

    def wi(u):
        return npar + u

    xi = {pair: npar + nw + k for k, pair in enumerate(pairs)}
    m = _MinMakespan(nvar)
    add = m.add

    add([(yi(pi), float(p)) for pi, (p, _) in enumerate(parents)], world, world)  # the parents cover every rank
    by_parent: dict[int, list[int]] = {}
    for u, (pi, _c, _) in enumerate(units):
        by_parent.setdefault(pi, []).append(u)
    for pi, (p, _) in enumerate(parents):
        us = by_parent[pi]
        # a used parent's units cover its ranks: its own layout (size p) or children summing to p
        add([(wi(u), float(units[u][1])) for u in us] + [(yi(pi), -float(p))], 0, 0)
        for u in us:
            add([(wi(u), 1.0), (yi(pi), -1.0)], -np.inf, 0)
    for i in range(n):  # every sample in exactly one unit
        add([(xi[(j, u)], 1.0) for (j, u) in pairs if j == i], 1, 1)
    x_of_unit: dict[int, list[int]] = {}
    for i, u in pairs:
        x_of_unit.setdefault(u, []).append(i)
        add([(xi[(i, u)], 1.0), (wi(u), -1.0)], -np.inf, 0)
    lines = [cost.child_line(c, parents[pi][0]) for pi, c, _ in units]
    # a bound on any unit's time: every sample's work on one rank, plus the largest fixed costs
    big = float(full.sum() + tokenwise.sum()) + max(a for a, _ in lines) * float(lengths.sum())
    big = 2 * (big + max(cost.parent_fixed(p) for p, _ in parents) + max(b for _, b in lines)) + 1.0
    for pi, (p, _) in enumerate(parents):
        members = [(i, u) for u in by_parent[pi] for i in x_of_unit.get(u, [])]
        # the parent's head layout holds ceil(L / p) of each member per rank
        add([(xi[m], float(ceil_div(int(lengths[m[0]]), p))) for m in members], -np.inf, budget)
        shared = [(xi[m], float(full[m[0]]) / p) for m in members] + [(yi(pi), cost.parent_fixed(p))]
        for u in by_parent[pi]:
            _, c, _ = units[u]
            a, b = cost.child_line(c, p)
            own = [(xi[(i, u)], (float(tokenwise[i]) + a * float(lengths[i])) / c) for i in x_of_unit.get(u, [])]
            add([(xi[(i, u)], float(ceil_div(int(lengths[i]), c))) for i in x_of_unit.get(u, [])], -np.inf, budget)
            # z >= shared + own + b when the unit is used (big-M off otherwise)
            add(shared + own + [(wi(u), b + big), (zi, -1.0)], -np.inf, big)
    # symmetry: among equal slots, used ones first and by tokens; the same for a parent's child slots
    for pi in range(npar - 1):
        (p, _), (p2, _) = parents[pi], parents[pi + 1]
        if p2 == p:
            add([(yi(pi), 1.0), (yi(pi + 1), -1.0)], 0, np.inf)
            tok = [(xi[(i, u)], float(lengths[i])) for u in by_parent[pi] for i in x_of_unit.get(u, [])]
            tok += [(xi[(i, u)], -float(lengths[i])) for u in by_parent[pi + 1] for i in x_of_unit.get(u, [])]
            add(tok, 0, np.inf)
    for u in range(nu - 1):
        (pi, c, _), (pi2, c2, _) = units[u], units[u + 1]
        if pi2 == pi and c2 == c and c < parents[pi][0]:
            add([(wi(u), 1.0), (wi(u + 1), -1.0)], 0, np.inf)
            tok = [(xi[(i, u)], float(lengths[i])) for i in x_of_unit.get(u, [])]
            tok += [(xi[(i, u + 1)], -float(lengths[i])) for i in x_of_unit.get(u + 1, [])]
            add(tok, 0, np.inf)
    res = m.solve(time_limit)
    if res.x is None:
        raise PlanError(f"the joint MILP found no plan within {time_limit} s ({res.message})")
    sol = np.round(res.x).astype(int)
    plans = _joint_plans(samples, parents, units, pairs, xi, sol, yi, wi, cluster)
    return JointOptimum(float(res.x[zi]), plans, res.status == 0)


def _joint_plans(samples, parents, units, pairs, xi, sol, yi, wi, cluster) -> tuple:
    """The MILP's choice as ParentPlans: parents widest first, a wide parent's children widest
    first inside it (power-of-two sizes, each at most a node: every one inside a node)."""
    from .plan import DISABLED, NODE_LOCAL, ParentPlan  # noqa: PLC0415

    members: dict[int, list[int]] = {}
    for i, u in pairs:
        if sol[xi[(i, u)]]:
            members.setdefault(u, []).append(samples[i].id)
    chosen = sorted((pi for pi in range(len(parents)) if sol[yi(pi)]), key=lambda pi: (-parents[pi][0], pi))
    out, at = [], 0
    for pi in chosen:
        p = parents[pi][0]
        us = [u for u in range(len(units)) if units[u][0] == pi and sol[wi(u)]]
        ids = tuple(s for u in us for s in members.get(u, []))
        g = Group(at, p, ids)
        if len(us) == 1 and units[us[0]][1] == p:
            out.append(ParentPlan(g, (g,), NODE_LOCAL if p <= cluster.gpus_per_node else DISABLED))
        else:
            kids, off = [], at
            for u in sorted(us, key=lambda u: (-units[u][1], u)):
                c = units[u][1]
                kids.append(Group(off, c, tuple(members.get(u, []))))
                off += c
            out.append(ParentPlan(g, tuple(kids), ""))
        at += p
    return tuple(out)
