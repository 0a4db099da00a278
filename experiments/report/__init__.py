"""What the results look like: plots and loaders for the notebooks (plots), and the docs' tables and
figures rendered from results/ (python -m experiments.report)."""
