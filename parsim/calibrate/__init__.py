"""Calibration: fit a cluster file to the machine at hand (a CPU host's ranks, one GPU's kernels), the host's
foreign load while it measures, and prediction beside measurement for collectives."""
