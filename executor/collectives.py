"""Measure collectives on this machine the way nccl-tests does.

For each size, every rank allocates float32 buffers, runs warm-up iterations,
meets the others at a barrier, then runs timed iterations back to back and
waits for the device once at the end; then it runs the call once more on a
known pattern and counts the wrong elements of the result
(:mod:`executor.collective_buffers`, which also holds nccl-tests' two forms:
out-of-place and in-place). Each rank's time is its mean iteration
time; the reported time is the **maximum over ranks** of those means, because
a collective is not done until its slowest rank is (nccl-tests' ``-a 3``; its
default ``-a 1`` reports the mean over ranks, kept here as
``extra["time_s_mean"]`` next to ``extra["time_s_min"]``).

Sizes mean what they mean in nccl-tests and :mod:`parsim.report.results`: the whole
buffer for all-reduce, broadcast, reduce and send/recv; the total of all
ranks' chunks (``nranks x chunk``) for all-gather, reduce-scatter, gather,
scatter and all-to-all. A size is rounded down to whole float32 elements, and
for chunked operations to a multiple of ``nranks`` elements; the size measured
is the one reported (the request is kept in ``extra``).

Iteration counts adapt to the size: warm-up calls estimate the time of one
iteration (the slowest rank's estimate, so every rank runs the same count),
and the timed loop runs about ``target_time_s`` worth of iterations, at least
:data:`MIN_ITERS` and at most :data:`MAX_ITERS`.

Two single-process microbenchmarks, :func:`measure_reduce_bandwidth` and
:func:`measure_copy_bandwidth`, time the local steps inside collectives
(summing two buffers, copying one) for calibration.
"""

from __future__ import annotations

import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from parsim.errors import ParsimError
from parsim.report.results import CollectiveResult, canonical_op
from parsim.units import format_size

from ._torch import require_distributed, require_torch
from .collective_buffers import CHUNKED_OPS, ROOT, ROOTED_OPS, forms_of, make_buffers
from .launch import check_request, host_memory_bytes, in_torchrun_job, launch, rank_device, run_in_job

DTYPE_BYTES = 4  # float32, as nccl-tests' default -d float
DEFAULT_WARMUP = 5
DEFAULT_TARGET_TIME_S = 0.25
MIN_ITERS = 5
MAX_ITERS = 1000  # adaptive counts stop here; counts given by hand may go to MAX_GIVEN_ITERS
MAX_GIVEN_ITERS = 100_000
BUFFERS_PER_RANK = 4

# What ProcessGroupGloo (torch 2.13) runs on CPU tensors, read from
# torch/csrc/distributed/c10d/ProcessGroupGloo.cpp and gloo's allreduce.cc,
# allgather.cc, broadcast.cc, reduce.cc, gather.cc, scatter.cc, alltoall.cc.
GLOO_ALGORITHMS = {
    "all_reduce": "ring",
    "all_gather": "ring",
    "reduce_scatter": "ring all-reduce + local copy",
    "broadcast": "binomial tree",
    "reduce": "ring reduce-scatter + gather to root",
    "gather": "direct to root",
    "scatter": "direct from root",
    "all_to_all": "pairwise direct",
    "send_recv": "point-to-point",
}
# ProcessGroupGloo::_reduce_scatter_base all-reduces the whole input, then
# copies this rank's chunk out: it moves all-reduce traffic, not reduce-scatter's.
GLOO_REDUCE_SCATTER_NOTE = (
    "ProcessGroupGloo runs reduce_scatter_tensor as an all-reduce of the whole buffer "
    "followed by a copy of this rank's chunk, so it moves all-reduce traffic"
)
TIMING_RULE = "max over ranks of each rank's mean iteration time"
SEND_RECV_RULE = "one-way: half of a rank 0 -> 1 -> 0 round trip (max over ranks 0 and 1)"


@dataclass(frozen=True)
class BenchSpec:
    """What every rank measures; travels to the spawned ranks by pickle."""

    op: str
    sizes: tuple[tuple[int, int], ...]  # (requested bytes, measured bytes)
    warmup: int
    iters: int | None
    target_time_s: float
    progress: bool
    forms: tuple[str, ...]  # the first is the one each result's time_s reports

    @classmethod
    def build(cls, op: str, sizes: Sequence[int], nranks: int, *, warmup: int = DEFAULT_WARMUP,
              iters: int | None = None, target_time_s: float = DEFAULT_TARGET_TIME_S,
              progress: bool = False, both_forms: bool = False) -> "BenchSpec":
        """Check the request and round each size to what can be measured on ``nranks``.

        ``both_forms`` times in-place as well as out-of-place where torch.distributed has both.
        """
        op = canonical_op(op)
        if not 1 <= warmup <= MAX_GIVEN_ITERS:
            raise ParsimError(f"warm-up iterations must be 1 to {MAX_GIVEN_ITERS:,}, got {warmup}")
        if iters is not None and not 1 <= iters <= MAX_GIVEN_ITERS:
            raise ParsimError(f"timed iterations must be 1 to {MAX_GIVEN_ITERS:,}, got {iters}")
        if not sizes:
            raise ParsimError("no sizes to measure")
        fewest = 2 if op == "send_recv" else 1
        if nranks < fewest:
            raise ParsimError(f"{op.replace('_', '-')} needs at least {fewest} rank(s), got {nranks}")
        pairs = tuple((size, measured_size(op, size, nranks)) for size in sizes)
        forms = forms_of(op) if both_forms else forms_of(op)[:1]
        return cls(op, pairs, warmup, iters, target_time_s, progress, forms)


def measured_size(op: str, size_bytes: int, nranks: int) -> int:
    """The buffer size actually measured for a requested ``size_bytes``.

    Whole float32 elements; for chunked operations a multiple of ``nranks``
    of them, so every rank's chunk is the same size.
    """
    elements = size_bytes // DTYPE_BYTES
    if op in CHUNKED_OPS:
        elements -= elements % nranks
    if elements == 0:
        smallest = DTYPE_BYTES * (nranks if op in CHUNKED_OPS else 1)
        raise ParsimError(
            f"{op.replace('_', '-')} of {size_bytes} B on {nranks} ranks is below the smallest "
            f"measurable buffer ({smallest} B: one float32 element{' per rank' if op in CHUNKED_OPS else ''})"
        )
    return elements * DTYPE_BYTES


def check_host_memory(size: int, local_ranks: int) -> None:
    """Refuse a size whose buffers cannot fit in this host's memory: each rank holds up to
    ``BUFFERS_PER_RANK`` buffers of it (input, output, and the check's pattern and expected result)."""
    memory = host_memory_bytes()
    need = BUFFERS_PER_RANK * size * local_ranks
    if need > memory:
        raise ParsimError(f"{format_size(size)} on {local_ranks} ranks needs about {need / 1e9:.3g} GB of buffers; "
                          f"this host has {memory / 1e9:.3g} GB")


def default_timeout_s(sizes: Sequence[int]) -> float:
    """A whole-run budget generous enough for a sweep on slow CPUs: 60 s + 15 s per size."""
    return 60.0 + 15.0 * len(sizes)


def measure_collectives(op: str, sizes: Sequence[int], nproc: int | None, backend: str = "auto", *,
                        warmup: int = DEFAULT_WARMUP, iters: int | None = None,
                        target_time_s: float = DEFAULT_TARGET_TIME_S, timeout_s: float | None = None,
                        progress: bool = False, both_forms: bool = False) -> list[CollectiveResult]:
    """Measure ``op`` at each size on ``nproc`` ranks; one :class:`CollectiveResult` per size.

    Spawns ``nproc`` local ranks, or, inside a torchrun job, runs as this
    process's rank of it (``nproc`` must then be None or the job's size) and
    returns the same results on every rank. ``iters=None`` adapts the count
    to the size. ``progress`` prints "measuring ..." lines from rank 0 when stderr is a terminal. ``both_forms``
    measures in-place next to out-of-place, as nccl-tests does (each result's ``time_s`` is the
    first of :func:`~executor.collective_buffers.forms_of`; ``extra`` holds both).
    """
    if in_torchrun_job():
        world = int(os.environ["WORLD_SIZE"])
        if nproc is not None and nproc != world:
            raise ParsimError(f"--nproc {nproc} does not match this torchrun job's WORLD_SIZE {world}")
    elif nproc is None:
        raise ParsimError("how many ranks? (--nproc is missing)")
    else:
        world = nproc
    timeout_s = timeout_s if timeout_s is not None else default_timeout_s(sizes)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if in_torchrun_job() else world
    check_request(local, timeout_s)
    spec = BenchSpec.build(op, sizes, world, warmup=warmup, iters=iters, target_time_s=target_time_s,
                           progress=progress and sys.stderr.isatty(), both_forms=both_forms)
    check_host_memory(max(measured for _, measured in spec.sizes), local)
    if in_torchrun_job():
        return run_in_job(bench_rank, (spec,), backend, timeout_s)
    return launch(bench_rank, world, (spec,), backend, timeout_s)[0]


def algorithm_name(backend: str, op: str) -> str:
    """What the backend is known to run for ``op``; NCCL chooses at run time."""
    return GLOO_ALGORITHMS[op] if backend == "gloo" else "backend-default"


# ----------------------------------------------------------------------------- inside a rank


def bench_rank(rank: int, world: int, spec: BenchSpec) -> list[CollectiveResult]:
    """Measure every size of ``spec`` as one rank; all ranks return the same results.

    The body each rank runs under :func:`~executor.launch.launch` or
    :func:`~executor.launch.run_in_job`; call it directly to measure several
    operations in one process group.
    """
    device, backend = rank_device(), require_distributed().get_backend()
    results = []
    for index, (requested, size) in enumerate(spec.sizes, start=1):
        if spec.progress and rank == 0:
            print(f"measuring {spec.op.replace('_', '-')} {format_size(size)} ({index}/{len(spec.sizes)})",
                  file=sys.stderr, flush=True)
        forms = {}
        for form in spec.forms:
            buffers = make_buffers(spec.op, form, size // DTYPE_BYTES, rank, world, device)
            per_rank, iters = _time_step(buffers.run, spec, device)
            forms[form] = _Timing(per_rank, iters, _everyone(buffers.check(), device), buffers.api)
            del buffers  # free this form's buffers before allocating the next
        results.append(_result(spec.op, world, requested, size, forms, spec.warmup, backend, device))
    return results


@dataclass(frozen=True)
class _Timing:
    per_rank: list[float]  # each rank's mean seconds per iteration
    iters: int
    wrong: int  # wrong elements over every rank's output
    api: str


def _everyone(count: int, device: Any) -> int:
    """The sum of ``count`` over all ranks."""
    torch, dist = require_torch(), require_distributed()
    total = torch.tensor([float(count)], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return int(total.item())


def _time_step(step: Callable[[], None], spec: BenchSpec, device: Any) -> tuple[list[float], int]:
    """Every rank's mean seconds per iteration, and the iteration count they all ran."""
    torch, dist = require_torch(), require_distributed()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # The first call pays for connection set-up and page faults: it only
    # estimates the iteration time when it is the sole warm-up call.
    start = time.perf_counter()
    step()
    sync()
    mean = time.perf_counter() - start
    if spec.warmup > 1:
        start = time.perf_counter()
        for _ in range(spec.warmup - 1):
            step()
        sync()
        mean = (time.perf_counter() - start) / (spec.warmup - 1)
    iters = spec.iters
    if iters is None:
        # Agree on the slowest rank's estimate: every rank must run the same count.
        estimate = torch.tensor([mean], dtype=torch.float64, device=device)
        dist.all_reduce(estimate, op=dist.ReduceOp.MAX)
        iters = min(MAX_ITERS, max(MIN_ITERS, math.ceil(spec.target_time_s / max(estimate.item(), 1e-9))))
    dist.barrier(**({"device_ids": [device.index]} if device.type == "cuda" else {}))
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    mine = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [t.item() for t in everyone], iters


def _result(op: str, world: int, requested: int, size: int, forms: dict[str, _Timing], warmup: int,
            backend: str, device: Any) -> CollectiveResult:
    torch = require_torch()
    scale = 0.5 if op == "send_recv" else 1.0  # one way = half the round trip

    def seconds(t: _Timing) -> list[float]:
        return [x * scale for x in (t.per_rank[:2] if op == "send_recv" else t.per_rank)]  # ranks > 1 sit out

    form = next(iter(forms))
    main = forms[form]
    timed = seconds(main)
    extra: dict[str, Any] = {
        "requested_size_bytes": requested,
        "count": size // DTYPE_BYTES,
        "dtype": "float32",
        "warmup": warmup,
        "iters": main.iters,
        "timing": SEND_RECV_RULE if op == "send_recv" else TIMING_RULE,
        "time_s_min": min(timed),
        "time_s_mean": sum(timed) / len(timed),
        "time_s_max": max(timed),
        "per_rank_time_s": main.per_rank,
        "form": form,
        **{f: {"time_s": max(seconds(forms[f])), "iters": forms[f].iters, "wrong": forms[f].wrong}
           if f in forms else None for f in ("out_of_place", "in_place")},
        "wrong": sum(t.wrong for t in forms.values()),
        "api": f"torch.distributed.{main.api}",
        "device": str(device),
        "host": platform.node(),
        "torch": torch.__version__,
    }
    if op in ROOTED_OPS:
        extra["root"] = ROOT
    if backend == "gloo" and op == "reduce_scatter":
        extra["implementation"] = GLOO_REDUCE_SCATTER_NOTE
    if backend == "nccl" and os.environ.get("NCCL_ALGO"):
        extra["NCCL_ALGO"] = os.environ["NCCL_ALGO"]
    return CollectiveResult(op=op, nranks=world, size_bytes=size, time_s=max(timed),
                            algorithm=algorithm_name(backend, op), source="measured", backend=backend, extra=extra)


# ----------------------------------------------------------------------------- local microbenchmarks


def measure_reduce_bandwidth(sizes: Sequence[int], *, threads: int = 1, device: str = "cpu",
                             target_time_s: float = 0.1) -> list[tuple[int, float]]:
    """``(bytes, seconds)`` of ``a.add_(b)`` on float32 buffers of each size, in this process.

    This is the reduction step inside every reducing collective; ``bytes`` is
    the size of the reduced buffer ``a``, so its reduction speed is
    ``bytes / seconds``. ``threads=1`` matches a rank of :func:`measure_collectives`.
    """
    return _time_local(sizes, lambda a, b: a.add_(b), threads, device, target_time_s)


def measure_copy_bandwidth(sizes: Sequence[int], *, threads: int = 1, device: str = "cpu",
                           target_time_s: float = 0.1) -> list[tuple[int, float]]:
    """``(bytes, seconds)`` of ``b.copy_(a)`` on float32 buffers of each size: memory-copy speed."""
    return _time_local(sizes, lambda a, b: b.copy_(a), threads, device, target_time_s)


def _time_local(sizes: Sequence[int], op: Callable[[Any, Any], Any], threads: int, device: str,
                target_time_s: float) -> list[tuple[int, float]]:
    """Mean seconds of ``op(a, b)`` per size, with adaptive iteration counts."""
    torch = require_torch()
    dev = torch.device(device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = []
        for size in sizes:
            elements = max(1, size // DTYPE_BYTES)
            a = torch.zeros(elements, dtype=torch.float32, device=dev)
            b = torch.zeros(elements, dtype=torch.float32, device=dev)
            start = time.perf_counter()
            op(a, b)  # first touch of the pages, and the estimate
            sync()
            estimate = time.perf_counter() - start
            iters = min(MAX_ITERS * 10, max(MIN_ITERS, math.ceil(target_time_s / max(estimate, 1e-9))))
            start = time.perf_counter()
            for _ in range(iters):
                op(a, b)
            sync()
            rows.append((elements * DTYPE_BYTES, (time.perf_counter() - start) / iters))
        return rows
    finally:
        torch.set_num_threads(saved_threads)


# ----------------------------------------------------------------------------- calls inside a step
# Every doubling from 256 KiB to 4 MiB: the extra per call changes most around a core's cache (1-2 MiB on
# current CPUs), where calibrate reads it size by size (parsim.calibrate.host.fit_step_overhead).
IN_STEP_SIZES = tuple(2**k * 1024 for k in range(8, 13))
IN_STEP_CALLS = 30
IN_STEP_COMPUTE_S = 0.002
# Calls timed back to back right after each one issued after compute: the same call hot, in the same moment.
IN_STEP_HOT_CALLS = 3


def measure_in_step(ops: Sequence[str], nproc: int, sizes: Sequence[int] = IN_STEP_SIZES, *,
                    calls: int = IN_STEP_CALLS, compute_s: float = IN_STEP_COMPUTE_S,
                    hot_calls: int = IN_STEP_HOT_CALLS, timeout_s: float = 300.0) -> list[CollectiveResult]:
    """Collectives as a training step issues them: each call after a barrier and ``compute_s`` of
    matmuls on every rank, timed alone, then the same call ``hot_calls`` times back to back. One result per
    (op, size): the slowest rank's **mean** over ``calls`` calls after compute (stalls included, as they are in a
    step's sum), and in ``extra["back_to_back_s"]`` the slowest rank's mean of the hot calls that followed them.
    The two are timed a millisecond apart, so the host's slow spells, which add the same time to both (a spell
    adds time per byte moved: docs/calibration.md, "Collectives' slow spells"), fall out of their difference,
    what a call costs more after compute (threads asleep, cold buffers)."""
    ops = [canonical_op(op) for op in ops]
    rows = launch(_in_step_rank, nproc, (tuple(ops), tuple(sizes), calls, compute_s, hot_calls), "gloo", timeout_s)
    results = []
    for k, (op, size) in enumerate((op, size) for op in ops for size in sizes):
        after_compute, back_to_back = (max(rank_rows[k][i] for rank_rows in rows) for i in (0, 1))
        results.append(CollectiveResult(op=op, nranks=nproc, size_bytes=measured_size(op, size, nproc),
                                        time_s=after_compute, algorithm=algorithm_name("gloo", op),
                                        source="measured", backend="gloo",
                                        extra={"timing": "max over ranks of each rank's mean, one call after "
                                                         f"{compute_s * 1e3:g} ms of compute", "calls": calls,
                                               "back_to_back_s": back_to_back, "hot_calls": hot_calls}))
    return results


def _in_step_rank(rank: int, world: int, ops: tuple, sizes: tuple, calls: int, compute_s: float,
                  hot_calls: int) -> list[tuple[float, float]]:
    """Per (op, size): this rank's mean call after compute and mean hot call right after it."""
    torch, dist = require_torch(), require_distributed()
    a, b = torch.full((64, 256), 0.01), torch.full((256, 256), 0.01)
    means = []
    for op in ops:
        for size in sizes:
            step = make_buffers(op, forms_of(op)[0], measured_size(op, size, world) // DTYPE_BYTES, rank, world,
                                rank_device()).run
            after_compute, hot = [], []
            for call in range(calls + 3):
                dist.barrier()
                end = time.perf_counter() + compute_s
                while time.perf_counter() < end:
                    a @ b
                start = time.perf_counter()
                step()
                done = time.perf_counter()
                for _ in range(hot_calls):
                    step()
                if call >= 3:
                    after_compute.append(done - start)
                    hot.append((time.perf_counter() - done) / hot_calls)
            means.append((sum(after_compute) / calls, sum(hot) / calls))
    return means
