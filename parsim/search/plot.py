"""The Pareto front drawn: step time against memory, cost in colour."""

from __future__ import annotations

from matplotlib.ticker import ScalarFormatter

from ..report.plots import plt
from .report import figures
from .search import SearchResult


def plot_front(result: SearchResult, path: str) -> None:
    """Every plan the fast tier estimated in grey, the front joined up, the best simulated plans marked."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    est = result.estimated_plans
    ax.scatter([r.estimate.step_s for r in est], [r.memory_bytes / 1e9 for r in est], s=6, c="0.8",
               label=f"estimated ({len(est):,})")
    front = sorted(result.front, key=lambda r: r.estimate.step_s)
    priced = result.request.price is not None
    colour = [figures(result, r, simulated=False)["usd_per_million_tokens"] for r in front] if priced else "C0"
    points = ax.scatter([r.estimate.step_s for r in front], [r.memory_bytes / 1e9 for r in front], c=colour,
                        cmap="viridis", s=30, zorder=3, label="Pareto front")
    ax.step([r.estimate.step_s for r in front], [r.memory_bytes / 1e9 for r in front], where="post", c="0.4",
            lw=0.8, zorder=2)
    if priced:
        fig.colorbar(points, ax=ax, label="$ per million tokens")
    simulated = [r for r in result.ranked if r.simulated is not None]
    ax.scatter([r.simulated.step_s for r in simulated], [r.memory_bytes / 1e9 for r in simulated], marker="x",
               c="C3", zorder=4, label="event-simulated")
    if simulated:
        best = simulated[0]
        ax.annotate(f"#1 {best.candidate.label()}", (best.simulated.step_s, best.memory_bytes / 1e9),
                    textcoords="offset points", xytext=(8, 8), fontsize=8)
    ax.axhline(result.request.capacity / 1e9, c="C1", ls="--", lw=0.8, label="memory per GPU")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xlabel("step time (s)")
    ax.set_ylabel("peak memory per GPU (GB)")
    req = result.request
    ax.set_title(f"{req.model.name} on {', '.join(f'{g:,}' for g in req.gpus)} GPUs of {req.cluster.name}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
