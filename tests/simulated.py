"""Many plans event-simulated side by side, a process per core (:func:`parsim.sim.pool.simulate_each`), the fast
tier's estimates held to them, and a searched row's printed command run again: for the tests that hold the
search's fast tier to the simulation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest

from parsim.cli.main import main
from parsim.hardware.cluster import ClusterSpec
from parsim.sim.pool import simulate_each
from parsim.sim.step import predict_step
from parsim.search.fast import FastModel, Prepared
from parsim.search.space import Candidate, SearchSpace, Variant
from parsim.workload.plan import Plan


def step_and_memory(plan: Plan, cluster: ClusterSpec) -> tuple[float, float]:
    """A plan's simulated step and its peak memory per GPU: what the fast tier is compared with."""
    prediction = predict_step(plan, cluster)
    return prediction.step_s, max(m.total for m in prediction.memory)


# 8 layers whose LM head weighs about two of them: plenty of plans fit only with some layers recomputed in a few
# GB, and balancing its pipeline stages moves layers off the head's
EIGHT_LAYERS = {"kind": "transformer", "name": "eight", "num_layers": 8, "hidden": 1024, "num_heads": 16,
                "ffn_hidden": 4096, "seq_len": 4096, "vocab_size": 32000}


def steps_and_memory(plans: list[Plan], cluster: ClusterSpec) -> list[tuple[float, float]]:
    """:func:`step_and_memory` of every plan, in order."""
    return simulate_each(step_and_memory, plans, cluster)


def against_simulation(space: SearchSpace, fast: FastModel, jobs: list[tuple[Prepared, int]],
                       other: Callable[[Variant], Variant]) -> tuple[list[float], ...]:
    """Each job's fast estimate against its simulation, its memory to the byte and its bound below its estimate,
    next to the same setting's variant ``other(v)``: the step's error, that error less the other's, and the step
    and the peak memory over the other's."""
    others = [(p, p.variants.index(other(p.variants[i]))) for p, i in jobs]
    simulated = steps_and_memory([Candidate(p.setting, p.variants[i]).plan(space) for p, i in jobs + others],
                                 fast.cluster)
    errors, added, steps, peaks = [], [], [], []
    for (prep, i), estimate, other_estimate, (step_s, peak), (other_step_s, other_peak) in zip(
            jobs, fast.estimate(jobs), fast.estimate(others), simulated[:len(jobs)], simulated[len(jobs):]):
        assert estimate.memory_bytes == pytest.approx(peak, rel=1e-12)
        assert prep.bound[i] <= estimate.step_s * (1 + 1e-12)
        errors.append(estimate.step_s / step_s - 1)
        added.append(errors[-1] - (other_estimate.step_s / other_step_s - 1))
        steps.append(step_s / other_step_s)
        peaks.append(peak / other_peak)
    return errors, added, steps, peaks


def searched(model: dict, args: list[str], folder: Path, capsys) -> list[dict]:
    """The ranked rows of ``parsim search --json`` over ``model`` (written to ``folder``), best first."""
    path = folder / "model.yaml"
    path.write_text(json.dumps(model))
    assert main(["search", "--model", str(path), *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["ranked"]


def recomputing(rows: list[dict]) -> list[dict]:
    """The searched ``rows`` whose recomputation is more than a name (some layers, or a list of modules)."""
    return [row for row in rows if isinstance(row["plan"]["activation_recompute"], dict)]


def simulated_command(row: dict, capsys) -> dict:
    """``parsim simulate --json`` of the command a searched row prints."""
    assert main(row["command"].split()[1:] + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)
