"""The training driver (python -m experiments.train) and its components: the data it trains on,
its checkpoints, and the memory estimate it prints before step 1."""
