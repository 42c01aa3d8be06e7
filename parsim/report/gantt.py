"""Gantt charts of pipeline traces: one row per rank, passes as coloured boxes, bubbles hatched.

Works on any :class:`~parsim.report.trace.Trace`, simulated or measured: compute
events named ``F stage=1 mb=3`` (see :func:`parsim.report.trace.compute_name`) are
coloured by pass (F, B, I, W) and labelled with their
microbatch when the box is wide enough; when a rank owns several stages, its
later stages are drawn lighter. Idle time on a compute row, from the start of
the step to its end, is drawn hatched and called "bubble". Events on other
streams (``p2p`` sends, ``comm`` collectives) get a thinner row under their
rank's compute row.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from .trace import Event, Trace  # noqa: E402

COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8172B2", "R": "#C44E52"}
LABELS = {"F": "F forward", "B": "B backward", "I": "I backward (input)", "W": "W backward (weights)",
          "R": "R recompute (a forward rerun for its backward)"}
OTHER_COLOR = "#CCB974"  # the rest of a rank's compute: the optimizer step, the gradients' norm
COMM_COLOR = "#8C8C8C"
BUBBLE_STYLE = {"facecolor": "white", "edgecolor": "#BBBBBB", "hatch": "///", "linewidth": 0.0}
_COMPUTE = re.compile(r"^(F|B|I|W|R) stage=(\d+) mb=(\d+)$")
_FONT_PT = 7


def draw_gantt(trace: Trace, path: str, title: str = "") -> None:
    """Draw ``trace`` as a Gantt chart and save it to ``path`` (any format matplotlib writes, e.g. PNG)."""
    compute: dict[int, list[Event]] = defaultdict(list)
    other: dict[tuple[int, str], list[Event]] = defaultdict(list)
    for e in trace.events:
        if e.kind == "recv":
            continue  # waiting for a pipeline neighbour: drawn as the bubble it is
        if e.stream == "compute":
            compute[e.rank].append(e)
        else:
            other[e.rank, e.stream].append(e)
    # Only ranks with events: a simulated frontier-scale step holds one representative per stage.
    ranks = sorted(set(compute) | {r for r, _ in other})
    rows = []  # (label, rank, stream) from top to bottom
    for rank in ranks:
        rows.append((f"rank {rank}", rank, "compute"))
        rows += [(f"  {stream}", rank, stream) for r, stream in sorted(other) if r == rank]
    end = max((e.end_s for e in trace.events), default=1.0) or 1.0
    stages = _stage_order(compute)

    fig, ax = plt.subplots(figsize=(12, 0.9 + 0.42 * len(rows)))
    rough_px_per_time = 0.85 * fig.get_figwidth() * fig.dpi / end  # refined after layout, for labels
    kinds_seen = set()
    labels = []  # (x, y, text, box width)
    for y, (_, rank, stream) in enumerate(rows):
        height = 0.8 if stream == "compute" else 0.4
        if stream != "compute":
            ax.broken_barh([(e.start_s, e.dur_s) for e in other[rank, stream]], (y - height / 2, height),
                           facecolors=COMM_COLOR, linewidth=0)
            continue
        events = sorted(compute[rank], key=lambda e: e.start_s)
        ax.broken_barh(_gaps(events, end), (y - height / 2, height), **BUBBLE_STYLE)
        boxes: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
        for e in events:
            kind, stage, mb = _parse(e)
            kinds_seen.add(kind)
            chunk = stages[rank].index(stage) if stage is not None else 0
            boxes[_shade(COLORS.get(kind, OTHER_COLOR), chunk)].append((e.start_s, e.dur_s))
            if mb is not None:
                labels.append((e.start_s + e.dur_s / 2, y, str(mb), e.dur_s))
        for color, spans in boxes.items():
            narrow = min(d for _, d in spans) * rough_px_per_time < 6  # white separators would hide the colour
            ax.broken_barh(spans, (y - height / 2, height), facecolors=color, edgecolor="white",
                           linewidth=0 if narrow else 0.5)

    ax.set_yticks(range(len(rows)), [label for label, _, _ in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, end)
    ax.set_xlabel(f"time ({trace.meta.get('time_unit', 's')})")
    ax.set_title(title or f"{trace.source} trace", pad=24)
    handles = [Patch(facecolor=COLORS[k], label=LABELS[k]) for k in COLORS if k in kinds_seen]
    if kinds_seen - set(COLORS):
        handles.append(Patch(facecolor=OTHER_COLOR, label="optimizer step, other compute"))
    handles.append(Patch(label="bubble (idle or waiting on the pipeline)", **{**BUBBLE_STYLE, "linewidth": 0.8}))
    if any(len(st) > 1 for st in stages.values()):
        handles.append(Patch(facecolor=_shade(COMM_COLOR, 1), label="lighter: a rank's later stage"))
    if other:
        handles.append(Patch(facecolor=COMM_COLOR, label="communication"))
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(handles), fontsize=8,
              frameon=False)
    fig.tight_layout()
    px_per_time = ax.get_position().width * fig.get_figwidth() * fig.dpi / end
    char_px = 0.62 * _FONT_PT * fig.dpi / 72
    for x, y, text, width in labels:  # only where the number fits inside its box
        if width * px_per_time >= char_px * len(text) + 3:
            ax.text(x, y, text, ha="center", va="center", fontsize=_FONT_PT, color="white")
    fig.savefig(path, dpi=fig.dpi, bbox_inches="tight")
    plt.close(fig)


def ascii_gantt(trace: Trace, max_slots: int = 200) -> str | None:
    """The compute rows of ``trace`` as text, one line per rank, one cell per time slot.

    A pass shows its label (``F3``: forward of microbatch 3; ``4F3`` in
    PyTorch's notation, stage first, when a rank owns several stages) in its
    first slot and ``--`` in the slots it still runs; ``.`` is an idle slot;
    a pass that takes no time is left out.
    The slot is the largest time that divides every start and duration
    (e.g. 1 unit for t_f = 1, t_b = 2). Returns None when the step would need
    more than ``max_slots`` slots (measured traces, odd ratios).
    """
    compute = [e for e in trace.events if e.stream == "compute"]
    if not compute:
        return None
    end = max(e.end_s for e in compute)
    slot = _common_slot([e.start_s for e in compute] + [e.dur_s for e in compute] + [end], end / max_slots)
    if slot is None:
        return None
    per_rank: dict[int, list[Event]] = defaultdict(list)
    for e in compute:
        per_rank[e.rank].append(e)
    multi = any(len(stages) > 1 for stages in _stage_order(per_rank).values())
    parsed = {id(e): _parse(e) for e in compute}
    texts = {id(e): f"{s}{k}{mb}" if multi else f"{k}{mb}" for e in compute for k, s, mb in [parsed[id(e)]]}
    width = max(len(t) for t in texts.values()) + 1
    n = round(end / slot)
    lines = [("time    " + "".join(f"{k * slot:g}".ljust(width * 5) for k in range(0, n, 5))).rstrip()]
    for rank in range(trace.world_size):
        cells = ["."] * n
        for e in per_rank.get(rank, []):
            first, last = round(e.start_s / slot), round(e.end_s / slot)
            if last == first:  # a pass that takes no time (--tw 0) holds no slot
                continue
            cells[first] = texts[id(e)]
            cells[first + 1:last] = ["-" * (width - 1)] * (last - first - 1)
        lines.append(f"rank {rank}: " + "".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(lines)


def _common_slot(times: list[float], smallest: float) -> float | None:
    """The largest slot, no smaller than ``smallest``, that every time is a whole multiple of; else None."""
    tol = 1e-9 * max(times)
    slot = 0.0
    for t in times:
        a, b = max(t, slot), min(t, slot)
        while b > tol:  # Euclid's algorithm, on floats
            a, b = b, math.fmod(a, b)
            b = 0.0 if b > a - tol else b  # a remainder of almost a is a rounding error of 0
        slot = a
    if slot < smallest or any(abs(t / slot - round(t / slot)) > 1e-6 for t in times):
        return None
    return slot


def _gaps(events: list[Event], end: float) -> list[tuple[float, float]]:
    """Idle spans (start, length) of one rank's compute row between 0 and ``end``."""
    gaps, cursor = [], 0.0
    for e in events:
        if e.start_s > cursor + 1e-9 * end:
            gaps.append((cursor, e.start_s - cursor))
        cursor = max(cursor, e.end_s)
    if cursor < end - 1e-9 * end:
        gaps.append((cursor, end - cursor))
    return gaps


def _parse(e: Event) -> tuple[str, int | None, int | None]:
    """(pass kind, stage, microbatch) of a compute event, from its name."""
    match = _COMPUTE.match(e.name)
    if not match:
        return e.name.split(" ", 1)[0], None, None
    kind = match[1]
    return kind, int(match[2]), int(match[3])


def _stage_order(compute: dict[int, list[Event]]) -> dict[int, list[int]]:
    """Per rank, the stages its compute events run, in increasing order (index = local chunk)."""
    return {rank: sorted({s for e in events if (s := _parse(e)[1]) is not None})
            for rank, events in compute.items()}


def _shade(color: str, chunk: int) -> tuple[float, float, float]:
    """Lighter for later local stages, so a rank's stages tell apart."""
    mix = min(0.45 * chunk, 0.7)
    return tuple(c + (1 - c) * mix for c in to_rgb(color))
