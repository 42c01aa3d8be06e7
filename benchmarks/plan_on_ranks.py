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
    from parsim.plan import resolve_plan

    degrees = {k: v for k, v in (("tp", args.tp), ("dp", args.dp)) if v is not None}
    try:
        plan = resolve_plan(args.plan, overrides={"parallel": degrees} if degrees else None)
        results = launch(rank_main, plan.world, (plan.to_dict(), args.steps, 2, 0), "gloo", 300.0)
    except ParsimError as error:  # a bad plan, or a rank that failed: one line, as the CLI says it
        parser.exit(2, f"{parser.prog}: {error}\n")
    return plan, args.steps, results
