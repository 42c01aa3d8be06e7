"""Pipeline-parallel schedules: per-rank action lists, their checks, and their ideal timing.

Generated once in pure Python, shared by the simulator (which times them) and
the executor (which runs them, or runs the ``torch.distributed.pipelining``
class of the same name: the orders are identical).

>>> s = make_schedule("1f1b", pp=4, num_microbatches=8)
>>> print(s.format().splitlines()[0])
rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7
>>> round(simulate_ideal(s, t_f=1, t_b=2).bubble_fraction, 4)  # (p-1)/(m+p-1) = 3/11
0.2727
"""

from .checks import ScheduleError, dependencies, execution_order, in_flight_by_stage, peak_in_flight, validate
from .core import KIND_NAMES, KINDS, Action, Schedule
from .formulas import ClosedForm, closed_form
from .generators import (PAIRED_SCHEDULES, SCHEDULES, ScheduleKind, combined_1f1b, combined_interleaved_1f1b, gpipe,
                         interleaved_1f1b, make_schedule, one_f_one_b, paired_schedule, round_size, splits_into_rounds,
                         uneven_rounds, zbv, zero_bubble)
from .timing import IdealTiming, Interval, simulate_ideal

__all__ = [
    "Action", "Schedule", "KINDS", "KIND_NAMES", "SCHEDULES", "ScheduleKind", "ScheduleError",
    "make_schedule", "combined_1f1b", "combined_interleaved_1f1b", "PAIRED_SCHEDULES", "paired_schedule", "round_size",
    "splits_into_rounds", "uneven_rounds",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble", "zbv",
    "dependencies", "execution_order", "validate", "peak_in_flight", "in_flight_by_stage",
    "simulate_ideal", "IdealTiming", "Interval", "closed_form", "ClosedForm",
]
