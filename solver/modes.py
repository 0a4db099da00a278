"""The ways a step runs, declared once: every mode is a frozen record of the stages the planner
composes, and the rest of the project reads the record (or the plan it produced), never the
mode's name.

A mode's stages, in the order the planner runs them (solver.planner.make_plan):

1. the parent assignment every mode starts from (solver.assignment.assign_parents: whole samples to
   aligned groups, balanced as the planner section's assignment_pricing says);
2. how each wide parent first runs its sparse layers (`start`): its own layout (Ulysses in the
   parent), node-local Ulysses children (the child solver), halo children, or its own layout with
   halo attention;
3. the parent solver (`solver`: rebalance the parents for the children they get) and, after it,
   the width search (`widths`: parents may change width and share);
4. the per-parent choice (`cheapest`): each wide parent reworked to the cheapest of its own
   layout, Ulysses children, halo children or a mix (solver.halo.choose_children), the whole plan
   no slower than any single way's (solver.planner);
5. how a repacked parent's layout change is made (`folded`): inside the full layers' entry and
   exit all-to-alls (the paper's folding), or by an all-to-all of the hidden states of its own at
   every full/sparse boundary (a redistribution). The plan records it per parent
   (ParentPlan.redistributed), and the simulator and the runtime read it there.

Adding a way to run a layer is a new stage value here and its implementation in the stage's
module; the report and the ablation take the modes, their order, their labels and the paper's
figures from MODE_TABLE.
"""

from __future__ import annotations

from dataclasses import dataclass

from config import SettingError

# how a wide parent first runs its sparse layers (stage 2)
OWN = "own layout"  # Ulysses in the parent: no repacking
CHILDREN = "Ulysses children"  # node-local Ulysses children (the child solver)
HALO_CHILDREN = "halo children"  # long samples cut over contiguous ranks, halo attention
OWN_HALO = "own layout, halo attention"  # every sample cut over every parent rank, halo attention
STARTS = (OWN, CHILDREN, HALO_CHILDREN, OWN_HALO)


@dataclass(frozen=True)
class Mode:
    """One way to run a step: its stages (the module's docstring), where it comes from, and what the
    report calls it."""

    name: str
    description: str  # one line
    start: str = OWN  # stage 2: one of STARTS
    solver: bool = False  # stage 3: the parent solver
    widths: bool = False  # stage 3: the width search (needs the parent solver)
    cheapest: bool = False  # stage 4: each wide parent reworked to its cheapest way
    folded: bool = True  # stage 5: False, a repacked parent's layout change is a redistribution of its own
    paper: tuple[float, float] | None = None  # the paper's (step time change %, MFU change pp), for its three modes
    label: str = ""  # the report's name for it, where more than the name
    headline: bool = False  # in the README's headline table
    control: bool = False  # a study's control or a naive form, not a way to run a job (experiments.advise leaves it out)

    def __post_init__(self):
        if self.start not in STARTS:
            raise ValueError(f"mode {self.name!r}: start={self.start!r}; valid: {STARTS}")
        if self.widths and not self.solver:
            raise ValueError(f"mode {self.name!r}: the width search refines the parent solver's plan; it needs solver=True")

    @property
    def repacks(self) -> bool:
        """Do its wide parents start with children other than themselves (what the solvers plan for)?"""
        return self.start != OWN

    @property
    def needs_reach(self) -> bool:
        """Does every plan of it need a sparse kind with a reach (a halo exchange serves it)? The
        per-parent choice does not: it leaves halo children out for a kind without one."""
        return self.start in (HALO_CHILDREN, OWN_HALO)

    @property
    def in_paper(self) -> bool:
        return self.paper is not None

    @property
    def shown(self) -> str:
        return self.label or self.name


MODE_TABLE: tuple[Mode, ...] = (
    Mode("baseline", "repacking disabled: every layer in the parent layout", paper=(0.0, 0.0)),
    Mode(
        "repack",
        "the assigned parents, each wide one repacked into node-local Ulysses children",
        CHILDREN,
        paper=(-5.95, 3.75),
        headline=True,
    ),  # fmt: skip
    Mode(
        "repack+solver",
        "repacking with the paper's parent solver, which rebalances the parents for their children",
        CHILDREN,
        solver=True,
        paper=(-7.61, 4.83),
        headline=True,
    ),  # fmt: skip
    Mode(
        "baseline+solver",
        "the control: the parent solver without repacking (what the solver alone is worth)",
        OWN,
        solver=True,
        label="baseline+solver (control)",
        control=True,
    ),  # fmt: skip
    Mode(
        "repack+widths",
        "beyond the paper: a parent solver that also changes the parents' widths",
        CHILDREN,
        solver=True,
        widths=True,
        label="repack+widths (beyond the paper)",
        headline=True,
    ),  # fmt: skip
    Mode(
        "redistribute",
        "repack+solver's plans with the layout changed by an all-to-all of its own at every full/sparse boundary",
        CHILDREN,
        solver=True,
        folded=False,
        label="redistribute (the pass the paper avoids)",
        control=True,
        headline=True,
    ),  # fmt: skip
    Mode("halo", "the assigned wide parents get halo children", HALO_CHILDREN, label="halo (halo children)"),
    Mode(
        "parent+halo",
        "the naive halo: wide parents keep their own layout, with halo attention",
        OWN_HALO,
        label="parent+halo (naive halo)",
        control=True,
    ),  # fmt: skip
    Mode(
        "choose",
        "beyond the paper: repack+widths' plans, each wide parent run the cheapest way",
        CHILDREN,
        solver=True,
        widths=True,
        cheapest=True,
        label="choose (beyond the paper: per parent)",
        headline=True,
    ),  # fmt: skip
)

MODES: tuple[str, ...] = tuple(m.name for m in MODE_TABLE)  # in the table's order: the order every report uses
PAPER_MODES: tuple[str, ...] = tuple(m.name for m in MODE_TABLE if m.in_paper)
REFERENCE: str = MODE_TABLE[0].name  # the mode every change is measured against (the baseline)
_BY_NAME = {m.name: m for m in MODE_TABLE}


def modes_for(kind) -> list[str]:
    """Every mode a sparse kind's layers can run: all but the halo modes for a kind without a reach
    (SparseKind.first_key: no halo exchange can serve it; choose then runs without halo children)."""
    return [m.name for m in MODE_TABLE if kind.first_key is not None or not m.needs_reach]


def modes_help() -> str:
    """The modes for an entry point's --help, from the table: one line each, its name and what it does."""
    width = max(len(m.name) for m in MODE_TABLE)
    return "modes (solver.modes.MODE_TABLE):\n" + "\n".join(f"  {m.name:<{width}}  {m.description}" for m in MODE_TABLE)


def mode_of(name: str) -> Mode:
    """The declared mode of that name; SettingError naming the valid ones."""
    if name not in _BY_NAME:
        raise SettingError(f"mode={name!r} is invalid: it must be one of {list(MODES)}")
    return _BY_NAME[name]


def modes_where(**stages) -> tuple[str, ...]:
    """The names of the modes whose records have these values, in the table's order:
    modes_where(in_paper=True), modes_where(needs_reach=False)."""
    return tuple(m.name for m in MODE_TABLE if all(getattr(m, k) == v for k, v in stages.items()))


STAGES = ("start", "solver", "widths", "cheapest", "folded")  # what makes two modes run differently


def twin(name: str, **changes) -> str | None:
    """The declared mode whose stages are `name`'s with `changes`, or None: the pairs a comparison
    isolates one stage with (twin("redistribute", folded=True) is repack+solver, the folding's
    worth; twin("repack+solver", start=OWN) is baseline+solver, the parent solver's alone)."""
    want = {k: changes.get(k, getattr(mode_of(name), k)) for k in STAGES}
    unknown = sorted(set(changes) - set(STAGES))
    if unknown:
        raise ValueError(f"no stage {unknown[0]!r}; stages: {STAGES}")
    return next((m.name for m in MODE_TABLE if all(getattr(m, k) == v for k, v in want.items())), None)


def paper_figures(name: str) -> dict[str, float] | None:
    """The paper's figures of a mode ({"time_change_pct", "mfu_change_pp"}), or None."""
    p = mode_of(name).paper
    return None if p is None else {"time_change_pct": p[0], "mfu_change_pp": p[1]}


__all__ = [
    "CHILDREN",
    "HALO_CHILDREN",
    "MODES",
    "MODE_TABLE",
    "Mode",
    "OWN",
    "OWN_HALO",
    "PAPER_MODES",
    "REFERENCE",
    "STARTS",
    "mode_of",
    "modes_for",
    "modes_help",
    "modes_where",
    "paper_figures",
    "twin",
]
