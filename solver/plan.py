"""Step plans: the parents of one step and, for each parent, the child layout of its sparse layers."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property

from .cluster import Cluster, PlanError, PlanInvariantError
from .layout import Group, TokenLayout

# A parent's children before they are laid out: (child size, sample ids) per child, in rank
# order, as the parent solver's stages hand them on; None: the parent keeps its own layout.
Kids = tuple[tuple[int, tuple[int, ...]], ...]

# reasons a parent keeps its own layout for the sparse layers
NODE_LOCAL = "node-local: already inside one node"
DISABLED = "repacking disabled (baseline)"


@dataclass(frozen=True)
class ParentPlan:
    """A parent group (full attention) and its children (sparse layers and token-wise work).

    children == (group,) when the parent is not repacked; `reason` then says why.
    """

    group: Group
    children: tuple[Group, ...]
    reason: str = ""
    # the layout change into its children is made by an all-to-all of the hidden states of its own
    # at every full/sparse boundary, not inside the full layers' entry and exit (solver.modes,
    # stage 5): the simulator and the runtime read it here
    redistributed: bool = False

    @property
    def repacked(self) -> bool:
        """Its children's token layout differs from the parent's (halo attention on the parent's
        own layout is no repacking)."""
        return not (len(self.children) == 1 and self.children[0].same_tokens(self.group))

    @property
    def halo(self) -> bool:
        """Some child runs its sparse attention by halo exchange."""
        return any(c.halo for c in self.children)

    def to_json(self) -> dict:
        out = {"group": self.group.to_json(), "children": [c.to_json() for c in self.children], "reason": self.reason}
        return out | ({"redistributed": True} if self.redistributed else {})  # folded: the JSON (and hash) of before

    @staticmethod
    def from_json(obj) -> ParentPlan:
        kids = tuple(Group.from_json(c) for c in obj["children"])
        return ParentPlan(Group.from_json(obj["group"]), kids, obj["reason"], bool(obj.get("redistributed", False)))


@dataclass(frozen=True)
class StepPlan:
    cluster: Cluster
    lengths: tuple[tuple[int, int], ...]  # (sample id, length), in step order
    parents: tuple[ParentPlan, ...]
    # who built it, for results and messages (the planner writes its mode's name; a plan built by
    # hand says so): a free label, never read to run or price it, serialized under "mode" as before
    label: str = "by hand"

    @cached_property
    def length_of(self) -> dict[int, int]:
        return dict(self.lengths)

    @cached_property
    def total_tokens(self) -> int:
        return sum(self.length_of.values())

    @cached_property
    def parent_layout(self) -> TokenLayout:
        return TokenLayout(tuple(p.group for p in self.parents), self.length_of)

    @cached_property
    def child_layout(self) -> TokenLayout:
        return TokenLayout(tuple(c for p in self.parents for c in p.children), self.length_of)

    @cached_property
    def group_shapes(self) -> frozenset[tuple[int, int]]:
        """(start, size) of every Ulysses group of two or more ranks in either layout: the process
        groups the step's exchanges run over (a halo child's exchange is point to point)."""
        layouts = (self.parent_layout, self.child_layout)
        return frozenset(
            (g.start, g.size) for layout in layouts for g in layout.groups if g.size > 1 and not g.halo
        )  # halos: point to point

    def wide_parents(self) -> list[ParentPlan]:
        return [p for p in self.parents if p.group.size > self.cluster.gpus_per_node]

    def parent_counts(self) -> dict[str, int]:
        """How the step's parents run their sparse layers: the wide ones, the repacked ones, those
        with halo attention, and of those the ones with a halo child across nodes."""
        g = self.cluster.gpus_per_node
        return {
            "wide_parents": len(self.wide_parents()),
            "repacked_parents": sum(p.repacked for p in self.parents),
            "halo_parents": sum(p.halo for p in self.parents),
            "halo_across_parents": sum(any(c.halo and c.spans_nodes(g) for c in p.children) for p in self.parents),
        }

    @property
    def widest_parent(self) -> int:
        return max(p.group.size for p in self.parents)

    @cached_property
    def redistributes(self) -> bool:
        """Does some parent change its layout by a redistribution of its own?"""
        return any(p.redistributed for p in self.parents)

    def validate(self) -> StepPlan:
        """Both layouts tile the cluster, every sample is placed once, budgets hold, and every child
        is node-local, aligned and inside its parent with exactly the parent's samples; only a
        repacked parent redistributes. A plan that breaks one was built wrong: PlanInvariantError
        (a bug, with its traceback), never the user's error."""
        try:
            self._check()
        except PlanError as e:
            raise PlanInvariantError(
                f"bug: a {self.label} plan breaks an invariant ({e}); the solvers must never build one: report it with this traceback"
            ) from e
        return self

    def _check(self) -> None:
        self.parent_layout.validate(self.cluster, name="parent layout")
        self.child_layout.validate(self.cluster, name="child layout")
        g = self.cluster.gpus_per_node
        for p in self.parents:
            ids = sorted(s for c in p.children for s in c.samples)
            if ids != sorted(p.group.samples):
                raise PlanError(f"children of parent at rank {p.group.start} hold {ids}, parent holds {sorted(p.group.samples)}")
            if p.repacked or p.halo:
                for c in p.children:
                    if c.start < p.group.start or c.stop > p.group.stop:
                        raise PlanError(f"child [{c.start}, {c.stop}) lies outside its parent [{p.group.start}, {p.group.stop})")
                    if not c.halo and c.spans_nodes(g):
                        raise PlanError(f"child [{c.start}, {c.stop}) spans nodes; Ulysses children must be node-local")
            if not p.repacked and not p.reason:
                raise PlanError(f"parent at rank {p.group.start} is not repacked and records no reason")
            if p.redistributed and not p.repacked:
                raise PlanError(f"parent at rank {p.group.start} redistributes but is not repacked: it has no layout to change")

    # ----- serialization -------------------------------------------------------------------
    def to_json(self) -> dict:
        c = self.cluster
        return {
            "cluster": {
                "world_size": c.world_size,
                "gpus_per_node": c.gpus_per_node,
                "tokens_per_rank": c.tokens_per_rank,
            },
            "lengths": [list(x) for x in self.lengths],
            "parents": [p.to_json() for p in self.parents],
            "mode": self.label,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(obj) -> StepPlan:
        if isinstance(obj, str):
            obj = json.loads(obj)
        return StepPlan(
            cluster=Cluster(**obj["cluster"]),
            lengths=tuple((int(a), int(b)) for a, b in obj["lengths"]),
            parents=tuple(ParentPlan.from_json(p) for p in obj["parents"]),
            label=obj["mode"],
        )

    @cached_property
    def hash(self) -> str:
        """Stable across processes and machines: sha256 of the canonical JSON."""
        return hashlib.sha256(self.dumps().encode()).hexdigest()[:16]

    @cached_property
    def layout_hash(self) -> str:
        """The hash of what runs and is priced, without the free label: two modes' plans of one
        step with the same layout_hash run and simulate alike (a step without a wide parent often
        gets one plan in several modes)."""
        obj = self.to_json()
        del obj["mode"]
        return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]

    def summary(self) -> str:
        rows = []
        for p in self.parents:
            g = p.group
            kids = ",".join(f"SP{c.size}" for c in p.children) if p.repacked else p.reason
            rows.append(f"SP{g.size}@{g.start}: {len(g.samples)} samples -> {kids}")
        return "\n".join(rows)
