"""Entry points that produce results (experiments/README.md lists them), and the code they share
(experiments.common). Nothing outside experiments imports it, and no entry point imports another
(tests/test_structure.py keeps both true)."""
