"""Simulator wall time for one training step, small to frontier scale.

Prints, per plan, the GPU count, the predicted step time and MFU, how many ops
the representative programs hold, and the wall time to lower and simulate.
Run:  python benchmarks/step_scale.py
"""

from __future__ import annotations

import time

from parsim.cluster import load_cluster
from parsim.lower import lower
from parsim.plan import resolve_plan
from parsim.step import predict_step
from parsim.table import render_table
from parsim.units import format_time

PLANS = [
    ("course-ddp", {}),
    ("course-pp", {}),
    ("llama3-70b-1024", {"parallel": {"dp": 1}}),  # 64 GPUs
    ("llama3-70b-1024", {}),  # TP 8, PP 8, DP 16: 1,024 GPUs, 1F1B
    ("llama3-70b-1024", {"parallel": {"dp": 128}, "batch": {"num_microbatches": 16}}),  # 8,192 GPUs
]


def main() -> None:
    cluster = load_cluster("dgx-h100")
    rows = []
    for name, overrides in PLANS:
        plan = resolve_plan(name, overrides=overrides or None)
        ops = len(lower(plan).ops)
        start = time.perf_counter()
        prediction = predict_step(plan, cluster)
        wall = time.perf_counter() - start
        rows.append([name, plan.world, f"tp{plan.tp} pp{plan.pp} dp{plan.dp}", plan.schedule,
                     format_time(prediction.step_s), f"{prediction.mfu:.1%}", ops, f"{wall:.2f}"])
    print(render_table(["plan", "GPUs", "layout", "schedule", "step", "MFU", "ops simulated", "wall s"], rows,
                       title="one training step on dgx-h100: simulator wall time"))


if __name__ == "__main__":
    main()
