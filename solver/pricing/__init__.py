"""The cost model's parts, one concern each (solver.cost.CostModel joins them): compute, the
exchanges, the sparse kind's own costs, and what every mode pays."""
