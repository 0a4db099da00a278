"""The checks that need a GPU, as one prepared run (python -m experiments.gpu_check)."""
