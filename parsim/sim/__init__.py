"""The simulator: per-rank programs, the step engine on simpy, the compute cost model and shared CPU cores."""
