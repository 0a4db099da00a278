"""The exchange sites: each all-to-all or point-to-point exchange a step runs, named once. The
runtime counts its bytes, calls and timers by site (kernels.exchange.CommStats: a site's backward
under its name + BACKWARD), the simulator's timeline prices them by the layer family they belong
to, and the emulated comparison and the driver's results columns read families of sites
(`sites_of`). Nothing matches a site by the prefix of its name.

    Site.FULL_ENTRY.family is Family.FULL
    sites_of(Family.SPARSE)   # every sparse-layer site, forward and backward, as CommStats keys
"""

from __future__ import annotations

from enum import Enum

BACKWARD = ".bwd"  # a site's backward exchange is counted under its name and this (kernels.exchange)


class Family(Enum):
    """The layers a site serves: the results' columns (exchange_full_s, ..., full_inter_bytes, ...)."""

    FULL = "full"  # the full-attention layers' exchanges (a redistributing parent's hidden states too)
    SPARSE = "sparse"  # the sparse layers' (Ulysses, halo rows, states)
    EXPERTS = "moe"  # the experts' all-to-alls


class Site(str, Enum):
    """One exchange of a step; its value is its name in the runtime's statistics and timers."""

    FULL_ENTRY = "full.entry"  # into the parent's head layout before full attention
    FULL_EXIT = "full.exit"  # back after it
    FULL_REDIST = "full.redist"  # a redistributing parent's hidden states into its own layout
    FULL_REDIST_BACK = "full.redist.back"  # and back into the children's
    SPARSE_ENTRY = "sparse.entry"  # a Ulysses child's entry before its sparse layer
    SPARSE_EXIT = "sparse.exit"
    SPARSE_HALO = "sparse.halo"  # a halo child's rows from the ranks before (keys and values; a linear kind's convolution rows)
    SPARSE_STATES = "sparse.states"  # a linear kind's maps or states
    EXPERTS_COUNTS = "moe.counts"  # the experts' slot counts
    EXPERTS_DISPATCH = "moe.dispatch"  # tokens to their experts
    EXPERTS_COMBINE = "moe.combine"  # and back

    @property
    def family(self) -> Family:
        return _FAMILY[self]

    @property
    def backward(self) -> str:
        """The key its backward exchange is counted under."""
        return self.value + BACKWARD

    def __str__(self) -> str:
        return self.value


_FAMILY = {
    **dict.fromkeys((Site.FULL_ENTRY, Site.FULL_EXIT, Site.FULL_REDIST, Site.FULL_REDIST_BACK), Family.FULL),
    **dict.fromkeys((Site.SPARSE_ENTRY, Site.SPARSE_EXIT, Site.SPARSE_HALO, Site.SPARSE_STATES), Family.SPARSE),
    **dict.fromkeys((Site.EXPERTS_COUNTS, Site.EXPERTS_DISPATCH, Site.EXPERTS_COMBINE), Family.EXPERTS),
}

ENTRY_EXIT = {"F": (Site.FULL_ENTRY, Site.FULL_EXIT), "S": (Site.SPARSE_ENTRY, Site.SPARSE_EXIT)}  # a layer type's Ulysses pair


def sites_of(*families: Family, only: tuple[Site, ...] | None = None) -> frozenset[str]:
    """The CommStats keys of these families' sites (or of `only`), forward and backward."""
    chosen = [s for s in Site if s.family in families] if only is None else list(only)
    return frozenset(k for s in chosen for k in (s.value, s.backward))


EVERY_SITE = sites_of(*Family)
