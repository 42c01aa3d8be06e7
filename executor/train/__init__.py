"""Train a parsim plan on torch.distributed and measure it in the simulator's trace schema.

:func:`run_plan` runs a plan on N ranks (gloo on CPUs, NCCL on GPUs) and
returns the measured Trace of the median step plus a summary (and, asked,
each rank's torch.profiler trace, which :mod:`parsim.kineto.read` reads back).

Modules, one job each: ``models`` (dense seeded torch modules cut into the
simulator's pieces), ``moe`` (the mixture-of-experts feed-forward and its
all-to-all dispatcher), ``comm`` (timed tensor- and expert-parallel
collectives as autograd functions), ``parallel`` (``apply_tensor_parallel``,
``apply_expert_parallel``, ``apply_data_parallel``, ``tie_embeddings``,
sequence parallelism's norm-gradient sum), ``zero`` (ZeRO-1/2's distributed
optimizer), ``fsdp`` (FSDP2 units with named collectives), ``mixed_precision``
(main grads in the reduce dtype, AdamW on fp32 master weights), ``context_parallel``
(ring and all-gather attention), ``recompute`` (full recomputation),
``pipeline`` (runs parsim's schedule action lists), ``runner`` (builds a
rank, times its steps), ``trace_recorder``,
``measure`` (launch and summarize). torch is imported
only by the modules that need it, when they are imported.
"""

from .measure import run_plan

__all__ = ["run_plan"]
