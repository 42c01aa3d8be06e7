"""Does the fast tier agree with the event simulation? The top 50 plans of three searches, both ways.

For each search the fast tier's 50 best plans are all event-simulated; the
table gives how far the fast step time is from the simulated one (median,
worst, share within 5%) and where the simulated best sits in the fast
ranking. The plans where they disagree most are listed with the phase that
differs most, and the best plan of the published structure (TP inside a
node, PP across nodes, DP for the rest) is placed in the ranking.

Run:  python benchmarks/search_agreement.py          (about 5 minutes here)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from parsim.hardware.cluster import load_cluster
from parsim.report.step_report import PHASES
from parsim.report.table import render_table
from parsim.search.report import _phases, describe
from parsim.search.search import Ranked, SearchRequest, run_search
from parsim.workload.model import load_model

SEARCHES = (("llama3-8b", 8, 128), ("llama3-8b", 64, 128), ("llama3-70b", 1024, 512))
TOP = 50


def main() -> None:
    cluster = load_cluster("dgx-h100")
    summary, worst_rows, structure = [], [], []
    for model, gpus, batch in SEARCHES:
        request = SearchRequest(load_model(model), model, cluster, (gpus,), batch, keep=TOP, simulate=TOP)
        result = run_search(request)
        rows = [r for r in result.ranked if r.simulated is not None]
        errors = np.array([r.estimate.step_s / r.simulated.step_s - 1 for r in rows])
        best = min(rows, key=lambda r: r.simulated.step_s)
        name = f"{model} on {gpus:,} ({batch} x 8,192 tokens)"
        summary.append([name, len(rows), f"{np.median(np.abs(errors)):.2%}", f"{np.abs(errors).max():.2%}",
                        f"{np.mean(np.abs(errors) <= 0.05):.0%}", best.fast_rank,
                        f"{result.seconds['simulate']:.0f}"])
        for r, e in sorted(zip(rows, errors), key=lambda x: -abs(x[1]))[:3]:
            fast, sim = r.estimate.phases, _phases(r)
            phase = max(PHASES, key=lambda p: abs(fast[p] - sim[p]))
            worst_rows.append([name, describe(r)["plan"], r.candidate.schedule_text(), describe(r)["sync"],
                               f"{e:+.2%}", f"{phase} {fast[phase] - sim[phase]:+.3f} s"])
        p = best_published(request)
        if p is not None:
            slower = sum(1 for r in result.estimated_plans if r.estimate.step_s < p.estimate.step_s)
            structure.append([name, describe(p)["plan"], p.candidate.schedule_text(), describe(p)["sync"],
                              f"{p.step_s:.3f}", f">= {slower + 1}", describe(best)["plan"],
                              f"{best.simulated.step_s:.3f}", f"{p.step_s / best.simulated.step_s - 1:+.1%}"])
        print(f"done {name}", flush=True)
    print(render_table(["search", "simulated", "median |fast/sim - 1|", "worst", "within 5%", "sim best's fast rank",
                        "simulate s"], summary, title=f"fast tier vs event simulation over each search's top {TOP}"))
    print()
    print(render_table(["search", "plan", "schedule", "sync", "fast vs sim", "phase differing most (fast - sim)"],
                       worst_rows, title="where they disagree most"))
    print()
    print(render_table(["search", "best TP-in-node, PP-across plan", "schedule", "sync", "its step s (sim)",
                        "its rank", "winner", "winner's step s (sim)", "slower by"], structure,
                       title="the published structure (TP = GPUs per node, PP > 1, DP the rest) against the winner"))


def best_published(request: SearchRequest) -> Ranked | None:
    """The best plan with TP filling a node and PP > 1: the same search restricted to those degrees
    (``--tp 8 --pp 2,4,...``), its five best event-simulated."""
    gpus, per_node = request.gpus[0], request.cluster.gpus_per_node
    pipelines = tuple(p for p in range(2, gpus // per_node + 1) if (gpus // per_node) % p == 0)
    if gpus % per_node or not pipelines:
        return None
    restricted = dataclasses.replace(request, keep=50, simulate=5,
                                     degrees=(("tp", (per_node,)), ("pp", pipelines)))
    ranked = run_search(restricted).ranked
    return ranked[0] if ranked else None


if __name__ == "__main__":
    main()
