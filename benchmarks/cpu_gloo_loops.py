"""The CPU loop's plans run under each policy for gloo's device-loop threads (``executor/gloo_threads.py``).

A collective's device loop that wakes may preempt its own rank's worker while the worker holds the
socket's lock, and then spins on the core until the scheduler's next tick; a pipeline's loop must
preempt the rank's compute to send the data its receiver asks for. ``PARSIM_GLOO_LOOPS`` picks:
``split`` (the executor's default: collectives' loops batched, the pipeline transfers' preempting),
``preempt`` (every loop as gloo starts it) or ``batch`` (every loop batched). For each plan and policy,
``parsim run`` measures 30 steps; printed are the step (median) and, per phase, the ranks' median seconds.

On the 2-core VM (2026-11-30, one run each), step split / preempt / batch: course DDP 41.2 / 49.5 / 41.1
ms (its ``dp`` phase 8.2 / 16.3 / 8.1), course TP 29.7 / 39.6 / 32.1 (``tp`` 3.3 / 14.3 / 4.4), course PP
43.4 / 42.8 / 48.3, tiny PP 22.4 / 23.3 / 32.6 (``pp`` 3.9 / 3.8 / 12.5), tiny DP x PP 52.0 / 45.9 / 52.3 (two
more runs of split / preempt: 45.6 / 47.4 and 53.6 / 56.2: the plan's steps vary by 10% from run to run).

Run:  python benchmarks/cpu_gloo_loops.py [--plans "course TP" "tiny PP"] [--policies split preempt]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from cpu_compare_loop import PLANS

from executor.gloo_threads import POLICIES, POLICY_ENV

PHASES = ("forward", "backward", "tp", "pp", "dp", "optimizer", "idle")


def run(plan: list[str], ranks: int, policy: str, steps: int) -> dict:
    """``parsim run --json`` of ``plan`` under ``policy`` (exits with its error's last line if it fails)."""
    env = {**os.environ, POLICY_ENV: policy}
    done = subprocess.run([sys.executable, "-m", "parsim", "run", *plan, "--nproc", str(ranks), "--steps", str(steps),
                           "--json"], capture_output=True, text=True, env=env)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        sys.exit(f"cpu_gloo_loops.py: parsim run {' '.join(plan)} failed: {last}")
    return json.loads(done.stdout)


def main() -> None:
    labels = [label for label, _, _ in PLANS]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="PLAN: " + ", ".join(labels))
    parser.add_argument("--plans", nargs="+", choices=labels, default=labels, metavar="PLAN",
                        help="which of the loop's plans (default: all)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    if args.steps < 1:
        parser.exit(2, f"{parser.prog}: --steps must be at least 1\n")
    print(f"{'plan':14s} {'policy':8s} {'step ms':>8s} " + " ".join(f"{p:>9s}" for p in PHASES))
    for label, plan, ranks in PLANS:
        if label not in args.plans:
            continue
        for policy in args.policies:
            print(f"{label} under {policy}...", file=sys.stderr, flush=True)
            measured = run(plan, ranks, policy, args.steps)
            phases = [statistics.median(r["seconds"][p] for r in measured["ranks"]) * 1e3 for p in PHASES]
            print(f"{label:14s} {policy:8s} {measured['step_s'] * 1e3:8.1f} " + " ".join(f"{v:9.2f}" for v in phases),
                  flush=True)


if __name__ == "__main__":
    main()
