"""``parsim compare PLAN``: a predicted step next to a measured one, phase by phase."""

from __future__ import annotations

import argparse

from ..cluster import load_cluster
from ..errors import ParsimError
from ..host_load import ForeignLoad
from ..jsondoc import print_json
from ..step import predict_step
from ..step_report import PHASES, breakdown, step_time
from ..table import render_table
from ..units import format_time, time_unit
from .common import note, progress
from .plan_cmd import plan_from_args


def compare_plan_command(args: argparse.Namespace) -> int:
    args.plan = args.target
    plan = plan_from_args(args)
    from executor.train import run_plan

    if plan.world != args.nproc:
        raise ParsimError(f"plan {plan.name} needs {plan.world} ranks ({plan.degrees_text()}), "
                          f"not --nproc {args.nproc}")
    cluster = load_cluster(args.cluster)
    progress(f"simulating {plan.name} on {cluster.name}")
    predicted = predict_step(plan, cluster)
    progress(f"running {plan.name} on {args.nproc} ranks ({args.steps} measured steps)")
    with ForeignLoad() as load:
        measured, _ = run_plan(plan, args.nproc, args.steps, backend=args.backend,
                               **({"timeout_s": args.timeout} if args.timeout is not None else {}))
    if load.warning("the measured run"):
        note(load.warning("the measured run"))
    rows = compare_phases(plan, predicted, measured)
    measured_step = step_time(measured)
    step_error = predicted.step_s / measured_step - 1
    if args.json:
        print_json("compare.plan", {"plan": plan.name, "cluster": cluster.name, "predicted_step_s": predicted.step_s,
                    "measured_step_s": measured_step, "step_error": step_error, "phases": rows,
                    "foreign_load_cores": load.cores})
    else:
        unit, scale = time_unit([r["predicted_s"] for r in rows] + [r["measured_s"] for r in rows])
        table = [[f"rank {r['rank']} (pp {r['pp']})", r["phase"], r["predicted_s"] / scale, r["measured_s"] / scale,
                  _error_text(r)] for r in rows]
        print(render_table(["rank", "phase", f"predicted ({unit})", f"measured ({unit})", "error"], table,
                           title=f"{plan.name}: predicted ({cluster.name}) vs measured, per rank and phase"))
        print(f"step time: predicted {format_time(predicted.step_s)}, measured {format_time(measured_step)} "
              f"({step_error:+.1%})")
    if args.trace:
        from ..chrome import write_chrome_trace

        write_chrome_trace(args.trace, {"predicted": predicted.trace, "measured": measured})
        print(f"wrote {args.trace}: predicted and measured tracks side by side")
    return 0


def compare_phases(plan, predicted, measured) -> list[dict]:
    """Per measured rank and phase: predicted seconds (of the rank's representative) and measured seconds."""
    predicted_by_pp = {plan.coords(b.rank).pp: b for b in predicted.ranks}
    rows = []
    for m in breakdown(measured):
        pp = plan.coords(m.rank).pp
        p = predicted_by_pp[pp]
        for phase in PHASES:
            pred, meas = p.seconds.get(phase, 0.0), m.seconds.get(phase, 0.0)
            if pred or meas:
                rows.append({"rank": m.rank, "pp": pp, "phase": phase, "predicted_s": pred, "measured_s": meas,
                             "error": pred / meas - 1 if meas else None})
    return rows


def _error_text(row: dict) -> str:
    return "-" if row["error"] is None else f"{row['error']:+.0%}"
