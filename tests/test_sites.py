"""The exchange sites are one enum (solver.sites.Site): every site belongs to one family, a
family's keys hold its sites' forward and backward counts, and no code outside solver/sites.py
names a site by a string or matches one by a prefix."""

import os
import re

from kernels.exchange import CommStats
from solver.sites import EVERY_SITE, Family, Site, sites_of
from tests.dist_utils import ROOT

NAMED = re.compile(r"[\"'](full|sparse|moe)\.(entry|exit|redist|halo|states|counts|dispatch|combine)|startswith\(site")


def test_a_familys_keys_are_its_sites_forward_and_backward():
    assert {s.family for s in Site} == set(Family)
    for family in Family:
        mine = [s for s in Site if s.family is family]
        assert sites_of(family) == {s.value for s in mine} | {s.backward for s in mine}
    assert EVERY_SITE == sites_of(*Family) and len(EVERY_SITE) == 2 * len(Site)


def test_the_statistics_sum_a_familys_sites_by_name_not_by_prefix():
    """A site whose name starts as a family's does ("full.entryway") is not counted in it."""
    stats = CommStats(gpus_per_node=2)
    stats.record_peers(Site.FULL_ENTRY, 0, {1: 3, 2: 5}, 10)
    stats.record_peers(Site.FULL_ENTRY.backward, 0, {2: 1}, 10)
    stats.record_peers("full.entryway", 0, {2: 100}, 10)
    assert stats.intra_node_bytes(sites_of(Family.FULL)) == 30 and stats.inter_node_bytes(sites_of(Family.FULL)) == 60
    assert stats.total_calls(sites_of(Family.FULL)) == 2 and stats.total_calls() == 3


def test_no_code_names_a_site_by_a_string():
    found = []
    for package in ("config", "kernels", "model", "solver", "experiments"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in (f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                if os.path.relpath(path, ROOT) == os.path.join("solver", "sites.py"):
                    continue
                found += [f"{path}:{i}: {line.strip()}" for i, line in enumerate(open(path, encoding="utf-8"), 1) if NAMED.search(line)]
    assert not found, "\n".join(found)
