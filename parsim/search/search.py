"""Search: every plan of a model on some GPUs, ranked by the fast tier, the best ones simulated.

:func:`run_search` enumerates the space (:mod:`parsim.search.space`) for
each GPU count, prices every plan's memory and a lower bound of its step time
(:meth:`~parsim.search.fast.FastModel.prepare`), and then estimates plans
best bound first (:meth:`~parsim.search.fast.FastModel.estimate`) until no
plan left could enter the ranking's top ``keep`` or the Pareto front of time,
memory and cost (over plans at most :data:`FRONT_SPAN` times slower and
costlier than the best: a front that runs to steps a hundred times longer helps
nobody): a plan whose bound is slower than the ``keep``-th estimate, and whose
bound is dominated on all three by an estimated plan or beyond the span,
cannot (its estimate is never below its bound). The best ``simulate`` plans are then run
through the event simulation (:func:`~parsim.sim.step.predict_step`).
"""

from __future__ import annotations

import gc
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import ParsimError
from ..hardware.cluster import ClusterSpec
from ..sim.pool import simulate_each
from ..sim.step import StepPrediction, predict_step
from ..workload.model import Model
from ..workload.plan import DEFAULT_ADAMW, default_reduce_dtype, expert_load_problem
from .fast import Estimate, FastModel, Prepared
from .pareto import front_indices, pareto_front
from .space import Candidate, Rejections, SearchSpace, enumerate_settings

SORTS = ("time", "cost", "mfu", "memory")
CHUNK = 256  # plans estimated per round: big enough to batch pipelines, small enough to bound early
FRONT_SPAN = 1.5  # the Pareto front covers plans up to this many times slower (or costlier) than the best


@dataclass(frozen=True)
class SearchRequest:
    """What to search: a model, a cluster, GPU counts, a global batch (samples) and how to rank."""

    model: Model
    model_spec: object  # how plan files name the model (a preset name or path; a mapping inline)
    cluster: ClusterSpec
    gpus: tuple[int, ...]
    global_batch: int
    dtype: str = "bf16"
    max_memory_bytes: float | None = None  # default: the GPU's memory
    price_per_gpu_hour: float | None = None  # default: the cluster file's
    train_tokens: float | None = None
    sort: str = "time"
    keep: int = 50  # plans ranked exactly by the fast tier
    simulate: int = 10  # of them, the best run through the event simulation
    degrees: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (dim, allowed values): search only those
    adamw: str = DEFAULT_ADAMW  # AdamW's implementation in every plan
    reduce_dtype: str | None = None  # the gradients' dtype in every plan (None: the dtype's default)
    grad_clip: float | None = None  # every plan clips its gradients to this global norm (None: no clipping)
    dispatcher: str = "alltoall"  # how every plan with expert parallelism sends tokens to their experts
    dispatch_fp8: bool = False  # every plan with expert parallelism sends tokens to their experts in fp8
    expert_load: float = 1.0  # MoE: the busiest expert's tokens over the mean, in every plan

    @property
    def gradient_dtype(self) -> str:
        """The dtype every plan keeps and reduces gradients in."""
        return self.reduce_dtype or default_reduce_dtype(self.dtype)

    @property
    def price(self) -> float | None:
        return self.price_per_gpu_hour or self.cluster.price_per_gpu_hour

    @property
    def capacity(self) -> float:
        return self.max_memory_bytes or self.cluster.gpu.hbm_capacity_bytes


@dataclass
class Ranked:
    """One plan with its fast estimate and, for the best, its event simulation."""

    candidate: Candidate
    gpus: int
    space: SearchSpace
    estimate: Estimate
    fast_rank: int = 0
    simulated: StepPrediction | None = None

    @property
    def step_s(self) -> float:
        """The simulated step where there is one, else the fast tier's."""
        return self.simulated.step_s if self.simulated is not None else self.estimate.step_s

    @property
    def memory_bytes(self) -> float:
        return self.estimate.memory_bytes


@dataclass
class SpaceCounts:
    """What one GPU count's space held: plans, rejections by reason, memory verdicts."""

    gpus: int
    plans: int = 0
    settings: int = 0
    rejections: Rejections = field(default_factory=Rejections)
    over_memory: dict[str, int] = field(default_factory=dict)
    fits: int = 0


@dataclass
class SearchResult:
    request: SearchRequest
    spaces: list[SpaceCounts]
    ranked: list[Ranked]  # the top ``keep`` by the sort, best first (simulated ones by their simulation)
    front: list[Ranked]  # Pareto front of time, memory and cost among estimated plans
    estimated_plans: list[Ranked]  # every plan the fast tier estimated in full
    estimated: int  # plans estimated in full by the fast tier
    bounded: int  # plans that fit but were left at their bound (provably outside the top and the front)
    seconds: dict[str, float]  # wall time by stage: enumerate+bound, estimate, simulate

    @property
    def plans(self) -> int:
        return sum(s.plans for s in self.spaces)

    @property
    def fits(self) -> int:
        return sum(s.fits for s in self.spaces)


def run_search(request: SearchRequest, progress: Callable[[str, float], None] | None = None) -> SearchResult:
    """Search every GPU count of ``request``; ``progress(stage, fraction done)`` now and then."""
    if request.grad_clip is not None and not 0 < request.grad_clip < math.inf:
        raise ParsimError(f"--grad-clip {request.grad_clip:g}: give a positive gradient norm, such as 1.0")
    if request.sort not in SORTS:
        raise ParsimError(f"--sort {request.sort!r} is not one of {', '.join(SORTS)}")
    if request.dispatcher != "alltoall" and not getattr(request.model, "is_moe", False):
        raise ParsimError(f"--dispatcher {request.dispatcher}: {request.model.name} is a dense model, with no "
                          f"expert all-to-alls to dispatch")
    if request.dispatch_fp8 and not getattr(request.model, "is_moe", False):
        raise ParsimError(f"--dispatch-fp8: {request.model.name} is a dense model, with no tokens to send to experts")
    if request.expert_load != 1 and not getattr(request.model, "is_moe", False):
        raise ParsimError(f"--expert-load: {request.model.name} is a dense model, with no experts to route to")
    if getattr(request.model, "is_moe", False) and (why := expert_load_problem(request.model, request.expert_load)):
        raise ParsimError(f"--expert-load {why}")
    if request.dispatch_fp8 and request.dtype != "fp8":
        raise ParsimError(f"--dispatch-fp8 sends the tokens fp8 GEMMs read in fp8, as DeepSeek-V3 does: give "
                          f"--dtype fp8 (not {request.dtype})")
    if request.sort == "cost" and request.price is None:
        raise ParsimError(f"sorting by cost needs a price: {request.cluster.name} has no price_usd_per_gpu_hour; "
                          f"give --price-per-gpu-hour")
    with _few_full_collections():
        return _run_search(request, progress or (lambda stage, done: None))


@contextmanager
def _few_full_collections():
    """The search's caches only grow, and Python's collector walks every live object in each full collection
    (one per ten of the middle generation's, by default): 20 walks of the growing heap in the 70B search on 1,024
    GPUs, 12% of its time (4.0 s of 37.8; its peak memory the same without them). Young cycles are still
    collected; a full collection waits for the search's end."""
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], 1000)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def _run_search(request: SearchRequest, report: Callable[[str, float], None]) -> SearchResult:
    started = time.perf_counter()
    spaces, models, prepared = [], [], []
    for gpus in request.gpus:
        space = SearchSpace(request.model, gpus, request.global_batch, request.dtype,
                            request.cluster.gpus_per_node, model_spec=request.model_spec, degrees=request.degrees,
                            tp_overlap=request.cluster.overlaps_tp_comm, adamw=request.adamw,
                            reduce_dtype=request.reduce_dtype, grad_clip=request.grad_clip,
                            dispatcher=request.dispatcher, dispatch_fp8=request.dispatch_fp8,
                            expert_load=request.expert_load)
        fast = FastModel(space, request.cluster, request.capacity)
        counts = SpaceCounts(gpus)
        settings = list(enumerate_settings(space, counts.rejections))
        for k, (setting, variants) in enumerate(settings):
            prep = fast.prepare(setting, variants)
            _count_memory(counts, prep, fast.capacity)
            prepared.append((len(models), prep))
            if k % 256 == 0:
                report(f"bounding {gpus:,} GPUs", k / max(len(settings), 1))
        counts.settings = len(settings)
        spaces.append(counts)
        models.append((space, fast))
    bounded_at = time.perf_counter()
    evaluated = _branch_and_bound(request, models, prepared, report)
    estimated_at = time.perf_counter()
    # (plans as fast as each other: the one holding less memory first, whichever the search reached first)
    ranked = sorted(evaluated, key=lambda r: (_metric(request, r, simulated=False), r.memory_bytes))
    for k, r in enumerate(ranked):
        r.fast_rank = k + 1
    top = ranked[:request.keep]
    front = pareto_front(evaluated, lambda r: _objectives(request, r, simulated=False))
    if front:
        fastest, cheapest = min(_objectives(request, r, False)[0] for r in front), \
            min(_objectives(request, r, False)[2] for r in front)
        front = [r for r in front if _objectives(request, r, False)[0] <= FRONT_SPAN * fastest
                 and _objectives(request, r, False)[2] <= FRONT_SPAN * cheapest]
    _simulate(request, top[:request.simulate], report)
    # The simulated plans first, by their simulation (the answer, checked event by event); then the rest.
    top.sort(key=lambda r: (r.simulated is None, _metric(request, r, simulated=True), r.memory_bytes))
    fits = sum(s.fits for s in spaces)
    return SearchResult(request, spaces, top, front, evaluated, len(evaluated), fits - len(evaluated), {
        "bound": bounded_at - started, "estimate": estimated_at - bounded_at,
        "simulate": time.perf_counter() - estimated_at})


def _simulate(request: SearchRequest, rows: list[Ranked], report) -> None:
    """Event-simulate ``rows``, on as many processes as the machine has cores (each plan alone is serial)."""
    plans = [r.candidate.plan(r.space, f"rank{k + 1}") for k, r in enumerate(rows)]
    report(f"simulating 0/{len(rows)}", 0.0)
    simulated = simulate_each(predict_step, plans, request.cluster,
                              lambda k, n: report(f"simulated {k}/{n}", k / n))
    for r, prediction in zip(rows, simulated):
        r.simulated = prediction


def _count_memory(counts: SpaceCounts, prep: Prepared, capacity: float) -> None:
    counts.plans += len(prep.variants)
    over = prep.memory > capacity
    counts.fits += int((~over).sum())
    state = int((prep.state > capacity).sum())
    for reason, n in (("weights, gradients and optimizer state alone", state),
                      ("with the activations of the microbatches in flight", int(over.sum()) - state)):
        if n:
            counts.over_memory[reason] = counts.over_memory.get(reason, 0) + n


def _weights(request: SearchRequest, gpus: int) -> tuple[float, float]:
    """(time, cost) per second of step: time to train is proportional to the step (the batch is the same
    for every GPU count), cost to the step times the GPUs."""
    return 1.0, gpus * (request.price or 1.0) / 3600


def _objectives(request: SearchRequest, r: Ranked, simulated: bool) -> tuple[float, float, float]:
    step = r.step_s if simulated else r.estimate.step_s
    time_w, cost_w = _weights(request, r.gpus)
    return step * time_w, r.memory_bytes, step * cost_w


def _metric(request: SearchRequest, r: Ranked, simulated: bool) -> float:
    """Smaller is better: step time, cost (step x GPUs), MFU (its inverse is proportional to step x GPUs),
    or memory (then step time)."""
    t, memory, cost = _objectives(request, r, simulated)
    return {"time": t, "cost": cost, "mfu": cost, "memory": memory + t * 1e-9}[request.sort]


def _branch_and_bound(request: SearchRequest, models, prepared, report) -> list[Ranked]:
    """Estimate plans best bound first until none left can enter the top ``keep`` or the front."""
    index, memory, gpus = [], [], []
    for m, (model, prep) in enumerate(prepared):
        fits = np.flatnonzero(np.isfinite(prep.bound))
        index += [(m, int(i)) for i in fits]
        memory.append(prep.memory[fits])
        gpus.append(np.full(len(fits), models[model][0].gpus))
    if not index:
        return []
    memory, gpus = np.concatenate(memory), np.concatenate(gpus)
    bound = np.concatenate([prep.bound[np.isfinite(prep.bound)] for _, prep in prepared])
    cost_w = gpus * (request.price or 1.0) / 3600
    lower = np.stack([bound, memory, bound * cost_w], axis=1)  # the bounds of the three objectives
    key = {"time": bound, "cost": bound * cost_w, "mfu": bound * cost_w, "memory": memory + bound * 1e-9}[request.sort]
    pending = np.ones(len(index), dtype=bool)
    evaluated: list[Ranked] = []
    metrics: list[float] = []
    front = np.empty((0, 3))
    while pending.any():
        threshold = np.partition(metrics, request.keep - 1)[request.keep - 1] if len(metrics) >= request.keep \
            else np.inf
        best = front.min(axis=0) if len(front) else np.zeros(3)
        in_span = (lower[:, 0] <= FRONT_SPAN * best[0]) & (lower[:, 2] <= FRONT_SPAN * best[2]) if len(front) \
            else np.ones(len(lower), dtype=bool)
        alive = pending & ((key < threshold) | in_span)
        undecided = np.flatnonzero(alive & (key >= threshold))  # (only these need the front's dominance)
        alive[undecided[_dominated(lower[undecided], front)]] = False
        pending &= alive
        if not alive.any():
            break
        chosen = np.flatnonzero(alive)
        if len(chosen) > CHUNK:
            chosen = chosen[np.argpartition(key[chosen], CHUNK - 1)[:CHUNK]]
        pending[chosen] = False
        by_model: dict[int, list[tuple[Prepared, int]]] = {}
        for m, i in (index[c] for c in chosen):
            by_model.setdefault(prepared[m][0], []).append((prepared[m][1], i))
        for model, model_jobs in by_model.items():
            space, fast = models[model]
            for (prep, i), estimate in zip(model_jobs, fast.estimate(model_jobs)):
                r = Ranked(Candidate(prep.setting, prep.variants[i]), space.gpus, space, estimate)
                evaluated.append(r)
                metrics.append(_metric(request, r, False))
                front = np.vstack([front, _objectives(request, r, False)])
        front = front[front_indices(front)]
        report("estimating", 1 - pending.sum() / len(pending))
    return evaluated


def _dominated(points: np.ndarray, front: np.ndarray) -> np.ndarray:
    """Per row of ``points``, whether some row of ``front`` is no worse on every objective."""
    out = np.zeros(len(points), dtype=bool)
    for f in front:
        out |= (f <= points).all(axis=1)
    return out
