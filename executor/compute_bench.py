"""Compute microbenchmarks for ``parsim calibrate``, run on every rank at once and in lock-step.

The ranks of a local run share the host's cores, caches and memory bandwidth,
so every figure here is measured the way ranks compute during a step: all of
them run the same benchmark at the same moment (a barrier before each, one
agreed repeat count), with one thread each. Each figure is the **median**
over repeats, so a burst of other work on the host does not stand for the run.

Nothing here runs a plan's model: the benchmarks are generic operations, and
layers of the reference implementation at generic sizes.

* :func:`measure_matmuls`: ``x @ w`` in fp32 by shape, operands *cold* and the
  caches full of written data, as a step's layers find their weights after the
  optimizer or the gradients of a backward (fits peak, shape efficiency and
  the speed at which the weight streams in).
* :func:`measure_cache_hits`: a thin ``x @ w`` cycling over 4 to 256 MiB of
  weights (fits how much of a weight a core's cache still holds by the bytes
  touched since its last read, and how fast it is read from there).
* :func:`measure_dispatch`: eager blocks (the reference implementation's decoder
  layer as Llama and as GPT-2 configure it, a chain of elementwise ops and
  reductions) at sizes where fixed costs dominate; each reports its
  forward and backward time and the ATen ops it dispatches (counted with a
  ``TorchDispatchMode``), and the matmuls it runs (fits the cost per op).
  Like the matmuls, each timed run starts behind caches full of other written
  data: eager dispatch is mostly memory traffic to code and bookkeeping, and a
  step's actions find it evicted by the work before them (a 30-40% effect).
* :func:`measure_elementwise`: products, a residual add and RoPE's rotation on
  a mid-size tensor, forward and backward, their bytes counted (fits the
  speed of memory-bound kernels' bytes).
* :func:`measure_kernel_kinds`: GeLU, a LayerNorm and a softmax, each on its
  own (fits a core's time per element of each one's arithmetic, which on a
  CPU outlasts its bytes: GeLU's erf, softmax's exp).
* :func:`measure_tp_calls`: the executor's all-gather of a layer's output on a
  tiny tensor, right after a layer's matmul (a tensor-parallel call's host time
  beyond its collective, forward and backward).
* :func:`measure_host_optimizer`: ``torch.optim.AdamW`` steps on many small and
  a few large parameter tensors, every rank at once (fits the cost per tensor
  and the memory speed each rank gets when all stream), and the large ones on
  each rank alone (the speed of one rank streaming while the others wait).
* :func:`measure_zero_grad`: ``zero_grad(set_to_none=True)`` after a backward
  over few and many, small and large tensors (fits what freeing a step's
  gradients costs per step, per tensor and by the byte).
* :func:`measure_fsdp_host`: FSDP2's own host work, sharding over every rank
  with the seconds inside its collectives left out: what ``fully_shard`` adds
  per unit to a forward and a backward, and per parameter to an AdamW step
  over its DTensors.
* :func:`measure_step_gaps`: a generic data-parallel step, its actions timed
  by the executor's recorder: the loop's host time between actions, which
  runs cold after passes and collectives that stream megabytes;
  :func:`measure_step_gap_curve` at several sizes of the step.
* :func:`measure_pipeline_loop`: pairs of ranks run the executor's pipeline
  runtime, 1F1B over two stages whose passes are a small generic MLP's:
  the loop's own host time before each action and per send issued, and its
  transfers' times, with the receive posted late or the receiver waiting (each
  as a typical step has it: rare stalls left out, stalls most steps have kept).
* :func:`measure_on_shared_cores`: that again with two ranks on each core, as
  a run with more ranks than cores has them, and the host-speed probes on
  every rank at once there (how much longer compute takes on a shared core).

Between them, :mod:`executor.speed_probe` times the host's speed, which
``parsim compare`` times again before and after its measured steps; the three
eager benchmarks (dispatch, elementwise, kernel kinds: a third of a second
together), the tensor-parallel call's, AdamW's and a few matmuls run there
too, and each of their figures is the median over those samples
(:data:`SAMPLED_BENCHMARKS`); each probe reading beside the work it stands
for, timed right after it (:func:`probe_pairs`), is how far that work
follows the probe.
"""

from __future__ import annotations

import bisect
import math
import os
import statistics
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ._torch import require_torch
from .gloo_threads import collective_group
from .launch import host_memory_bytes
from .speed_probe import Speed, SpeedProbe, probes_on

if TYPE_CHECKING:
    from parsim.workload.plan import Plan

# Shapes (m, n, k) spanning thin to square, including weight-gradient shapes whose inner dimension is a
# (small) token count.
DEFAULT_SHAPES = (
    (32, 64, 64), (128, 128, 128), (32, 1024, 1024), (128, 256, 1024), (128, 1024, 256),
    (256, 512, 512), (512, 512, 512), (128, 1024, 1024), (1024, 1024, 1024), (64, 4096, 1024),
    (1024, 1024, 32), (1024, 1024, 128), (64, 64, 32), (256, 64, 64), (64, 256, 64),
)
COLD_FOOTPRINT_BYTES = 64 << 20  # weights per run of calls: well above a server's last-level cache share
# The cache curve: a thin matmul (bound by reading its 4 MiB weight) cycling over 1 to 64 weights, 4 to 256 MiB
# touched between two reads of one weight (a server's last-level cache share is tens of MiB).
CACHE_SHAPE = (32, 1024, 1024)  # m, n, k
CACHE_WEIGHTS = (1, 2, 4, 8, 16, 32, 64)
CACHE_CYCLES = 3
CACHE_MEMORY_SHARE = 8  # the weights cycled over take at most 1/8 of the host's memory, over all its ranks
RUN_S = 0.03
# AdamW runs: (parameter tensors, elements each): one small tensor gives the fixed cost per step, many the
# fixed cost per tensor, few large ones (each tensor's state, 16 bytes per element, well above a server's
# last-level cache share) the memory speed.
OPTIMIZER_RUNS = ((1, 256), (64, 256), (4, 1 << 20), (2, 1 << 21))
OPTIMIZER_ALONE = (2, 1 << 21)  # the run each rank repeats alone: its memory speed without the others streaming
JITTER_REPEATS = 100  # AdamW steps every rank starts at once, to see how the same work's time varies between ranks
REPEATS = 15


def measure_on_every_rank(nproc: int, timeout_s: float = 600.0) -> list[dict]:
    """Every compute microbenchmark on ``nproc`` ranks at once; one dict per rank."""
    from .launch import launch

    return launch(_rank_compute, nproc, (), "gloo", timeout_s)


def measure_on_shared_cores(timeout_s: float = 300.0, pipeline_steps: int = 60) -> list[dict]:
    """The pipeline's host costs with two ranks on each core (a run with more ranks than cores): the pipeline
    loop's transfers and time between actions (:func:`measure_pipeline_loop`) on 4 ranks bound
    to 2 cores (2 ranks on 1 core on a single-core host), pairs 0-1 and 2-3 crossing the cores as the stages of
    a data- and pipeline-parallel run do (``pipeline_steps`` steps of it). One dict per rank. Waking a thread on
    a core another rank computes on waits for the scheduler, so these grow more than 2x: on the 2-core VM
    (2026-11-27, two runs) a late receive took 1.4-1.9 ms against 0.15-0.20 alone, a send's issue 1.8-2.2 ms
    against 0.39-0.47, a transfer whose receiver waited 0.48-0.90 ms against 0.31-0.41. Then the host-speed
    probes, every rank at once: compute on a shared core takes more than twice as long, each rank's turn
    starting in caches the other emptied (on the 2-core VM a small model's passes 2.25-2.6x, the probes
    2.0-2.2x, 2026-11-27; in alternating windows 2.14-2.16x and 2.06-2.13x, 2026-11-29:
    ``benchmarks/cpu_pass_stretch.py``). Empty where the host cannot bind processes to cores (not Linux)."""
    from .launch import launch

    if not hasattr(os, "sched_setaffinity"):
        return []
    with _on_two_cores() as shared:
        return launch(_rank_shared, 2 * shared, (pipeline_steps,), "gloo", timeout_s)


@contextmanager
def _on_two_cores() -> Iterator[int]:
    """This process (and the ranks it spawns, which bind round robin to the cores they inherit) on the first two
    of its cores meanwhile: yields how many it has there (1 on a single-core host). Linux only."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[:2])
    try:
        yield len(cores[:2])
    finally:
        os.sched_setaffinity(0, cores)


# Two ranks on each core, the generic pipeline's step moves from run to run with the turns the scheduler deals: on
# the 2-core AMD VM (2026-11-30) six rounds in a row gave ratios of 2.05 to 3.10 (each run 20 steps), and the comm
# stretch fitted to two rounds came out 1.29 and 1.09 in two calibrations 15 minutes apart.
GENERIC_PIPELINE_STEPS, GENERIC_PIPELINE_ROUNDS = 20, 5


def measure_generic_pipeline(alone: Plan, shared: Plan, steps: int = GENERIC_PIPELINE_STEPS,
                             rounds: int = GENERIC_PIPELINE_ROUNDS, timeout_s: float = 300.0
                             ) -> list[tuple[float, float]] | None:
    """Each round's median step (``executor.train.run_plan``) of the plan ``alone`` with a core per rank and then of
    ``shared`` with two ranks on each of 2 cores (``parsim.calibrate.shared_pipeline``: a generic pipeline, then two
    replicas of it), ``rounds`` rounds, the two runs of a round seconds apart, so that the host's drift between
    rounds leaves each round's ratio. None where processes cannot be bound to cores (not Linux) or the host gives
    fewer than 2."""
    from .train.measure import run_plan

    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        return None
    pairs = []
    for _ in range(rounds):
        alone_s = run_plan(alone, alone.world, steps, backend="gloo", timeout_s=timeout_s)[1]["step_s"]
        with _on_two_cores():
            shared_s = run_plan(shared, shared.world, steps, backend="gloo", timeout_s=timeout_s)[1]["step_s"]
        pairs.append((alone_s, shared_s))
    return pairs


SHARED_PROBE_ROUNDS = 5


def _rank_shared(rank: int, world: int, pipeline_steps: int) -> dict:
    """The pipeline loop, the generic step's gaps between actions (:func:`measure_step_gaps`), then the
    host-speed probes in :data:`SHARED_PROBE_ROUNDS` rounds, each on every rank at once (two ranks computing on
    each core) and then on one rank per core (``world // 2`` ranks, one on each core, the others waiting):
    ``speed_probe`` and ``speed_probe_alone`` (None on a rank that waits), each the probes' medians over the
    rounds (:class:`~executor.speed_probe.Speed`). Each probe's throughput is over 0.15 s, so the ranks' turns on the
    core and each turn's cold start are in it.

    Pairing the two in each round keeps their ratio while the host's speed drifts. Taken instead against the
    compute benchmarks' probes a minute earlier, with each rank building its probe (64 MiB of weights) after
    the barrier (the ranks began up to a build apart and probed partly alone), the eager stretch had come out
    1.70-2.56 over six calibrations on the 2-core AMD VM (2026-11-27)."""
    pipeline = measure_pipeline_loop(steps=pipeline_steps)
    step_gaps = measure_step_gaps()
    one_core = measure_one_core_allreduce(rank, world)
    probe = SpeedProbe()
    together, alone = [], []
    for _ in range(SHARED_PROBE_ROUNDS):
        _barrier()
        together.append(probe())
        _barrier()
        if rank < world // 2:
            alone.append(probe())
    return {"pipeline": pipeline, "step_gaps": step_gaps, "one_core_allreduce": one_core,
            "speed_probe": _medians(together), "speed_probe_alone": _medians(alone) if alone else None}


ONE_CORE_SIZES = (64 << 10, 1 << 20, 4 << 20)  # bytes
ONE_CORE_ROUNDS, ONE_CORE_LATE_S = 15, 3e-3


def measure_one_core_allreduce(rank: int, world: int) -> list[tuple[int, float]] | None:
    """A gloo all-reduce between ranks ``r`` and ``r + world // 2``, which the launcher binds to one core (as a
    data-parallel stage's twins of a run with two ranks on each core), its second rank calling it
    ``ONE_CORE_LATE_S`` after the first, which sleeps in it meanwhile (a twin that ended its backward first):
    per size of :data:`ONE_CORE_SIZES`, the median over :data:`ONE_CORE_ROUNDS` of the late rank's time from
    its call to its return. None on the early ranks. On the 2-core VM (2026-11-30) 545 KiB took 0.70-0.74 ms
    so, against 3.9-4.1 ms with a core each while the groups' device loops spun (``executor/gloo_threads.py``);
    with them batched, 0.67 ms against 0.41 (``benchmarks/cpu_core_allreduce.py``)."""
    torch = require_torch()
    import torch.distributed as dist

    half = world // 2
    groups = [collective_group([r, r + half]) for r in range(half)]
    group, late = groups[rank % half], rank >= half
    out = []
    for nbytes in ONE_CORE_SIZES:
        bucket = torch.randn(nbytes // 4)
        times = []
        for _ in range(ONE_CORE_ROUNDS + 1):  # the first round warms the pair's connection
            _barrier()
            call, back = late_call(lambda: dist.all_reduce(bucket, group=group), ONE_CORE_LATE_S if late else 0.0)
            times.append(back - call)
        out.append((nbytes, statistics.median(times[1:])))
    return out if late else None


def late_call(call: Callable[[], object], late_by_s: float) -> tuple[float, float]:
    """``call()`` after ``late_by_s`` of matmuls (a rank arriving late at a collective, computing till then):
    the times it was called and returned (``time.perf_counter``)."""
    torch = require_torch()
    rows, weights = torch.full((128, 512), 0.01), torch.full((512, 512), 0.01)
    start = time.perf_counter()
    while time.perf_counter() - start < late_by_s:
        rows @ weights
    called = time.perf_counter()
    call()
    return called, time.perf_counter()


def _medians(readings: Sequence[Speed]) -> Speed:
    """Each probe's median over the ``readings``."""
    return Speed(*(statistics.median(column) for column in zip(*readings)))


def _rank_compute(rank: int, world: int) -> dict:
    """Every benchmark, with the host-speed probes timed before each and at the end (``speed_probes``, each a
    :class:`~executor.speed_probe.Speed`): their medians are the host's speed while these figures were measured.
    The sampled benchmarks (:data:`SAMPLED_BENCHMARKS`: the eager ones, a tensor-parallel call's, AdamW's and a
    few matmuls) run at each of those points, and their figures are the medians over all of them: run once, they
    moved with the host's slow spells; each probe reading beside the work timed right after it is
    ``probe_pairs``. On the 2-core VM (2026-11-29) five runs of the dispatch benchmark in one process, 0.3 s
    apart, each a median over 15 repeats, timed 4.7, 4.4, 6.7, 8.3 and 6.2 us a forward op (matmuls included);
    the eager probe right after the two slowest read 284 and 278 us, as usual (272-299). Three calibrations, each
    on two such runs per rank, had priced it at 5.15, 7.91 and 5.31 us. AdamW's memory speed, timed once, came
    out 0.80 to 1.07 times the memory probe's median over six calibrations (27.2 to 43.7 GB/s a rank)."""
    probe = SpeedProbe() if probes_on(rank, world) else None
    speeds: list[Speed] = []
    sampled: dict[str, list] = {name: [] for name in SAMPLED_BENCHMARKS}

    def probe_now() -> None:
        _barrier()
        if probe is not None:
            speeds.append(probe())
        for name, benchmark in SAMPLED_BENCHMARKS.items():
            sampled[name].append(benchmark())

    results = {}
    for name, benchmark in (("matmuls", measure_matmuls), ("jitter", measure_rank_jitter),
                            ("zero_grad", measure_zero_grad), ("fsdp", measure_fsdp_host),
                            ("step_gaps", measure_step_gap_curve),
                            ("pipeline", measure_pipeline_loops)):
        probe_now()
        results[name] = benchmark()
        if name == "matmuls":  # the cache's saving is read against its own farthest reuse: no probe of its own
            results["cache_hits"] = measure_cache_hits()
    probe_now()
    return {**results, **{name: median_samples(samples) for name, samples in sampled.items()}, "speed_probes": speeds,
            "probe_pairs": probe_pairs(speeds, sampled)}


def probe_pairs(speeds: Sequence[Speed], sampled: dict[str, Sequence[Any]]) -> dict[str, list[tuple[float, float]]]:
    """At each point of a calibration, each compute probe's reading as seconds (a FLOP's, an eager pass's, a
    byte's) beside the seconds of the work it stands for, timed right after it: the matmul benchmark's calls
    (:func:`measure_matmul_sample`), the dispatch benchmark's passes (forward and backward, every stack) and the
    AdamW steps that stream from memory (every rank at once, :data:`MEMORY_BOUND_ELEMENTS` or more per tensor).
    How far the work follows each probe (``parsim.calibrate.host.fit_probe_elasticity``); none on a rank that does
    not probe."""
    return {
        "matmul": [(1 / speed.matmul_flops, seconds) for speed, seconds in zip(speeds, sampled["matmul"])],
        "eager": [(speed.eager_s, sum(row["forward_s"] + row["backward_s"] for row in rows))
                  for speed, rows in zip(speeds, sampled["dispatch"])],
        "memory": [(1 / speed.memory_Bps, sum(seconds for _, numel, seconds in steps["together"]
                                             if numel >= MEMORY_BOUND_ELEMENTS))
                   for speed, steps in zip(speeds, sampled["optimizer"])]}


TIMED_KEYS = ("forward_s", "backward_s")


def median_samples(samples: Sequence[Any]) -> Any:
    """One reading of a sampled benchmark from its samples (each a row dict, a list of them in the same order, or
    :func:`measure_host_optimizer`'s lists of rows ending in seconds; None where the benchmark had nothing to
    time): every row's seconds (``forward_s``, ``backward_s``, or the last item) are their medians over the
    samples, its counts those of the first."""
    first = samples[0]
    if first is None:
        return None
    if isinstance(first, float):
        return statistics.median(samples)
    if isinstance(first, dict) and all(isinstance(rows, list) for rows in first.values()):
        return {key: [(*rows[0][:-1], statistics.median(row[-1] for row in rows))
                      for rows in zip(*(s[key] for s in samples))] for key in first}
    if isinstance(first, dict):
        return {**first, **{key: statistics.median(s[key] for s in samples) for key in TIMED_KEYS}}
    return [median_samples(rows) for rows in zip(*samples)]


# ----------------------------------------------------------------------------- timing
def _agree(count: int) -> int:
    """The largest of every rank's ``count`` (inside a process group), so all ranks run alike."""
    torch = require_torch()
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return count
    value = torch.tensor([count], dtype=torch.int64)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return int(value.item())


def _barrier() -> None:
    torch = require_torch()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def synchronizer(device: Any = "cpu") -> Callable[[], None]:
    """What waits for ``device``'s queued work: a CUDA device runs kernels after the host returns."""
    torch = require_torch()
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


# ----------------------------------------------------------------------------- matmuls
def measure_matmuls(shapes: Sequence[tuple[int, int, int]] = DEFAULT_SHAPES, *,
                    footprint_bytes: int = COLD_FOOTPRINT_BYTES,
                    repeats: int = 11) -> list[tuple[tuple[int, int, int], float]]:
    """Median seconds of ``x[m, k] @ w[k, n]`` (fp32, a new output) per shape, as a stack of layers
    runs them in a training step: a run of calls, each on its own weight and each output kept (a step
    keeps its activations and gradients, so each is written to memory of its own), weights and outputs
    together larger than the caches, and the run starting behind caches full of written data (as the
    forward starts after the optimizer, or the backward after the loss). Each timing writes
    ``footprint_bytes / 2`` of other memory, then times a run of up to 64 calls (enough for their
    weights and outputs to fill ``footprint_bytes``, or to last about ``RUN_S``); seconds per call.

    The shapes take turns, one run of each per round, so every shape's median spans the same moments of
    a host whose speed drifts over seconds: timed one shape after another, a slow spell fell on a few
    shapes alone and bent the fitted shape model. On the 2-core AMD VM (2026-12-01, two ranks, three
    sweeps each way, alternating) the fit's median |residual| was 7.0-7.8% one shape after another and
    2.7-3.3% in turns, and a 64 x 1024 x 1024 matmul left out of the fit came out -3.6%, +9.4% and +10.8%
    off against +2.5%, +1.8% and +3.6%."""
    torch = require_torch()
    dirty = torch.zeros(footprint_bytes // 8)
    runs = []  # per shape: its input and its run's weights
    for m, n, k in shapes:
        x = torch.full((m, k), 0.01)
        start = time.perf_counter()
        torch.matmul(x, torch.full((k, n), 0.02))  # warm-up, and how long a call takes
        once = time.perf_counter() - start
        # Enough calls for their weights to fill the footprint, within about RUN_S (big shapes are compute-bound).
        run = _agree(max(2, min(64, math.ceil(footprint_bytes / ((k * n + m * n) * 4)),
                                int(RUN_S / max(once, 1e-7)))))
        runs.append((x, list(torch.full((run, k, n), 0.02).unbind(0))))
    times: list[list[float]] = [[] for _ in shapes]
    for _ in range(repeats):
        for (x, ws), seconds in zip(runs, times):
            _barrier()
            dirty.add_(1.0)
            start = time.perf_counter()
            outputs = [torch.matmul(x, w) for w in ws]
            seconds.append((time.perf_counter() - start) / len(ws))
            del outputs
    return [((m, n, k), statistics.median(seconds)) for (m, n, k), seconds in zip(shapes, times)]


def measure_cache_hits(shape: tuple[int, int, int] = CACHE_SHAPE, weights: Sequence[int] = CACHE_WEIGHTS,
                       rounds: int = 3) -> list[tuple[float, float]]:
    """How a matmul's weight read depends on the bytes touched since its last read: ``x[m, k] @ w[k, n]`` (fp32)
    cycling over each count of ``weights``, ``CACHE_CYCLES`` cycles after a warm one, each call's output kept to
    the cycle's end (a step keeps its activations). Returns (bytes touched from one call's start to the next call
    on the same weight, seconds per call: the median over the rounds), the counts taking turns each round.

    A layer whose weights the rank read a few MiB ago finds them in the cache, one read after AdamW streamed
    the weights, gradients and moments finds them in memory. On the 2-core Intel VM (2026-12-02; 2 MiB of L2 a
    core, a share of the server's L3), two ranks at once, two runs: 0.61-0.67 ms a call over 4-16 MiB, 0.76-0.91
    over 32 MiB, 0.98-1.12 over 64 MiB and 1.12-1.14 ms over 128-256 MiB."""
    torch = require_torch()
    m, n, k = shape
    dist = torch.distributed
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    room = host_memory_bytes() // (CACHE_MEMORY_SHARE * ranks * k * n * 4)
    weights = [count for count in weights if count <= room] or [1]  # a small host leaves the farthest out
    pool = list(torch.full((max(weights), k, n), 0.02).unbind(0))
    x = torch.full((m, k), 0.01)
    times: dict[int, list[float]] = {count: [] for count in weights}
    for _ in range(rounds):
        for count in weights:
            _barrier()
            cycle = pool[:count]
            outputs = [torch.matmul(x, w) for w in cycle]  # warm: the cycle's weights as the cache keeps them
            del outputs
            start = time.perf_counter()
            for _ in range(CACHE_CYCLES):
                outputs = [torch.matmul(x, w) for w in cycle]
                del outputs
            times[count].append((time.perf_counter() - start) / (CACHE_CYCLES * count))
    call_bytes = (m * k + k * n + m * n) * 4
    return [(count * call_bytes, statistics.median(times[count])) for count in weights]


# ----------------------------------------------------------------------------- eager dispatch
# small: fixed costs, not arithmetic, dominate; SEQUENCES of TOKENS each pass
WIDTH, TOKENS, SEQUENCES, DEPTH, HEADS, KV_HEADS = 32, 16, 2, 8, 4, 2
PASS_DEPTHS = (DEPTH, 1)  # the stacks' blocks: a pass's cost beyond its ops is what one block's adds

# The two decoder layers the eager blocks are made of: the reference implementation's (executor/train/models.py,
# whose ops parsim.lowering.eager_ops counts) in its two common configurations, at WIDTH, never a plan's model.
REFERENCE_LAYERS = {
    "llama layer": {"ffn_type": "swiglu", "num_kv_heads": KV_HEADS, "position_embedding": "rope"},
    "gpt layer": {"ffn_type": "gelu", "num_kv_heads": HEADS, "position_embedding": "learned", "linear_bias": True},
}


def _eager_blocks(depth: int = DEPTH) -> dict[str, tuple[Any, list[tuple[int, int, int]]]]:
    """name -> (a stack of ``depth`` blocks, the matmuls one forward runs as (m, n, k)).

    The blocks are the reference implementation's decoder layers (:data:`REFERENCE_LAYERS`), so the cost per op
    is that of the ops :mod:`parsim.lowering.eager_ops` counts, and a chain of elementwise ops. The dispatch
    benchmark had run generic GPT-2 blocks of ``torch.nn`` modules (LayerNorm, biased Linear, softmax attention
    written out), whose ops cost otherwise: on the 2-core VM (2026-11-29, one process, cold as below) they
    pooled to 4.97 us a forward op and 3.85 a backward one, the Llama layer alone to 5.40 and 3.47, the GPT
    layer to 5.44 and 3.71; tiny-gpt's backward had come out 20-29% long and its forward 1-14% short
    against its runs."""
    torch = require_torch()
    from parsim.workload.model import load_model

    from .train.models import DecoderLayer

    nn = torch.nn
    blocks = {}
    for name, config in REFERENCE_LAYERS.items():
        spec = load_model({"name": name, "kind": "transformer", "num_layers": DEPTH, "hidden": WIDTH,
                           "num_heads": HEADS, "ffn_hidden": 4 * WIDTH, "seq_len": TOKENS, "vocab_size": 64,
                           "layer_kernels": "eager", "cross_entropy": "torch", **config})
        layer = spec.layer_costs(4)[0]  # the simulator's own shapes of the layer's matmuls and attention core
        matmuls = [(SEQUENCES * TOKENS, mm.n, mm.k) for block in layer.blocks for mm in block.matmuls]
        for core in (block.core for block in layer.blocks if block.core is not None):  # scores, then their values
            matmuls += [(core.seq, core.seq, core.head_dim), (core.seq, core.head_dim, core.seq)] * (SEQUENCES
                                                                                                  * core.heads)
        blocks[name] = (nn.Sequential(*[DecoderLayer(spec) for _ in range(depth)]), matmuls * depth)

    class Elementwise(nn.Module):  # activations, scalar arithmetic and a reduction
        def forward(self, x):
            return torch.tanh(x * 0.5 + torch.sigmoid(x)) - x.mean(-1, keepdim=True)

    return {**blocks, "elementwise": (nn.Sequential(*[Elementwise() for _ in range(depth)]), [])}


def count_ops(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()``'s result and the ATen ops it dispatched."""
    result, ops, _ = count_traffic(fn)
    return result, ops


PRICED_ELSEWHERE = ("mm", "addmm", "bmm", "_scaled_dot_product")  # by shape and FLOPs, not bytes


def count_traffic(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """``fn()``'s result, the ATen ops it dispatched, and the bytes they read and wrote as parsim's lowering counts
    a memory-bound kernel's (:class:`parsim.workload.model.Elementwise`): every tensor argument and result, each
    at most its storage (a broadcast operand is read once); views move none, nor do matmuls and the attention
    kernel (priced by their shapes and FLOPs); ``nll_loss`` reads one log-probability per token and its
    backward writes the whole gradient."""
    torch = require_torch()
    from torch.utils._python_dispatch import TorchDispatchMode

    class Tally(TorchDispatchMode):
        ops = nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops += 1
            name = func.overloadpacket.__name__
            if func.is_view or name in ("detach", "_unsafe_view") or name.startswith(PRICED_ELSEWHERE):
                return out
            inputs = () if name.startswith("nll_loss") else (args, kwargs)
            self.nbytes += sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
                               for t in torch.utils._pytree.tree_leaves((inputs, out)) if isinstance(t, torch.Tensor))
            return out

    with Tally() as tally:
        result = fn()
    return result, tally.ops, tally.nbytes


def after_dirty_caches(fn: Callable[[], Any], repeats: int = REPEATS,
                       footprint_bytes: int = COLD_FOOTPRINT_BYTES, sync: Callable[[], None] = lambda: None,
                       together: bool = True) -> float:
    """Median seconds of ``fn()``, each call run right after writing ``footprint_bytes / 2`` of other
    host memory (untimed): as a training step's work finds the caches, full of other data and code.
    ``sync`` waits for a GPU's queue before and after each call; ``together``: every rank starts at once
    (False: this rank runs alone, the others wait elsewhere)."""
    torch = require_torch()
    dirty = torch.zeros(footprint_bytes // 8)
    fn()
    if together:
        _barrier()
    times = []
    for _ in range(repeats):
        dirty.add_(1.0)
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def passes_after_dirty_caches(forward: Callable[[], Any], backward: Callable[[Any], Any], repeats: int = REPEATS,
                              footprint_bytes: int = COLD_FOOTPRINT_BYTES, sync: Callable[[], None] = lambda: None
                              ) -> tuple[float, float]:
    """Median seconds of ``forward()`` and of ``backward(its output)`` right after it, every rank at once, each
    repeat right after writing ``footprint_bytes / 2`` of other host memory (untimed), as a step's pass finds
    the caches. Both are timed in the same repeat. The backward had been the difference of two medians, each
    over its own run of repeats (forward alone, then forward and backward): that took in the host's drift
    between the runs, and one calibration on the 2-core AMD VM (2026-11-27, set BN) priced a backward op at
    7.2 us against 10.5-13.8 in the six before it."""
    return passes_in_turns([(forward, backward)], repeats, footprint_bytes, sync)[0]


def passes_in_turns(passes: Sequence[tuple[Callable[[], Any], Callable[[Any], Any]]], repeats: int = REPEATS,
                    footprint_bytes: int = COLD_FOOTPRINT_BYTES, sync: Callable[[], None] = lambda: None
                    ) -> list[tuple[float, float]]:
    """:func:`passes_after_dirty_caches` of several (forward, backward) pairs, in turns: each of ``repeats``
    rounds times one forward and its backward of every pair, each behind the dirty write, so a slow spell of
    the host falls on all of them alike (as :func:`measure_matmuls` times its shapes). Medians, per pair."""
    torch = require_torch()
    dirty = torch.zeros(footprint_bytes // 8)
    for forward, backward in passes:
        backward(forward())
    _barrier()
    times: list[tuple[list[float], list[float]]] = [([], []) for _ in passes]
    for _ in range(repeats):
        for (forward, backward), (forward_s, backward_s) in zip(passes, times):
            dirty.add_(1.0)
            sync()
            start = time.perf_counter()
            out = forward()
            sync()
            middle = time.perf_counter()
            backward(out)
            sync()
            forward_s.append(middle - start)
            backward_s.append(time.perf_counter() - middle)
    return [(statistics.median(f), statistics.median(b)) for f, b in times]


def measure_dispatch(device: Any = "cpu", depths: Sequence[int] = PASS_DEPTHS) -> list[dict]:
    """Per block stack (:func:`_eager_blocks`), of each of ``depths`` blocks: forward and backward seconds
    (medians over rounds that time every stack in turn, each run behind dirty caches as a step's actions are),
    the ATen ops of each, its matmuls and its blocks (``layers``). On a GPU the blocks are so small that the
    kernels wait on the host: the times are the host's (Python, dispatch, autograd and launches).

    The stacks of one block give what a pass costs beyond its ops (:func:`parsim.calibrate.host.fit_dispatch`):
    its first layer runs colder than the identical ones after it. On the 2-core AMD VM (2026-12-01), decoder
    layers 32 wide timed in turns behind dirty caches, stacks of 1, 2, 4 and 8 took 0.4-0.75 ms forward and
    0.15-0.21 ms backward beyond their per-layer time (0.8-0.95 and 0.3-0.43 at 64 wide)."""
    torch = require_torch()
    sync = synchronizer(device)
    rows, passes = [], []
    for depth in depths:
        for name, (stack, matmuls) in _eager_blocks(depth).items():
            stack = stack.to(device)
            x = torch.randn(SEQUENCES, TOKENS, WIDTH, device=device, requires_grad=True)
            grad = torch.randn(SEQUENCES, TOKENS, WIDTH, device=device)
            out, forward_ops = count_ops(lambda: stack(x))
            _, backward_ops = count_ops(lambda: torch.autograd.backward(out, grad))
            passes.append((lambda stack=stack, x=x: stack(x),
                           lambda y, grad=grad: torch.autograd.backward(y, grad)))
            rows.append({"name": name, "layers": depth, "forward_ops": forward_ops,
                         "backward_ops": backward_ops - 1,  # less x's own accumulation
                         "matmuls": matmuls})
    for row, (forward_s, backward_s) in zip(rows, passes_in_turns(passes, sync=sync)):
        row.update(forward_s=forward_s, backward_s=backward_s)
    return rows


ELEMENTWISE_SHAPE = (64, 1024)  # 64Ki elements (256 KiB in fp32): a mid-size layer's activations


def measure_elementwise(shape: tuple[int, int] = ELEMENTWISE_SHAPE) -> dict:
    """Elementwise work whose bytes, not its arithmetic, bound it, through autograd on tensors of ``shape``
    (large enough that the bytes, not the dispatch, dominate), as an eager layer runs it between its matmuls:
    a product by a weight row (a norm's), a residual add, a rotation of halves (RoPE's negation and
    concatenation) and a product by a constant. Forward and backward seconds (medians), and the ATen ops and
    bytes (:func:`count_traffic`) of each. GeLU, norms and softmax, whose arithmetic outlasts their bytes,
    are timed apart (:func:`measure_kernel_kinds`). This chain had held GeLU, sigmoid, softmax, SiLU and a
    LayerNorm: on the 2-core VM it priced every eager kernel's bytes at 13-16 GB/s (2026-11-29), where a
    product or a sum of 256 KiB tensors ran at 80-100 GB/s, and tiny-gpt's backward, whose kernels move twice
    the forward's bytes, came out 17% long against its runs in two sets."""
    torch = require_torch()
    weight = torch.randn(shape[-1], requires_grad=True)
    half = shape[-1] // 2

    def chain(x):
        y = x * weight + x
        return torch.cat((-y[..., half:], y[..., :half]), dim=-1) * 0.5 + x

    x = torch.randn(*shape, requires_grad=True)
    grad = torch.randn(*shape)

    def backward(y):  # the gradients returned, not added into .grad: no other kernel runs
        return torch.autograd.grad(y, (x, weight), grad)

    out, forward_ops, forward_bytes = count_traffic(lambda: chain(x))
    _, backward_ops, backward_bytes = count_traffic(lambda: backward(out))
    forward_s, backward_s = passes_after_dirty_caches(lambda: chain(x), backward)
    return {"forward_s": forward_s, "backward_s": backward_s, "forward_ops": forward_ops,
            "backward_ops": backward_ops, "forward_bytes": forward_bytes, "backward_bytes": backward_bytes}


def measure_kernel_kinds(shape: tuple[int, int] = ELEMENTWISE_SHAPE) -> list[dict]:
    """GeLU, a LayerNorm (its weight and bias too) and a softmax over rows of ``shape[-1]``, each on its own
    through autograd, behind dirty caches: per kind, forward and backward seconds (medians), the ATen ops of
    each, and the elements of its input. The backward takes the gradients (``torch.autograd.grad``) rather
    than adding them into ``.grad``, so no other kernel runs."""
    torch = require_torch()
    F = torch.nn.functional
    norm = torch.nn.LayerNorm(shape[-1])
    kinds = {"gelu": (F.gelu, []), "norm": (norm, list(norm.parameters())),
             "softmax": (lambda z: torch.softmax(z, dim=-1), [])}
    rows = []
    for kind, (kernel, params) in kinds.items():
        x = torch.randn(*shape, requires_grad=True)
        grad = torch.randn(*shape)
        inputs = [x, *params]
        out, forward_ops = count_ops(lambda: kernel(x))
        _, backward_ops = count_ops(lambda: torch.autograd.grad(out, inputs, grad))
        forward_s, backward_s = passes_after_dirty_caches(lambda: kernel(x),
                                                          lambda y: torch.autograd.grad(y, inputs, grad))
        rows.append({"kind": kind, "forward_s": forward_s, "backward_s": backward_s,
                     "forward_ops": forward_ops, "backward_ops": backward_ops, "elements": shape[0] * shape[1]})
    return rows


TP_CALL_SHAPE = (4, 8)  # a tiny activation: the call's host time, not its bytes
TP_CALL_LAYER = (64, 1024, 1024)  # (m, n, k) of the matmul before each call: a layer's, its weight 4 MiB in fp32
TP_CALL_REPEATS = 31


def measure_tp_calls(repeats: int = TP_CALL_REPEATS) -> dict[str, float] | None:
    """The host time of one tensor-parallel collective call in an eager pass, beyond the collective: the
    executor's own wrapper (the lecture's all-gather of a layer's output, :class:`executor.train.comm.GatherFromTP`:
    the module, its autograd function, the output buffer, the regrouping views and the recorder), on every rank
    of the process group at once.

    ``forward``: the module's call less the all-gather it records. ``backward``: a backward through the call
    (its reduce-scatter) less that reduce-scatter and less a backward through a plain op, which the call adds
    to. Medians; each call right after a layer's matmul (:data:`TP_CALL_LAYER`), as in a step, on tensors too
    small for their bytes to count (the model prices a call's regrouping copy by its bytes). Warm, back to
    back, a call took 60-70 us forward and 40-45 us backward on the 2-core VM; behind 32 MiB of written memory
    180-210 and 120; after a layer's matmul 100-140 and 60-80 (inside a `parsim run course-tp --tp 2` step,
    115-150 us forward, 2026-11-27). None without a process group of two or more ranks."""
    torch = require_torch()
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    from .train.comm import GatherFromTP, TPGroup
    from .train.trace_recorder import Recorder

    recorder = Recorder(dist.get_rank())
    gather = GatherFromTP(TPGroup(None, dist.get_rank(), dist.get_world_size(), recorder), "layer.0")
    m, n, k = TP_CALL_LAYER
    activation, weight = torch.full((m, k), 0.01), torch.full((k, n), 0.01)
    x = torch.full(TP_CALL_SHAPE, 0.5, requires_grad=True)

    def timed(fn: Callable[[], Any]) -> float:
        activation @ weight
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    forward, backward = [], []
    _barrier()
    for i in range(repeats + 1):  # the first round warms up
        recorder.begin_action(0)
        out = []
        call = timed(lambda: out.append(gather(x)))
        gathered = recorder.events[-1].dur_s
        (y,) = out
        through = timed(lambda: torch.autograd.backward(y, torch.ones_like(y)))
        scattered = recorder.events[-1].dur_s
        plain = x * 1.0
        alone = timed(lambda: torch.autograd.backward(plain, torch.ones_like(plain)))
        x.grad = None
        recorder.events.clear()
        if i:
            forward.append(call - gathered)
            backward.append(through - scattered - alone)
    return {"forward_s": statistics.median(forward), "backward_s": max(statistics.median(backward), 0.0)}


# ----------------------------------------------------------------------------- optimizer
def adamw(tensors: int, numel: int, device: Any = "cpu") -> Any:
    """A ``torch.optim.AdamW`` (torch's defaults, as the executor builds it) over ``tensors`` fp32 parameters of
    ``numel`` elements, each with a gradient."""
    torch = require_torch()
    params = [torch.nn.Parameter(torch.full((numel,), 0.01, device=device)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.full((numel,), 1e-3, device=device)
    return torch.optim.AdamW(params, lr=1e-3)


def measure_optimizer(runs: Sequence[tuple[int, int]] = OPTIMIZER_RUNS, device: Any = "cpu"
                      ) -> list[tuple[int, int, float]]:
    """Median seconds of one AdamW step (:func:`adamw`) on ``tensors`` parameters of ``numel`` fp32 elements
    each, each step behind dirty caches as a training step's optimizer finds the host after the backward:
    (tensors, numel, seconds) per run. On a GPU host (an H200's, 2026-11-27) a step over tiny-gpt's 39 tensors
    took 650 us back to back, 1.3 ms behind dirty caches and 1.6 ms inside a training loop."""
    sync = synchronizer(device)
    return [(tensors, numel, after_dirty_caches(adamw(tensors, numel, device).step, repeats=9, sync=sync,
                                                together=False))
            for tensors, numel in runs]


def measure_host_optimizer(runs: Sequence[tuple[int, int]] = OPTIMIZER_RUNS, alone: tuple[int, int] = OPTIMIZER_ALONE
                           ) -> dict[str, list[tuple[int, int, float]]]:
    """AdamW steps on a CPU host, each behind dirty caches as a step's optimizer finds them after the backward
    (a tensor's fixed cost is 10-20% above a warm loop's): ``together``, every rank at once, one row per run
    (tensors, numel, seconds); and ``alone``, the ``alone`` run on each rank in turn while the others wait (a
    core streaming alone gets more of the host's memory bandwidth than its share when every core streams)."""
    together = []
    for tensors, numel in runs:
        _barrier()
        together.append((tensors, numel, after_dirty_caches(adamw(tensors, numel).step, repeats=9)))
    optimizer = adamw(*alone)
    seconds = in_turn(lambda: after_dirty_caches(optimizer.step, repeats=9, together=False))
    return {"together": together, "alone": [(*alone, seconds)]}


# Mid-sized matmuls of the calibration's sweep (DEFAULT_SHAPES, (m, n, k)): weights streamed in, and one
# arithmetic-bound; the matmul-bound work paired with each matmul probe reading.
PAIRED_MATMULS = ((128, 256, 1024), (256, 512, 512), (1024, 1024, 128))
# AdamW's tensors of this many elements or more stream from memory (OPTIMIZER_RUNS): the memory probe's work.
MEMORY_BOUND_ELEMENTS = 1 << 20


def measure_matmul_sample(shapes: Sequence[tuple[int, int, int]] = PAIRED_MATMULS, repeats: int = 5) -> float:
    """Seconds of one call of each of ``shapes`` together, timed as :func:`measure_matmuls` times them: the
    matmul-bound work beside each matmul probe reading (:func:`probe_pairs`)."""
    return sum(seconds for _, seconds in measure_matmuls(shapes, repeats=repeats))


# The benchmarks of an eager op's fixed cost, the figures that rest on it, a tensor-parallel call's host time,
# AdamW's and a few matmuls: sampled through the whole run (see _rank_compute).
SAMPLED_BENCHMARKS: dict[str, Callable[[], Any]] = {
    "dispatch": measure_dispatch, "elementwise": measure_elementwise, "kernel_kinds": measure_kernel_kinds,
    "tp_calls": measure_tp_calls, "optimizer": measure_host_optimizer, "matmul": measure_matmul_sample}


def measure_rank_jitter(repeats: int = JITTER_REPEATS, run: tuple[int, int] = OPTIMIZER_ALONE) -> list[float]:
    """Seconds of each of ``repeats`` AdamW steps over ``run`` (tensors, elements each), behind dirty caches,
    every rank starting each at once (a barrier before each): rank against rank, step by step, how much the same
    work's time varies between ranks that start it together (``parsim.sim.jitter``). On the 2-core VM
    (2026-11-29) the AdamW steps of course DDP's two ranks, 12.3 ms at the median, differed by 1.1 ms at the
    median over 30 steps, either rank the slower about as often."""
    torch = require_torch()
    optimizer = adamw(*run)
    dirty = torch.zeros(COLD_FOOTPRINT_BYTES // 8)
    optimizer.step()
    times = []
    for _ in range(repeats):
        dirty.add_(1.0)
        _barrier()
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


ZERO_GRAD_RUNS = ((1, 1 << 10), (16, 1 << 10), (4, 1 << 20), (16, 1 << 18))  # (tensors, fp32 elements each)


def measure_zero_grad(runs: Sequence[tuple[int, int]] = ZERO_GRAD_RUNS, repeats: int = 9
                      ) -> list[tuple[int, int, float]]:
    """``optimizer.zero_grad(set_to_none=True)`` after a backward, as a training loop starts its step: the
    median seconds over ``repeats`` tries of freeing ``tensors`` gradients of ``numel`` fp32 elements each,
    one row (tensors, numel, seconds) per run, every rank at once. Freeing costs by the bytes: on the 2-core
    VM (2026-11-27) 7-19 us for one small tensor, 12-14 us for 16, 101-112 us for 16 MiB in 4 or 16 tensors."""
    torch = require_torch()
    rows = []
    for tensors, numel in runs:
        params = [torch.nn.Parameter(torch.full((numel,), 0.01)) for _ in range(tensors)]
        optimizer = torch.optim.AdamW(params)
        times = []
        _barrier()
        for _ in range(repeats + 1):  # the first round warms up
            sum((p * 1.0).sum() for p in params).backward()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        rows.append((tensors, numel, statistics.median(times[1:])))
    return rows


FSDP_UNITS = (2, 8)  # units per stack: the difference per unit leaves the root's fixed costs out
FSDP_UNIT = (2, 64, 8)  # (linears, width, rows) of each unit: host work, not bytes, sets its time


class _TimedGather:
    """FSDP2's all-gather comm for a unit (``set_custom_all_gather``), run as the executor's
    (:mod:`executor.train.fsdp`), adding the seconds inside each call to ``inside[0]``: what a pass spends
    beyond them is FSDP2's host work."""

    def __init__(self, inside: list[float]):
        self.inside = inside

    def allocate(self, size, *, dtype, device):
        return require_torch().empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False) -> None:
        from .train.comm import _all_gather

        start = time.perf_counter()
        _all_gather(output_tensor, input_tensor, group=group)
        self.inside[0] += time.perf_counter() - start


class _TimedScatter(_TimedGather):
    """The same for the reduce-scatter (``set_custom_reduce_scatter``)."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False) -> None:
        from .train.comm import _reduce_scatter

        start = time.perf_counter()
        _reduce_scatter(output_tensor, input_tensor, op=op, group=group)
        self.inside[0] += time.perf_counter() - start


def measure_fsdp_host(units: Sequence[int] = FSDP_UNITS, steps: int = 15, warmup: int = 3,
                      unit: tuple[int, int, int] = FSDP_UNIT, mesh: Any = None
                      ) -> list[tuple[int, int, tuple[float, float, float], tuple[float, float, float],
                                      tuple[float, float]]]:
    """FSDP2's own host work on every rank at once, sharding over all of them (``mesh``: another FSDP mesh):
    its hooks, copies and DTensor dispatch around real collectives, the seconds inside the collectives
    themselves left out (each timed in the comm FSDP2 calls, as the executor's own comms run them). Per stack of
    ``units`` units (each ``fully_shard``-ed, then the stack, as the executor wraps a stage): one row (units,
    parameter tensors, plain (forward, backward, AdamW step) seconds, the same under FSDP2, and FSDP2's
    (forward, backward) that gather and reduce nothing, as a pipeline's passes between a stage's first and last
    run: its units kept unsharded, gradients not synced, as ``executor.train.pipeline`` sets them), each the
    median over ``steps`` steps after ``warmup``. ``unit``: (linears, width, rows) of each unit.

    Over a group of each rank's own, where no collective moves bytes, FSDP2's host work is as little as half
    what it is beside real ones: on the 2-core AMD VM (2026-11-30, units of two 64-wide linears, two ranks, three
    runs) 0.44-0.80 ms per unit in a forward and 0.67-1.17 in a backward over their own groups, 0.97-1.1 and
    1.33-1.5 over both ranks with the collectives' own 0.44-0.58 and 1.19-1.24 ms left out (``tiny-dp2
    --grad-sync fsdp``'s passes had read about 0.9 and 1.2 ms per unit longer than calibrations over own groups
    priced them)."""
    torch = require_torch()
    dist = torch.distributed
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    linears, width, rows = unit
    inside = [0.0]  # seconds inside collectives so far

    def timed(count: int, fsdp: bool, kept: bool = False) -> tuple[float, ...]:
        """Forward, backward and AdamW step, less the seconds inside collectives; ``kept``: forward and backward
        only, every unit gathered once and kept, gradients accumulated unsynced
        (``set_requires_gradient_sync(False)``)."""
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(linears)])
                                      for _ in range(count)])
        if fsdp:
            for module in (*model, model):
                fully_shard(module, mesh=mesh, reshard_after_forward=not kept)
                module.set_custom_all_gather(_TimedGather(inside))
                module.set_custom_reduce_scatter(_TimedScatter(inside))
        if kept:
            model.set_requires_gradient_sync(False)
            model.set_reshard_after_backward(False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(rows, width)
        times: list[list[float]] = [[], [], []]
        _barrier()
        for i in range(steps + warmup):
            t0, in0 = time.perf_counter(), inside[0]
            loss = model(x).sum()
            t1, in1 = time.perf_counter(), inside[0]
            loss.backward()
            t2, in2 = time.perf_counter(), inside[0]
            if not kept:
                optimizer.step()
                optimizer.zero_grad()
            t3 = time.perf_counter()
            if i >= warmup:
                for k, seconds in enumerate((t1 - t0 - (in1 - in0), t2 - t1 - (in2 - in1), t3 - t2)):
                    times[k].append(seconds)
        return tuple(statistics.median(t) for t in times[:2 if kept else 3])

    return [(count, count * linears * 2, timed(count, False), timed(count, True), timed(count, True, kept=True))
            for count in units]


STEP_GAP_MLP = (4, 768, 64)  # (layers, width, rows) of the generic step: a 2.25 MiB weight and gradient per layer
# The generic step's widths for measure_step_gap_curve: 4, 9, 16 and 36 MiB of fp32 gradients a rank.
STEP_GAP_WIDTHS = (512, 768, 1024, 1536)


def gelu_mlp(layers: int, width: int) -> Any:
    """``layers`` bias-free ``width``-wide linear layers, each followed by a GeLU: a generic model's pass."""
    nn = require_torch().nn
    return nn.Sequential(*[module for _ in range(layers)
                           for module in (nn.Linear(width, width, bias=False), nn.GELU())])


def measure_step_gaps(steps: int = 12, warmup: int = 3, mlp: tuple[int, int, int] = STEP_GAP_MLP) -> float:
    """The training loop's host time between a step's actions, in a generic data-parallel step on every rank at
    once: zero_grad, a forward and a backward of a GeLU MLP, an all-reduce of each gradient in turn (averaged),
    AdamW, each action a span of the executor's :class:`~executor.train.trace_recorder.Recorder`. The median
    gap between one span's end and the next one's start over the steps after ``warmup``, in seconds.

    A loop over trivial work leaves the interpreter's code and data in the caches; a step's passes and
    collectives stream megabytes and evict them, so the same Python runs cold: on the 2-core AMD VM
    (2026-11-27) this step's gaps were 100-150 us where the pipeline loop's over stages of small eager ops had
    been 46 us, and course DDP's own 110-220 us."""
    from .train.trace_recorder import Recorder

    torch = require_torch()
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    layers, width, rows = mlp
    net = gelu_mlp(layers, width)
    optimizer = torch.optim.AdamW(net.parameters())
    x = torch.full((rows, width), 0.01)
    recorder = Recorder(0)
    gaps: list[float] = []
    for step in range(warmup + steps):
        _barrier()
        recorder.start_step()
        optimizer.zero_grad(set_to_none=True)
        with recorder.span("forward", "compute", "compute"):
            loss = net(x).square().mean()
        with recorder.span("backward", "compute", "compute"):
            loss.backward()
        if world > 1:
            for param in net.parameters():
                with recorder.span("all_reduce", "collective", "comm"):
                    dist.all_reduce(param.grad)
                    param.grad.div_(world)
        with recorder.span("optimizer", "optimizer", "compute"):
            optimizer.step()
        if step >= warmup:
            events = recorder.events
            gaps += [after.start_s - before.end_s for before, after in zip(events, events[1:])]
    return statistics.median(gaps)


def measure_step_gap_curve(widths: Sequence[int] = STEP_GAP_WIDTHS, **kwargs: Any) -> list[tuple[int, float]]:
    """:func:`measure_step_gaps` with the generic step's layers each of ``widths``: (the gradients the rank holds,
    in bytes; the median gap), smallest first. The gap grows with the memory the step streams, which empties the
    caches of the interpreter's code and data: on the 2-core VM (2026-11-29, two ranks, three runs each) 22-30,
    45-68, 81-89 and 87-94 us at 512, 768, 1024 and 1536 wide."""
    return at_widths(measure_step_gaps, STEP_GAP_MLP, widths, **kwargs)


def at_widths(measure: Callable[..., Any], mlp: tuple[int, int, int], widths: Sequence[int], **kwargs: Any
              ) -> list[tuple[int, Any]]:
    """``measure(mlp=...)`` with ``mlp``'s (layers, width, rows) at each of ``widths``: (the fp32 gradients a rank
    holds with that width, in bytes; the reading)."""
    layers, _, rows = mlp
    return [(layers * width * width * 4, measure(mlp=(layers, width, rows), **kwargs)) for width in widths]


def in_turn(mine: Callable[[], float], others: Callable[[], Any] = lambda: None) -> float:
    """Every rank in turn runs ``mine`` while the others run ``others`` (by default, wait at the next turn's
    barrier): this rank's result."""
    torch = require_torch()
    dist = torch.distributed
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    result = 0.0
    for turn in range(world):
        _barrier()
        if turn == rank:
            result = mine()
        else:
            others()
    return result


def compute_for(seconds: float, shape: tuple[int, int, int] = (64, 256, 256)) -> None:
    """Keep this rank's core busy with ``(m, n, k)`` matmuls for ``seconds`` (as another stage's backward does)."""
    torch = require_torch()
    m, n, k = shape
    a, b = torch.full((m, k), 0.01), torch.full((k, n), 0.01)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ b


# ----------------------------------------------------------------------------- the pipeline loop
PIPELINE_STAGE_MLP = (2, 768, 64)  # (layers, width, rows) of each stage's pass: 4.5 MiB of weights
# The stages' widths for measure_pipeline_loops, the last PIPELINE_STAGE_MLP's: 128 KiB to 4.5 MiB of weights.
PIPELINE_LOOP_WIDTHS = (128, 256, 512, 768)


def measure_pipeline_loops(widths: Sequence[int] = PIPELINE_LOOP_WIDTHS, **kwargs: Any
                           ) -> list[tuple[int, dict[str, float] | None]]:
    """:func:`measure_pipeline_loop` with each stage's layers each of ``widths``, each figure a typical event's
    (``by_event``): (the gradients a rank holds, in bytes; its figures), smallest first. A send's issue grows with
    the weights the passes stream, as the loop's time between actions does: on the 2-core VM (2026-11-29, as a
    typical step had them, two runs) 107-111 us with layers 128 and 256 wide, 597-688 us 768 wide, where the
    loop's time before an action went from 20 to 38-44 us; so do the transfers' (a late receive's 82-90 us at
    128 wide, 105-292 at 768). As a typical send has it (three runs): 136-139 us 512 wide, 212-251 us 768 wide.

    With a core per rank a stall (a gloo thread or the loop waiting milliseconds for the scheduler) hits a few
    sends and transfers in a hundred, but in a loop this short as many as half its steps: 29-50 steps of 120
    with 768-wide stages (three runs, later that night). A typical step's mean then flips between runs (a
    send's issue 226-559 us over the calibrations of EB-EE), where a typical send's stays put (212-251 us in
    those three runs) and prices what a plan's typical step pays: course PP's rank 0 idle measured 1.2-2.1 ms
    in every run of EB-EE, where the calibrations whose issue had flipped put it at 2.6-2.9."""
    return at_widths(measure_pipeline_loop, PIPELINE_STAGE_MLP, widths, by_event=True, **kwargs)


def measure_pipeline_loop(microbatches: int = 4, steps: int = 60, warmup: int = 3,
                          mlp: tuple[int, int, int] = PIPELINE_STAGE_MLP, by_event: bool = False
                          ) -> dict[str, float] | None:
    """The executor's pipeline loop's own host costs, on stages whose passes are a generic model's.

    Ranks pair up (0-1, 2-3, ...) and run :class:`executor.train.pipeline.PipelineRuntime` as a 1F1B pipeline
    of two stages. Each stage's forward runs a GeLU MLP (``mlp``: layers, width, rows; :func:`gelu_mlp`) on rows
    of its own, and its backward that MLP's, beside an ``nn.Linear(8, 8)`` on the activation the stages pass
    (4 x 8: the transfers' figures are their fixed costs, the bytes' time is the links'). The sender of a late
    receive is computing, as in a real pipeline, and its gloo thread waits for the core; the loop runs after
    passes that have streamed their weights, as a plan's does.

    On the 2-core AMD VM (2026-11-27, three runs) a send's issue took 394-472 us on top of a gap of 106-126 us,
    where the plans' own took 0.36-0.50 ms (course PP) and 0.44-0.63 ms (tiny PP) from a send's issue to the
    next action (``benchmarks/cpu_action_gaps.py``); a transfer whose receiver waited took 306-407 us (the
    plans' a median 0.34-0.40 ms). Stages of small eager ops instead (this loop's stages until then) gave
    gaps of 48-61 us, issues of 229-346 us and waiting transfers of 153-246 us. What sets it is the weights
    the pass streams, not its length: one 2.25 MiB layer gave issues of 287-310 us, two 416-424 us, and the
    same two run six times in a pass 380-429 us. In seconds:

    * ``action``: the loop's Python before a pass, a receive or the optimizer step: the gap from the step's
      start or an action's end to the next action, where no send was issued;
    * ``issue``: what each send's issue adds to such a gap (``isend``, handing it to the thread that waits
      for it): the excess per send of the gaps with sends;
    * ``rendezvous``: a transfer whose receive is posted after its send was issued (gloo moves a message only
      once the receiver asks): the time the receive takes;
    * ``latency``: a transfer whose receiver waits first: the time from the send's issue to the receive's end
      (one clock: both ranks read the host's monotonic clock).

    A transfer now and then stalls for milliseconds (a gloo thread, or the loop itself, waiting for the
    scheduler to give it the core), so the transfers' figures are those of the loop's typical step, as
    ``parsim run`` reports a typical step (:func:`typical_step_mean`). On the 2-core VM (2026-11-27) 3-10%
    of late receives stalled past 1 ms with a core per rank: most steps had none, and a late receive took
    a median 56-77 us where the mean over every step swung between 154 and 399 us from one run to the next.
    With two ranks on each core 40% stalled: every step had some. The gaps' figures are the typical step's
    too (:func:`split_gaps`). ``by_event``: each figure a typical event's instead, the median over every
    gap, send and transfer (:func:`event_median`): stalls that hit a minority of them do not count, however
    many steps they hit (:func:`measure_pipeline_loops`). None on a rank without a partner."""
    from parsim.schedules.generators import make_schedule

    from .train.pipeline import PipelineRuntime
    from .train.trace_recorder import Recorder

    torch = require_torch()
    dist, nn = torch.distributed, torch.nn
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = rank ^ 1
    schedule = make_schedule("1f1b", 2, microbatches)
    layers, width, rows = mlp

    class Stage(nn.Module):
        def __init__(self, last: bool):
            super().__init__()
            self.linear, self.body, self.last = nn.Linear(8, 8), gelu_mlp(layers, width), last
            self.rows = torch.full((rows, width), 0.01)

        def forward(self, x, targets=None):
            y = self.linear(x) + self.body(self.rows).mean()  # in the graph: the stage's backward runs the MLP's
            return y.square().mean() if self.last else y

    pp_rank, first = rank % 2, rank - rank % 2
    recorder = Recorder(rank)
    runtime = None
    if peer < world:
        runtime = PipelineRuntime(schedule, pp_rank, {pp_rank: Stage(pp_rank == 1)}, {0: first, 1: first + 1},
                                  rank, recorder, (4, 8), torch.float32, torch.device("cpu"))
    inputs = [torch.randn(4, 8) for _ in range(microbatches)]
    steps_run = []  # per step: its start on the host's clock, and this rank's events as (name, kind, start, end)
    for i in range(warmup + steps):
        dist.barrier()
        if runtime is None:
            continue
        recorder.start_step()
        runtime.run(inputs, [None] * microbatches)
        if i >= warmup:
            steps_run.append((recorder.origin_s, [(e.name, e.kind, e.start_s, e.end_s) for e in recorder.events]))
    every: list = [None] * world
    dist.all_gather_object(every, steps_run)  # each pair's events, to match its transfers
    if runtime is None:
        return None
    action, issue = split_gaps([events for _, events in every[rank] + every[peer]], by_event)
    late, waiting = transfer_times([(r, [on_host_clock(origin, events) for origin, events in every[r]])
                                    for r in (rank, peer)])
    typical = event_median if by_event else typical_step_mean
    return {"action": action, "issue": issue, "rendezvous": typical(late), "latency": typical(waiting)}


def split_gaps(steps: Sequence[Sequence[tuple[str, str, float, float]]], by_event: bool = False
               ) -> tuple[float, float]:
    """The loop's time (:func:`measure_pipeline_loop`) from steps of ``(name, kind, start, end)`` events, as a
    typical step has it (:func:`typical_step_mean`): the mean gap, from a step's start or an action's end to
    the next action, where no send was issued; and the mean excess per send of the gaps where sends were (the
    median over the steps that issued any; 0 if none did). A send's issue stalls now and then too.
    ``by_event``: as a typical gap has them instead (:func:`event_median`): the median gap without sends, and
    the median of each gap with sends' excess per send."""
    plain, with_sends = [], []  # per step: gaps without sends; (gap, sends issued in it)
    for events in steps:
        sends = sorted(start for _, kind, start, _ in events if kind == "send")
        reach = 0.0
        plain.append([])
        with_sends.append([])
        for _, _, start, end in sorted((e for e in events if e[1] != "send"), key=lambda e: e[2]):
            if start > reach:
                count = bisect.bisect_left(sends, start) - bisect.bisect_left(sends, reach)
                if count:
                    with_sends[-1].append((start - reach, count))
                else:
                    plain[-1].append(start - reach)
            reach = max(reach, end)
    if by_event:
        action = event_median(plain)
        issue = event_median([[(gap - action) / count for gap, count in gaps] for gaps in with_sends])
        return action, max(issue, 0.0)
    action = typical_step_mean(plain)
    issues = [(sum(gap for gap, _ in gaps) - action * len(gaps)) / sum(count for _, count in gaps)
              for gaps in with_sends if gaps]
    return action, max(statistics.median(issues), 0.0) if issues else 0.0


def on_host_clock(origin_s: float, events: Sequence[tuple[str, str, float, float]]
                  ) -> list[tuple[str, str, float, float]]:
    """A step's ``(name, kind, start, end)`` events, timed from its start, on the host's clock instead: the
    ranks' steps start up to a barrier's exit skew apart (milliseconds with ranks sharing a core)."""
    return [(name, kind, start + origin_s, end + origin_s) for name, kind, start, end in events]


def transfer_times(ranks: Sequence[tuple[int, Sequence[Sequence[tuple[str, str, float, float]]]]]
                   ) -> tuple[list[list[float]], list[list[float]]]:
    """Every pipeline transfer between these ranks, step by step, from ``(rank, steps)`` pairs (each step a
    list of ``(name, kind, start, end)`` events on the host's clock, :func:`on_host_clock`):
    ``(late, waiting)``, per step the times of those whose receive was posted after the send's issue (the
    receive's own time) and of those whose receiver waited (from the send's issue to the receive's end)."""
    late, waiting = [], []
    for step in zip(*(steps for _, steps in ranks)):
        events = [(rank, *event) for (rank, _), rank_events in zip(ranks, step) for event in rank_events]
        sent = {_transfer(rank, name, kind): start for rank, name, kind, start, _ in events if kind == "send"}
        late.append([])
        waiting.append([])
        for rank, name, kind, start, end in events:
            issued = sent.get(_transfer(rank, name, kind)) if kind == "recv" else None
            if issued is None:  # not a receive, or both stages on one rank: nothing moved
                continue
            if start < issued:
                waiting[-1].append(end - issued)
            else:
                late[-1].append(end - start)
    return late, waiting


def event_median(per_step: Sequence[Sequence[float]]) -> float:
    """A kind of time (a transfer's, a gap's) as a typical event has it: the median over every step's (0 if
    none had any). Stalls that hit a minority of the events do not count, however many steps they hit."""
    times = [t for step in per_step for t in step]
    return statistics.median(times) if times else 0.0


def typical_step_mean(per_step: Sequence[Sequence[float]]) -> float:
    """The mean of a kind of time (a transfer's, a gap's) in a typical step: each step's mean, the median over
    the steps that had any (0 if none did). A rare stall then counts as the typical step sees it, not at all,
    and stalls in most steps count in full."""
    means = [statistics.fmean(times) for times in per_step if times]
    return statistics.median(means) if means else 0.0


def _transfer(rank: int, name: str, kind: str) -> tuple[str, int, int]:
    """``send act stage=0 mb=3 peer=1`` on rank 0 and ``recv act stage=0 mb=3 peer=0`` on rank 1 are one
    transfer, ``("act stage=0 mb=3", 0, 1)``: what moved, from which rank to which (data-parallel replicas
    send the same names between other ranks)."""
    what, peer = name.split(" ", 1)[1].rsplit(" peer=", 1)
    return (what, rank, int(peer)) if kind == "send" else (what, int(peer), rank)
