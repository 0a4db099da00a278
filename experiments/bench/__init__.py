"""Benchmarks that print figures: planning time and the solvers against exact optima (solver),
a rank's host work per step (host), the pack/unpack kernels' bandwidth (kernels), and the memory
estimate per rank (memory)."""
