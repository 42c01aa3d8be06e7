"""The generic pipeline ``parsim calibrate`` runs with a core per rank and with two ranks on each core, and the
``compute.shared_cores.comm_stretch`` fitted to it.

Two ranks computing on one core take 2.1x as long as with a core each, a small model's passes as the host-speed
probes (``benchmarks/cpu_pass_stretch.py``); that is the stretch the step simulator gives ranks that share a
core. Yet in a pipeline whose ranks share cores, the steps take longer than the simulated turns on those cores
say: on the 2-core VM (2026-11-29) tiny DP x PP came out 7-17% short (the median of each of three sets' runs) and
course PP on 4 ranks 13-14% short (two runs), where their 2-rank plans came within 4-7%; so did this generic
pipeline, 8.6% short. What the probes leave out is the ranks' communication: gloo's threads wake on the core to
move each message and take it from the rank computing there, and each switch starts in caches the other emptied.

So calibrate measures it on a pipeline that is none of the plans `parsim compare` is held against: two stages of
a generic GeLU MLP (:data:`GENERIC_MODEL`, the layers of the calibration's other pipeline loop), 1F1B, run by
the executor on 2 ranks with a core each, then as two replicas on 4 ranks bound to 2 cores. ``comm_stretch`` is
the factor on the shared-core stretches that makes the simulated 4-rank step as many times the 2-rank one as
measured: a ratio, so the model's error on the 2-rank step and the host's speed cancel. The ratio is the median
over rounds of each round's (:class:`GenericSteps`): the shared step moves from run to run with the turns the
scheduler deals, and the host's speed from round to round.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Callable

from ..errors import ParsimError
from ..hardware.cluster import ClusterSpec
from ..workload.plan import Plan, load_plan

# The calibration's pipeline stages (executor.compute_bench.PIPELINE_STAGE_MLP): GeLU layers of 768, 64 rows.
GENERIC_MODEL = {"name": "generic-gelu-mlp", "kind": "mlp", "num_layers": 4, "width": 768,
                 "description": "calibrate's generic pipeline: 4 GeLU layers of 768, 2 a stage"}
MICROBATCHES, ROWS = 4, 64
COMM_STRETCH_RANGE = (1.0, 3.0)
BISECTIONS = 12  # the range to within 0.001


def generic_pipeline(dp: int) -> Plan:
    """The generic MLP as a 2-stage 1F1B pipeline, ``dp`` replicas of it (2 x dp ranks)."""
    model = {**GENERIC_MODEL, "batch_size": dp * MICROBATCHES * ROWS}
    return load_plan({"name": f"generic-pipeline-dp{dp}", "model": model, "parallel": {"pp": 2, "dp": dp},
                      "batch": {"num_microbatches": MICROBATCHES}, "schedule": "1f1b", "dtype": "fp32"})


@dataclass(frozen=True)
class GenericSteps:
    """The generic pipeline as measured (``executor.compute_bench.measure_generic_pipeline``): each round's median
    step with a core per rank, then with two ranks on each core, in seconds."""

    rounds: tuple[tuple[float, float], ...]

    def __post_init__(self):
        if not self.rounds or any(alone <= 0 or shared <= 0 for alone, shared in self.rounds):
            raise ParsimError(f"the generic pipeline's steps must be positive, got {self.rounds}")

    @property
    def ratios(self) -> list[float]:
        """Each round's step with two ranks on each core over its step with a core each."""
        return [shared / alone for alone, shared in self.rounds]

    @property
    def ratio(self) -> float:
        """The rounds' median ratio: what the comm stretch is fitted to."""
        return statistics.median(self.ratios)

    @property
    def core_each_s(self) -> float:
        return statistics.median(alone for alone, _ in self.rounds)

    @property
    def two_per_core_s(self) -> float:
        return statistics.median(shared for _, shared in self.rounds)

    def text(self) -> str:
        """The steps and ratios, for calibrate's output and the file's header."""
        low, high = min(self.ratios), max(self.ratios)
        spread = (f"ratios {low:.2f}-{high:.2f} over {len(self.rounds)} rounds, median {self.ratio:.2f}"
                  if len(self.rounds) > 1 else f"ratio {self.ratio:.2f}")
        return (f"{self.core_each_s * 1e3:.1f} ms a step with a core per rank, {self.two_per_core_s * 1e3:.1f} ms as "
                f"two replicas on 2 cores ({spread})")


def fit_comm_stretch(cluster: ClusterSpec, measured_ratio: float,
                     predict: Callable[[Plan, ClusterSpec], float] | None = None) -> float:
    """The ``comm_stretch`` under which the generic pipeline's simulated step on 4 ranks, two on each of 2 cores,
    is ``measured_ratio`` times its step on 2 ranks with a core each (:attr:`GenericSteps.ratio`).

    The simulated ratio grows with the factor (by steps: it reorders the turns on a core), so bisection finds
    where it crosses the measured one, within :data:`COMM_STRETCH_RANGE` (its bounds where it never does).
    ``predict`` (plan, cluster) -> step seconds: the step simulator's, by default."""
    if cluster.shared_cores is None:
        raise ParsimError("the comm stretch is fitted on a cluster whose shared_cores were measured")
    if measured_ratio <= 0:
        raise ParsimError(f"the generic pipeline's step ratio must be positive, got {measured_ratio}")
    predict = predict or _predicted_step_s
    on_two_cores = replace(cluster, cpu_cores=2)
    alone, shared = generic_pipeline(1), generic_pipeline(2)
    alone_step = predict(alone, on_two_cores)

    def ratio(factor: float) -> float:
        spec = replace(on_two_cores, shared_cores=replace(cluster.shared_cores, comm_stretch=factor))
        return predict(shared, spec) / alone_step

    low, high = COMM_STRETCH_RANGE
    if ratio(low) >= measured_ratio:
        return low
    if ratio(high) <= measured_ratio:
        return high
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        low, high = (middle, high) if ratio(middle) < measured_ratio else (low, middle)
    return (low + high) / 2


def _predicted_step_s(plan: Plan, cluster: ClusterSpec) -> float:
    from ..sim.step import predict_step

    return predict_step(plan, cluster).step_s
