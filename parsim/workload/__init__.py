"""The workload: models and what their layers cost, parallelism plans, how layers split into pipeline stages, and
what one GPU holds."""
