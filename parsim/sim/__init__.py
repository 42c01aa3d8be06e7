"""The simulator: per-rank programs, the step engine on simpy, collectives as phases of flows, the compute cost
model and shared CPU cores."""
