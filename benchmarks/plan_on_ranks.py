"""Shared by the CPU-run benchmarks: a plan from the command line, run on gloo ranks as ``parsim run`` does."""

from __future__ import annotations

import argparse
from typing import Any


def run_from_command_line(doc: str, example: str, default_steps: int) -> tuple[Any, int, list[dict]]:
    """Parse ``PLAN [--tp N] [--dp N] [--steps N]`` (``doc`` is the help text, ``example`` a plan name for
    it), run the plan on gloo ranks after 2 warm-up steps, and return the plan, the measured steps and
    every rank's result (:func:`executor.train.runner.rank_main`: its events of each step)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plan", help=f"a plan name or YAML file ({example}, tiny-pp2, ...)")
    parser.add_argument("--tp", type=int, help="tensor-parallel degree override")
    parser.add_argument("--dp", type=int, help="data-parallel degree override")
    parser.add_argument("--steps", type=int, default=default_steps, help=f"measured steps (default {default_steps})")
    args = parser.parse_args()

    from executor.launch import launch
    from executor.train.runner import rank_main
    from parsim.errors import ParsimError
    from parsim.workload.plan import resolve_plan

    degrees = {k: v for k, v in (("tp", args.tp), ("dp", args.dp)) if v is not None}
    try:
        plan = resolve_plan(args.plan, overrides={"parallel": degrees} if degrees else None)
        results = launch(rank_main, plan.world, (plan.to_dict(), args.steps, 2, 0), "gloo", 300.0)
    except ParsimError as error:  # a bad plan, or a rank that failed: one line, as the CLI says it
        parser.exit(2, f"{parser.prog}: {error}\n")
    return plan, args.steps, results


def gaps_before_actions(events: list) -> list[tuple[str, float]]:
    """One rank's gaps before its actions in one step, as ``(kind, seconds)``: from the step's start or an
    action's end (a pass, a receive, a collective, the optimizer step) to the next action, the kind named by
    what is on either side (``compute->recv``) and the sends issued in between (``compute->recv +1 send``)."""
    sends = [e.start_s for e in events if e.kind == "send"]
    gaps, reach, before = [], 0.0, "start"
    for e in sorted((e for e in events if e.kind != "send"), key=lambda e: e.start_s):
        if e.start_s > reach + 1e-9:
            issued = sum(1 for s in sends if reach - 1e-9 <= s <= e.start_s)
            gaps.append((f"{before}->{e.kind}{f' +{issued} send' if issued else ''}", e.start_s - reach))
        if e.end_s > reach:
            reach, before = e.end_s, e.kind
    return gaps
