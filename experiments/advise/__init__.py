"""python -m experiments.advise: which mode to run for a model, a workload and a cluster."""
