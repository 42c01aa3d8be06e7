"""Closed-form bubbles of the textbook schedules, with the numbers substituted.

With free communication and every stage taking ``t_f`` forward and ``t_b``
backward per microbatch, each rank is idle for the same *bubble time* and
busy for ``v m (t_f + t_b)``, so the step takes busy + bubble and the bubble
fraction is bubble / step:

- GPipe (Huang et al. 2019) and 1F1B: bubble ``(p-1)(t_f + t_b)``,
  fraction ``(p-1)/(m+p-1)``, for any ``m``.
- Interleaved 1F1B with ``v`` stages per rank (Narayanan et al. 2021): the
  same ``(p-1)(t_f + t_b)`` with the times of one *virtual* stage, i.e. 1F1B's
  bubble divided by ``v``; fraction ``(p-1)/(v m + p-1)``.
- ZB-H1 (Qi et al. 2023, section 2.1): bubble ``(p-1)(t_f + t_i - t_w)`` where
  ``t_i = t_b - t_w``. The paper derives it for ``t_f = t_i = t_w`` (a third
  of 1F1B's bubble); :func:`~parsim.schedules.simulate_ideal` reproduces it
  exactly whenever ``m >= p`` and ``t_w <= min(t_f, t_i)``, and only then is
  it given here.
- ZB-H2 (Qi et al. 2023, section 2.2): with ``t_i <= min(t_f, t_w)`` and
  ``m >= 2p - 1`` every rank works without a gap from its first forward to its
  last ``W`` (a parallelogram), so one step idles only the slanted ends,
  ``(p-1) t_f`` per rank. The paper's zero bubble is the same schedule with
  optimizer post-validation, which lets consecutive steps' parallelograms
  interlock; a step that synchronizes before the optimizer keeps the ends.

``tests/test_schedules.py`` checks every formula against the simulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from .core import Schedule


@dataclass(frozen=True)
class ClosedForm:
    """A schedule's bubble in closed form: the formulas, and the formulas with numbers."""

    bubble_formula: str
    bubble_substituted: str
    fraction_formula: str
    fraction_substituted: str
    bubble_time: float
    step_time: float
    bubble_fraction: float
    note: str


def closed_form(schedule: Schedule, t_f: float, t_b: float, t_w: float = 0.0) -> ClosedForm | None:
    """The closed-form bubble of ``schedule`` for uniform per-stage times, or None where there is none.

    Times are those of one (virtual) stage, as for
    :func:`~parsim.schedules.simulate_ideal`. There is no closed form here for
    ``zbv``, for the interleaved zero-bubble variant, for ZB-H1 outside
    ``m >= p`` and ``t_w <= min(t_f, t_b - t_w)``, and for ZB-H2 outside
    ``m >= 2p - 1`` and ``t_b - t_w <= min(t_f, t_w)``.
    """
    p, m, v = schedule.pp, schedule.num_microbatches, schedule.virtual_stages
    work = v * m * (t_f + t_b)
    if schedule.name == "interleaved-1f1b" and m < p:
        idle = (v - 1) * (p - m) + p - 1
        bubble = idle * (t_f + t_b)
        ratio = Fraction(idle, v * m + idle)
        return ClosedForm("((v-1)(p-m) + p-1)(t_f + t_b)",
                          f"(({v}-1)({p}-{m}) + {p}-1)({t_f:g} + {t_b:g}) = {bubble:g}",
                          "((v-1)(p-m) + p-1)/(v*m + (v-1)(p-m) + p-1)",
                          f"{idle}/({v}*{m} + {idle}) = {_ratio(ratio)}", bubble, work + bubble, float(ratio),
                          f"with fewer microbatches than ranks a round is all {m} microbatches, so at "
                          f"{f'each of the {v - 1} turns' if v > 2 else 'the turn'} from a rank's stage to its "
                          f"next the first microbatch comes back after {p} passes, {p - m} of them idle")
    if schedule.name in ("gpipe", "1f1b", "interleaved-1f1b"):
        bubble = (p - 1) * (t_f + t_b)
        if v == 1:
            fraction_formula = "(p-1)/(m+p-1)"
            fraction_numbers = f"({p}-1)/({m}+{p}-1)"
        else:
            fraction_formula = "(p-1)/(v*m+p-1)"
            fraction_numbers = f"({p}-1)/({v}*{m}+{p}-1)"
        ratio = Fraction(p - 1, v * m + p - 1)
        note = ("each rank idles while the first microbatch fills the pipe and the last one drains it"
                if v == 1 else
                f"each pass is one virtual stage (1/{v} of a rank's layers), so the fill and drain are "
                f"{v} times shorter than 1F1B's")
        return ClosedForm("(p-1)(t_f + t_b)", f"({p}-1)({t_f:g} + {t_b:g}) = {bubble:g}",
                          fraction_formula, f"{fraction_numbers} = {_ratio(ratio)}",
                          bubble, work + bubble, float(ratio), note)
    if schedule.name == "zero-bubble" and v == 1:
        t_i = t_b - t_w
        if m < p or t_w > min(t_f, t_i):
            return None
        bubble = (p - 1) * (t_f + t_i - t_w)
        step = work + bubble
        fraction = bubble / step
        return ClosedForm("(p-1)(t_f + t_i - t_w)", f"({p}-1)({t_f:g} + {t_i:g} - {t_w:g}) = {bubble:g}",
                          "bubble / (m(t_f + t_b) + bubble)",
                          f"{bubble:g} / ({m}({t_f:g} + {t_b:g}) + {bubble:g}) = {fraction:.4f}",
                          bubble, step, fraction,
                          "the I passes run 1F1B's critical path without the W passes, and each rank's "
                          "deferred W passes fill its cool-down")
    if schedule.name == "zb-h2":
        t_i = t_b - t_w
        if m < 2 * p - 1 or t_i > min(t_f, t_w):
            return None
        bubble = (p - 1) * t_f
        step = work + bubble
        fraction = bubble / step
        return ClosedForm("(p-1) t_f", f"({p}-1) {t_f:g} = {bubble:g}", "bubble / (m(t_f + t_b) + bubble)",
                          f"{bubble:g} / ({m}({t_f:g} + {t_b:g}) + {bubble:g}) = {fraction:.4f}",
                          bubble, step, fraction,
                          "2(p-r)-1 warm-up forwards keep rank r busy until its first I, and its 2r+1 deferred "
                          "W passes fill the cool-down: each rank works without a gap, and only the "
                          "parallelogram's slanted ends idle (optimizer post-validation would hide them)")
    return None


def _ratio(r: Fraction) -> str:
    return f"{r.numerator}/{r.denominator} = {float(r):.4f}" if r.denominator != 1 else f"{float(r):.4f}"
