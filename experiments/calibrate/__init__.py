"""Calibration of the cost model on the machines at hand (python -m experiments.calibrate), and an
emulated two-tier cluster on one machine where the simulator is checked against measured steps
(python -m experiments.calibrate.emulate)."""
