"""Wall time of `parsim search`, tier by tier, and the winners it finds.

For each case: plans enumerated, the fast tier's time (memory and a lower
bound for every plan, then full estimates where a plan could still enter the
top 50 or the Pareto front) and its rate, the event simulation of the best
ten, and the winner as simulated. Then, for each built-in example plan, a
search at the example's own GPUs and global batch: is the winner at least as
fast as the plan written by hand?

Run:  python benchmarks/search_speed.py                  (Llama 3 8B on 8 and 64, 70B on 1,024 H100s)
      python benchmarks/search_speed.py --only 405b      (Llama 3 405B on 16,384 H100s: minutes)
      python benchmarks/search_speed.py --only examples  (the winners against the example plans)
"""

from __future__ import annotations

import argparse
import time

from parsim.hardware.cluster import load_cluster
from parsim.report.table import render_table
from parsim.search.report import describe, figures
from parsim.search.search import SearchRequest, run_search
from parsim.sim.step import predict_step
from parsim.workload.model import load_model
from parsim.workload.plan import DEFAULT_ADAMW, resolve_plan

CASES = {  # name: (model, GPUs, global batch in sequences of 8,192 tokens)
    "8b-8": ("llama3-8b", 8, 128),  # 1M tokens
    "8b-64": ("llama3-8b", 64, 128),
    "70b-1024": ("llama3-70b", 1024, 512),  # 4M tokens, as `parsim search --global-batch 4M-tokens`
    "405b": ("llama3-405b", 16384, 2048),  # 16M tokens, Meta's batch (Dubey et al. 2024)
}
EXAMPLES = ("llama3-8b-fsdp8", "llama3-70b-1024", "llama3-405b-16k")


def search(model: str, gpus: int, batch: int, simulate: int = 10, adamw: str = DEFAULT_ADAMW):
    request = SearchRequest(load_model(model), model, load_cluster("dgx-h100"), (gpus,), batch, simulate=simulate,
                            adamw=adamw)
    started = time.perf_counter()
    result = run_search(request)
    return result, time.perf_counter() - started


def speed(names: list[str]) -> None:
    rows, winners = [], []
    for name in names:
        model, gpus, batch = CASES[name]
        result, wall = search(model, gpus, batch)
        fast = result.seconds["bound"] + result.seconds["estimate"]
        best = result.ranked[0]
        f = figures(result, best)
        rows.append([f"{model} on {gpus:,}", f"{result.plans:,}", f"{result.fits:,}", f"{result.estimated:,}",
                     f"{fast:.1f}", f"{result.plans / fast:,.0f}", f"{result.seconds['simulate']:.1f}",
                     f"{wall:.1f}"])
        d = describe(best)
        winners.append([f"{model} on {gpus:,}", d["plan"], d["schedule"], d["microbatches"], d["sync"],
                        d["recompute"], d["sp"], f"{f['step_s']:.3f}", f"{f['mfu']:.1%}",
                        f"{best.estimate.step_s / best.simulated.step_s - 1:+.1%}"])
        print(f"done {name}", flush=True)
    print(render_table(["search", "plans", "fit", "estimated", "fast s", "plans/s", "simulate 10 s", "total s"],
                       rows, title="parsim search wall time on this machine"))
    print()
    print(render_table(["search", "winner", "schedule", "m x mbs", "sync", "recompute", "sp", "step s (sim)", "MFU",
                        "fast vs sim"], winners, title="winners (event-simulated)"))


def examples() -> None:
    cluster = load_cluster("dgx-h100")
    rows = []
    for name in EXAMPLES:
        plan = resolve_plan(name)
        by_hand = predict_step(plan, cluster)
        result, _ = search(plan.model.name, plan.world, plan.global_batch_size, simulate=5, adamw=plan.adamw)
        best = result.ranked[0]
        rows.append([name, f"{plan.world:,}", f"{plan.global_batch_size:,}", plan.degrees_text(),
                     f"{by_hand.step_s:.3f}", describe(best)["plan"], f"{best.step_s:.3f}",
                     f"{by_hand.step_s / best.step_s:.2f}x"])
        print(f"done {name}", flush=True)
    print(render_table(["example plan", "GPUs", "batch", "by hand", "step s", "search's winner", "step s",
                        "speed-up"], rows, title="the search against the example plans (same GPUs, same batch; "
                                                 "both event-simulated)"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("targets", "405b", "examples"), default="targets")
    args = parser.parse_args()
    if args.only == "examples":
        examples()
    else:
        speed(["405b"] if args.only == "405b" else ["8b-8", "8b-64", "70b-1024"])
