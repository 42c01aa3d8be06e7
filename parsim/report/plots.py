"""Pictures where people would rather look than read (matplotlib, no display needed)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..units import format_size  # noqa: E402
from .results import CollectiveResult  # noqa: E402


def plot_bandwidth(series: dict[str, list[CollectiveResult]], path: str, title: str) -> None:
    """busbw against message size, one line per series (e.g. simulated, measured)."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, rows in series.items():
        rows = sorted(rows, key=lambda r: r.size_bytes)
        ax.plot([r.size_bytes for r in rows], [r.busbw_Bps / 1e9 for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ticks = sorted({r.size_bytes for rows in series.values() for r in rows})
    step = max(1, len(ticks) // 8)
    ax.set_xticks(ticks[::step], [format_size(s) for s in ticks[::step]], rotation=30)
    ax.set_xlabel("message size")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
