"""The executor: runs benchmarks and plans on real hardware with torch.distributed.

NCCL on GPUs, gloo on CPUs. torch is an optional dependency (the ``executor``
extra), so nothing here imports it at module import time: every function that
needs it goes through :mod:`executor._torch`, which turns a missing install
into one clear line instead of a traceback.

- :mod:`executor.launch` starts N local ranks (or joins a torchrun job), and
  ends the whole run when any rank fails or hangs.
- :mod:`executor.collectives` measures collectives the way nccl-tests does,
  plus the local reduction and copy speeds that calibration needs, and calls
  issued between bursts of compute as a training step issues them.
- :mod:`executor.compute_bench` times generic compute on every rank at once
  for calibration: matmuls, eager ops, elementwise work, AdamW, and the host
  time of point-to-point transfers.
"""
