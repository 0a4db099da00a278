"""The simulated experiments: the paper's ablation (python -m experiments.ablation) and the
one-factor-at-a-time sweep around it (python -m experiments.ablation.sweep)."""
