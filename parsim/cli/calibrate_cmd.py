"""``parsim calibrate``: fit a cluster file to the machine it runs on."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml

from ..calibrate.gpu import fit_gpu, gpu_cluster, gpu_payload, host_us
from ..calibrate.host import (COMPUTE_PROBES, core_cache_bytes, fit_alone_memory, fit_cache_hits, fit_core_arithmetic,
                              fit_dispatch, fit_elementwise, fit_fsdp_host, fit_links, fit_matmul,
                              fit_one_core_collective, fit_operation, fit_optimizer, fit_probe_elasticity,
                              fit_rank_jitter, fit_step_overhead, fit_tp_calls, fit_zero_grad, host_cluster,
                              probe_shape_seconds, step_overhead_us)
from ..calibrate.host_load import ForeignLoad
from ..calibrate.shared_pipeline import GenericSteps, fit_comm_stretch, generic_pipeline
from ..errors import ParsimError
from ..files import read_yaml
from ..hardware.cluster import Curve, SharedCoreCosts, builtin_clusters, builtin_for_gpu, load_cluster, parse_cluster
from ..lowering.lower import ADAMW_ACCESSES
from ..report.jsondoc import print_json
from ..report.results import CollectiveResult, canonical_op
from ..report.table import render_table
from ..sim.compute import at_length
from ..units import format_size, parse_size_range, size_unit, time_unit
from .common import check_outputs, note, progress

HELP = """\
Measure this host and write a cluster file the simulator loads like any other
(--cluster my-host.yaml), so that `parsim compare` holds parsim's predictions
against what this machine does. Nothing it runs is a plan parsim compares:
it times generic benchmarks and fits the simulator's own terms to them.

On CPUs (gloo), with the executor, on every rank at once:
  * collectives at several sizes, in 3 rounds -> the links' latency and
    bandwidth, each operation's own cost and efficiency, and what a call
    costs between bursts of compute;
  * compute -> matmul peak, shape efficiency and weight streaming, the
    weights' cache, memory speed, AdamW's costs, the fixed cost of an eager op
    and of a pass, elementwise bytes and a core's arithmetic per element;
  * the executor's own costs -> its pipeline loop, each send and transfer,
    tensor-parallel calls, FSDP2's hooks, zero_grad, the ranks' jitter;
  * with more ranks than cores (4 ranks on 2 cores) -> what sharing a core
    costs compute, transfers and collectives;
  * between the benchmarks, the host's speed (matmul, eager pass, memory and
    a collective probe), which `parsim compare` times again and follows.
Every figure, what measures it and the key it is written as:
docs/calibration.md, "Calibration" and "What calibrate measures, in full".
It prints each figure in words; --json gives the fit.

examples:
  parsim calibrate --out my-host.yaml
  parsim calibrate --out my-host.yaml --ranks 2,4 --sweep 64KiB:64MiB:4
  parsim calibrate --out my-gpu.yaml --ranks 1      (one GPU: its compute figures only)

With --ranks 1 on a host with a CUDA GPU, it times matmuls, causal attention
at 1k-16k tokens, memory-bound kernels and a fused AdamW step on that GPU, and
writes the built-in cluster with that GPU (dgx-h100 for an H100, ...) with its
compute figures replaced: matmul efficiency (the best shape, as MAMF), memory
efficiency, attention efficiency by length, SM cycles per element of the
kernels whose arithmetic counts (AdamW's per parameter), and the host's time
per eager op (generic blocks too small to keep the GPU busy) and per AdamW
tensor and step (steps over 1 and 64 small tensors). A GPU runs its kernels
while the host issues the next, so the host's time binds only small models.
One GPU measures no collective, so links and NCCL stay the spec sheets'
(--ops, --sweep and --backend do not apply).
"""

# Every collective the executor's plans issue: all-to-all for expert parallelism's dispatch and combine.
FIT_OPS = "all-reduce,send-recv,all-gather,reduce-scatter,broadcast,all-to-all"
# Rounds over every collective, each size fitted on its median: on the 2-core VM (2026-11-27) three runs of
# `parsim bench all-reduce --nproc 2 --sweep 64KiB:64MiB:4` back to back timed 64 MiB at 76.9, 81.5 and 100.0 ms,
# and one calibration's single round put the links a third under the others' (set BV in docs/calibration.md).
COLLECTIVE_ROUNDS = 3
PROBE_READINGS = 3  # the collective probe's readings each round (its median over every round's is kept)
# The matmul fit this far off the probe at the probe's own shape draws a note (calibrate.host.probe_shape_seconds).
PROBE_SHAPE_TOLERANCE = 0.1


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="measure this host and write a cluster file",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="my-host.yaml", help="cluster file to write (default my-host.yaml)")
    p.add_argument("--name", default="my-host", help="cluster name inside the file")
    p.add_argument("--ranks", default="2", help="comma-separated rank counts to measure (default 2; more "
                   "ranks than cores measure CPU contention, not links; 1: one GPU's compute)")
    p.add_argument("--ops", default=FIT_OPS, help=f"collectives to fit on (default {FIT_OPS})")
    p.add_argument("--sweep", default="64KiB:64MiB:4", help="sizes to measure (default 64KiB:64MiB:4)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    p.add_argument("--timeout", type=float, default=None, help="seconds before a stuck measurement is stopped")
    p.add_argument("--json", action="store_true", help="print the fit as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_outputs(args, files=("--out",))
    if not args.name.strip():
        raise ParsimError("--name: the cluster file needs a name")
    if args.ranks.strip() == "1":
        return _run_one_gpu(args)
    from executor.collectives import (DEFAULT_TARGET_TIME_S, check_host_memory, default_timeout_s, measure_collectives,
                                      measure_in_step, measure_reduce_bandwidth)
    from executor.compute_bench import (CACHE_SHAPE, measure_generic_pipeline, measure_on_every_rank,
                                        measure_on_shared_cores)
    from executor.launch import check_request, host_memory_bytes, resolve_backend, usable_cores
    from executor.speed_probe import SHAPE as PROBE_SHAPE
    from executor.speed_probe import measure_collective_probe, median_reading

    try:
        rank_counts = sorted({int(r) for r in args.ranks.split(",")})
    except ValueError:
        raise ParsimError(f"--ranks {args.ranks!r}: expected comma-separated whole numbers, e.g. 2,4") from None
    if rank_counts[0] < 2:
        raise ParsimError("--ranks: collectives need at least 2 ranks (--ranks 1 alone calibrates one GPU's compute)")
    ops = [canonical_op(o) for o in args.ops.split(",")]
    sizes = parse_size_range(args.sweep)
    check_request(max(rank_counts), args.timeout if args.timeout is not None else default_timeout_s(sizes))
    check_host_memory(sizes[-1], max(rank_counts))
    backend = resolve_backend(args.backend, max(rank_counts))

    with ForeignLoad() as load:
        progress("measuring reduction speed (a.add_(b))")
        reduce_bw = _rate(measure_reduce_bandwidth([2**20, 16 * 2**20, 64 * 2**20]))
        progress(f"measuring matmuls, eager ops and optimizer steps on {max(rank_counts)} ranks at once")
        per_rank = measure_on_every_rank(max(rank_counts))
        rounds, in_step_rounds, collective_probes = [], [], []
        in_step_ops = [op for op in ops if op != "send_recv"] if backend == "gloo" else []
        for i in range(COLLECTIVE_ROUNDS):
            rounds.append([])
            for n in rank_counts:
                for op in ops:
                    if op == "send_recv" and n > 2:
                        continue  # a point-to-point transfer always has 2 ranks
                    progress(f"measuring {op.replace('_', '-')} on {n} ranks over {len(sizes)} sizes "
                             f"(round {i + 1} of {COLLECTIVE_ROUNDS})")
                    rounds[-1] += measure_collectives(op, sizes, n, args.backend, timeout_s=args.timeout,
                                                      target_time_s=DEFAULT_TARGET_TIME_S / COLLECTIVE_ROUNDS)
            if backend == "gloo":  # the host's transfers have slow spells: how fast they ran this round
                progress(f"timing the collective probe (round {i + 1} of {COLLECTIVE_ROUNDS})")
                collective_probes.append(measure_collective_probe(PROBE_READINGS))
            if in_step_ops:  # each round's too: one round's means moved 2-3x with the stalls it caught
                progress(f"measuring {', '.join(o.replace('_', '-') for o in in_step_ops)} between bursts of "
                         f"compute (round {i + 1} of {COLLECTIVE_ROUNDS})")
                in_step_rounds.append(measure_in_step(in_step_ops, max(rank_counts)))
        results = median_rounds(rounds)
        collective_probe = (fits_probe(results, median_reading(sum(collective_probes, []))) if collective_probes
                            else None)
        shared_rows, generic = [], None
        if backend == "gloo":
            progress("measuring pipeline transfers and the loop between actions with two ranks on each core")
            shared_rows = measure_on_shared_cores()
            progress("running a generic 2-stage pipeline with a core per rank, then two replicas of it with two "
                     "ranks on each core, in rounds")
            generic_rounds = measure_generic_pipeline(generic_pipeline(1), generic_pipeline(2))
            generic = GenericSteps(tuple(generic_rounds)) if generic_rounds else None
        # Once more at the end: a host's speed drifts (other tenants), and the fits take both rounds.
        progress(f"measuring matmuls, eager ops and optimizer steps again on {max(rank_counts)} ranks")
        per_rank += measure_on_every_rank(max(rank_counts))
    if load.warning("calibration"):
        note(load.warning("calibration"))
    matmul = fit_matmul([(tuple(s), t) for rank in per_rank for s, t in rank["matmuls"]], call=True)
    matmul_cache = fit_cache_hits([tuple(row) for rank in per_rank for row in rank["cache_hits"]], matmul.stream_bw_Bps,
                                  CACHE_SHAPE)
    dispatch = fit_dispatch([row for rank in per_rank for row in rank["dispatch"]], matmul.model())
    elementwise_bw = fit_elementwise([rank["elementwise"] for rank in per_rank], dispatch)
    arithmetic = fit_core_arithmetic([row for rank in per_rank for row in rank["kernel_kinds"]], dispatch)
    tp_calls = fit_tp_calls([rank["tp_calls"] for rank in per_rank])
    zero_grad = fit_zero_grad([tuple(row) for rank in per_rank for row in rank["zero_grad"]])
    ranks = max(rank_counts)  # per_rank holds the ranks of each round in turn
    jitter = fit_rank_jitter([[rank["jitter"] for rank in per_rank[i:i + ranks] if rank.get("jitter")]
                              for i in range(0, len(per_rank), ranks)])
    fsdp = fit_fsdp_host([tuple(row) for rank in per_rank for row in rank.get("fsdp", ())])
    optimizer = fit_optimizer([tuple(row) for rank in per_rank for row in rank["optimizer"]["together"]],
                              ADAMW_ACCESSES)
    memory_bw = optimizer.bw_Bps  # each rank's, all streaming at once
    memory_alone_bw = fit_alone_memory([tuple(row) for rank in per_rank for row in rank["optimizer"]["alone"]],
                                       optimizer, ADAMW_ACCESSES)
    memory_host_bw = memory_bw * max(rank_counts)
    # the pipeline loop's figures by the stages' size; its gap with the largest stages where no step was timed
    p2p_issue, p2p_rendezvous, loop_gap = (_loop_curve(per_rank, key) or ((0, 0.0),)
                                           for key in ("issue", "rendezvous", "action"))
    p2p_latency = _loop_curve(per_rank, "latency")
    action_overhead = _step_gap_curve(per_rank, loop_gap[-1][1])
    probes = np.array([p for rank in per_rank for p in rank["speed_probes"]])
    probe_flops, probe_eager_s, probe_memory_Bps = (float(v) for v in np.median(probes, axis=0))
    probe_pairs = {probe: [tuple(pair) for rank in per_rank for pair in rank["probe_pairs"][probe]]
                   for probe in COMPUTE_PROBES}
    elasticity = {probe: fit_probe_elasticity(pairs) for probe, pairs in probe_pairs.items()}
    probe_m, probe_k, probe_n = PROBE_SHAPE
    probe_shape = (probe_m, probe_n, probe_k)
    fitted_probe_s, probe_s = probe_shape_seconds(matmul, probe_flops, probe_shape)
    if abs(fitted_probe_s / probe_s - 1) > PROBE_SHAPE_TOLERANCE:
        note(f"the matmul fit puts the probe's {_shape_text(probe_shape)} at {fitted_probe_s * 1e3:.2f} ms a "
             f"call, the probe read {probe_s * 1e3:.2f} ms: matmuls near that shape will be priced "
             f"{fitted_probe_s / probe_s - 1:+.0%} off (the sweep saw the host at another speed than the probe, or "
             f"the shape model misses it); calibrate again on a quieter host for a steadier fit")
    shared = _shared_cores(shared_rows, probe_flops, probe_eager_s)
    algorithms = _backend_algorithms(backend)
    link_ops = {"all_reduce", "send_recv"}
    # gloo on CPUs: buffers that stay in a core's cache move faster than ones streamed from memory
    cache_bytes = core_cache_bytes() if backend == "gloo" else 0
    links = fit_links([r for r in results if r.op in link_ops], algorithms, reduce_bw, cache_bytes)
    efficiency, overhead, cache_speedup, rows = {}, {}, {}, []
    for op in dict.fromkeys(r.op for r in results):
        fit = fit_operation([r for r in results if r.op == op], links, algorithms)
        overhead[op], efficiency[op] = fit.overhead_s, fit.efficiency
        if cache_bytes:
            cache_speedup[op] = fit.cache_speedup
        rows += fit.rows
        if fit.at_link_speed:
            note(f"{op.replace('_', '-')}: its times did not grow with size (stalls on a busy host?); its bytes "
                 f"are kept at link speed and only its fixed cost is fitted")

    mem_bytes = host_memory_bytes() / max(rank_counts)  # per rank
    cpu = platform.processor() or platform.machine()
    # Every rank of a local run shares this host, so one "node" holds as many as you may launch.
    ranks_per_host = max(8, os.cpu_count() or 1, *rank_counts)
    cluster = host_cluster(
        ranks_per_host, links.latency_s, links.bw_Bps, reduce_bw, fabric_bw_Bps=links.fabric_bw_Bps,
        name=args.name,
        description=f"{platform.node()}: {max(rank_counts)} {backend} ranks, calibrated "
                    f"{datetime.date.today().isoformat()}",
        cpu=f"CPU rank, 1 thread ({cpu})", peak_flops=matmul.peak_flops, mem_bw_Bps=memory_bw,
        mem_bytes=mem_bytes, algorithms=algorithms, efficiency=efficiency, overhead_s=overhead,
        cache_bytes=cache_bytes, cache_speedup=cache_speedup,
        matmul_half_dim=matmul.half_dim, op_forward_s=dispatch.forward_s, op_backward_s=dispatch.backward_s,
        pass_s=dispatch.pass_s, optimizer_tensor_s=optimizer.tensor_s, optimizer_step_s=optimizer.step_s,
        matmul_stream_bw_Bps=matmul.stream_bw_Bps, matmul_write_bw_Bps=matmul.write_bw_Bps, matmul_cache=matmul_cache,
        p2p_rendezvous_s=p2p_rendezvous, p2p_latency_s=p2p_latency, action_overhead_s=action_overhead,
        p2p_issue_s=p2p_issue,
        elementwise_bw_Bps=elementwise_bw,
        memory_alone_bw_Bps=memory_alone_bw, memory_host_bw_Bps=memory_host_bw, shared_cores=shared,
        cpu_cores=usable_cores() if backend == "gloo" else None,
        speed_probe=(probe_flops, probe_eager_s, probe_memory_Bps), elasticity=elasticity,
        collective_probe_s=collective_probe,
        core_arithmetic=arithmetic,
        tp_call_s=tp_calls, zero_grad=zero_grad, fsdp=fsdp, rank_jitter=jitter)
    if shared is not None and generic is not None:
        comm_stretch = fit_comm_stretch(parse_cluster(cluster, args.out), generic.ratio)
        shared = replace(shared, comm_stretch=comm_stretch)
        cluster["compute"]["shared_cores"] = shared.to_mapping()
    step_overhead = fit_step_overhead(in_step_rounds)
    if step_overhead:
        cluster["collective_step_overhead_us"] = step_overhead_us(step_overhead)
    parse_cluster(cluster, args.out)  # the file must load like any other
    header = (f"# Written by `parsim calibrate` on {platform.node()} ({datetime.datetime.now():%Y-%m-%d %H:%M}).\n"
              f"# Measured with torch.distributed/{backend}: {', '.join(ops)} on {rank_counts} ranks, "
              f"sizes {args.sweep};\n# median |fit error| {_median_error(rows):.1%} (collectives), "
              f"{matmul.median_abs_error:.1%} (matmuls). Scale-out figures are placeholders: one host.\n"
              + (f"# The generic pipeline (comm_stretch): {generic.text()}.\n" if generic else "")
              + (f"# Other processes kept {load.cores:.2f} cores busy meanwhile.\n" if load.cores is not None else ""))
    Path(args.out).write_text(header + yaml.safe_dump(cluster, sort_keys=False))

    if args.json:
        print_json("calibrate", {"out": args.out, "latency_us": links.latency_s * 1e6, "bw_GBps": links.bw_Bps / 1e9,
                    "fabric_bw_GBps": links.fabric_bw_Bps / 1e9 if links.fabric_bw_Bps else None,
                    "reduce_bw_GBps": reduce_bw / 1e9, "memory_bw_GBps": memory_bw / 1e9,
                    "memory_alone_bw_GBps": memory_alone_bw / 1e9, "memory_host_bw_GBps": memory_host_bw / 1e9,
                    "op_forward_us": dispatch.forward_s * 1e6, "op_backward_us": dispatch.backward_s * 1e6,
                    "pass_us": {"forward": dispatch.pass_s[0] * 1e6, "backward": dispatch.pass_s[1] * 1e6},
                    "optimizer_tensor_us": optimizer.tensor_s * 1e6, "optimizer_step_us": optimizer.step_s * 1e6,
                    "p2p_rendezvous_us": _by_kib_us(p2p_rendezvous),
                    "p2p_latency_us": _by_kib_us(p2p_latency) if p2p_latency is not None else None,
                    "action_overhead_us": _by_kib_us(action_overhead), "p2p_issue_us": _by_kib_us(p2p_issue),
                    "shared_cores": shared.to_mapping() if shared else None,
                    "generic_pipeline_step_ms": {"core_each": generic.core_each_s * 1e3,
                                                 "two_per_core": generic.two_per_core_s * 1e3,
                                                 "rounds": [[a * 1e3, b * 1e3] for a, b in generic.rounds],
                                                 "ratio": generic.ratio} if generic else None,
                    "elementwise_bw_GBps": elementwise_bw / 1e9, "core_ns_per_element": arithmetic.to_ns(),
                    "tp_collective_call_us": {"forward": tp_calls[0] * 1e6, "backward": tp_calls[1] * 1e6}
                    if tp_calls else None,
                    "zero_grad_step_us": zero_grad.step_s * 1e6, "zero_grad_tensor_us": zero_grad.tensor_s * 1e6,
                    "zero_grad_free_GBps": zero_grad.bw_Bps / 1e9,
                    "fsdp_unshard_us": fsdp.unshard_s * 1e6 if fsdp else None,
                    "fsdp_reduce_us": fsdp.reduce_s * 1e6 if fsdp else None,
                    "fsdp_optimizer_tensor_us": fsdp.tensor_s * 1e6 if fsdp else None,
                    "fsdp_pass_us": {"forward": fsdp.pass_s[0] * 1e6, "backward": fsdp.pass_s[1] * 1e6}
                    if fsdp and fsdp.pass_s else None,
                    "speed_probe_gflops": probe_flops / 1e9,
                    "speed_probe_eager_us": probe_eager_s * 1e6,
                    **{key: value for probe, pairs in probe_pairs.items()
                       for key, value in ((f"speed_probe_{probe}_elasticity", elasticity[probe]),
                                          (f"{probe}_probe_readings", len(pairs)))},
                    "speed_probe_memory_GBps": probe_memory_Bps / 1e9,
                    "collective_probe_us": {kib: s * 1e6 for kib, s in collective_probe} if collective_probe
                    else None, "rank_jitter": jitter,
                    "peak_tflops_fp32": matmul.peak_flops / 1e12, "matmul_half_dim": matmul.half_dim,
                    "matmul_stream_bw_GBps": matmul.stream_bw_Bps / 1e9 if matmul.stream_bw_Bps else None,
                    "matmul_write_bw_GBps": matmul.write_bw_Bps / 1e9 if matmul.write_bw_Bps else None,
                    "matmul_cached_stream_bw_GBps": matmul_cache.cached_bw_Bps / 1e9 if matmul_cache else None,
                    "matmul_cache_hits": dict(matmul_cache.hits) if matmul_cache else None,
                    "matmul_probe_shape_ms": {"shape": list(probe_shape), "fitted": fitted_probe_s * 1e3,
                                              "probe": probe_s * 1e3},
                    "collective_efficiency": efficiency,
                    "collective_cache_KiB": cache_bytes / 1024 if cache_speedup else None,
                    "collective_cache_speedup": cache_speedup or None,
                    "collective_overhead_us": {op: t * 1e6 for op, t in overhead.items()},
                    "collective_step_overhead_us": step_overhead_us(step_overhead),
                    "median_abs_error": _median_error(rows), "foreign_load_cores": load.cores,
                    "rows": [{"op": r.op, "nranks": r.nranks, "size_bytes": r.size_bytes, "measured_s": r.time_s,
                              "fitted_s": f} for r, f in rows]})
        return 0
    size, size_scale = size_unit(r.size_bytes for r, _ in rows)
    time, time_scale = time_unit([r.time_s for r, _ in rows] + [f for _, f in rows])
    table = [[r.op.replace("_", "-"), r.nranks, r.size_bytes / size_scale, r.time_s / time_scale, f / time_scale,
              f"{f / r.time_s - 1:+.1%}"] for r, f in rows]
    print(render_table(["op", "ranks", f"size ({size})", f"measured ({time})", f"fitted ({time})", "residual"], table,
                       title="collective fit (alpha-beta in the simulator's own terms)"))
    print()
    print(f"latency per step  {links.latency_s * 1e6:.1f} us")
    print(f"link bandwidth    {links.bw_Bps / 1e9:.3f} GB/s per direction")
    total = f"{links.fabric_bw_Bps / 1e9:.3f} GB/s" if links.fabric_bw_Bps else "not limiting"
    print(f"host total        {total} (all transfers at once)")
    print(f"reduction         {reduce_bw / 1e9:.2f} GB/s (a.add_(b), 1 thread)")
    print(f"memory            {memory_bw / 1e9:.2f} GB/s per rank with every rank streaming "
          f"({memory_host_bw / 1e9:.1f} GB/s in all), {memory_alone_bw / 1e9:.2f} GB/s for a rank alone, "
          f"{optimizer.step_s * 1e6:.0f} us per AdamW step and {optimizer.tensor_s * 1e6:.0f} us per tensor")
    print(f"per-op overhead   {dispatch.forward_s * 1e6:.1f} us forward, {dispatch.backward_s * 1e6:.1f} us backward, "
          f"and {dispatch.pass_s[0] * 1e6:.0f} / {dispatch.pass_s[1] * 1e6:.0f} us per forward / backward pass (eager "
          f"decoder layers in stacks of many and of one, every rank at once: a pass's first layer runs colder)")
    print(f"elementwise       {elementwise_bw / 1e9:.2f} GB/s (products, sums, a rotation: bytes-bound kernels, "
          f"their bytes as parsim.workload.model.Elementwise counts them)")
    ns = arithmetic.to_ns()
    print("core arithmetic   " + ", ".join(f"{kind} {ns[kind]['forward']:.2f} / {ns[kind]['backward']:.2f}"
                                          for kind in ns)
          + " ns per element forward / backward (each on its own; a kernel takes the longer of this and its bytes)")
    if tp_calls:
        print(f"tensor-parallel   {tp_calls[0] * 1e6:.0f} us forward, {tp_calls[1] * 1e6:.0f} us backward per "
              f"collective call beyond the collective (the executor's wrapper, right after a layer's matmul)")
    print(f"zero_grad         {zero_grad.step_s * 1e6:.0f} us per step and {zero_grad.tensor_s * 1e6:.1f} us per "
          f"tensor, freeing gradients at {zero_grad.bw_Bps / 1e9:.0f} GB/s (set_to_none, as a step starts)")
    if fsdp:
        print(f"fsdp2             {fsdp.unshard_s * 1e6:.0f} us per unit gathered and resharded, "
              f"{fsdp.reduce_s * 1e6:.0f} us per unit reduced, {fsdp.tensor_s * 1e6:.0f} us per DTensor "
              f"parameter in AdamW (its hooks and DTensor dispatch, no bytes moved)")
        if fsdp.pass_s:
            print(f"                  {fsdp.pass_s[0] * 1e6:.0f} us forward, {fsdp.pass_s[1] * 1e6:.0f} us backward "
                  f"per unit in a pass that gathers and reduces nothing (a pipeline's, between a stage's first "
                  f"and last)")
    if jitter:
        print(f"rank jitter       {jitter:.1%} of the same work's time, sigma from rank to rank (AdamW steps every "
              f"rank starts at once; a step ends when its slowest rank does)")
    print(f"p2p rendezvous    {_gap_text(p2p_rendezvous)} per pipeline transfer received late (its receive "
          f"posted after the send's issue; a typical transfer's, the median: stalls hit a few in a hundred)")
    if p2p_latency is not None:
        print(f"p2p latency       {_gap_text(p2p_latency)} per pipeline transfer whose receiver waits (from the "
              f"send's issue to the receive's end)")
    print(f"between actions   {_gap_text(action_overhead)} before each pass, sync call or optimizer step (a generic "
          f"data-parallel step's loop; it runs colder the more memory the step streams), {_gap_text(p2p_issue)} "
          f"more per send issued (the executor's loop on 2-stage pipelines of generic MLPs, as the transfers "
          f"above)")
    if shared is not None:
        print(f"2 ranks per core  {shared.p2p_latency_s * 1e6:.0f} us latency and {shared.p2p_rendezvous_s * 1e6:.0f} "
              f"us rendezvous per pipeline transfer, {shared.action_overhead_s * 1e6:.0f} us between actions, "
              f"{shared.p2p_issue_s * 1e6:.0f} us per send (runs with more ranks than cores)"
              + (f"; a matmul {shared.matmul_stretch:.2f}x and an eager pass {shared.eager_stretch:.2f}x as long as "
                 f"with a core each" if shared.matmul_stretch else ""))
    if shared is not None and shared.one_core_collective_bw_Bps is not None:
        print(f"1-core collective {shared.one_core_collective_latency_s * 1e6:.0f} us + bus bytes at "
              f"{shared.one_core_collective_bw_Bps / 1e9:.2f} GB/s between ranks on one core (an all-reduce whose "
              f"second rank calls it 3 ms late, 64 KiB to 4 MiB)")
    if shared is not None and shared.comm_stretch is not None:
        print(f"communicating     compute on a shared core {shared.comm_stretch:.2f}x as long again where its ranks "
              f"communicate (a generic 2-stage pipeline: {generic.text()}; the factor that makes the simulated "
              f"steps as many times apart)")
    stream = ""
    if matmul.stream_bw_Bps and matmul.write_bw_Bps:
        stream = (f", weights stream in at {matmul.stream_bw_Bps / 1e9:.1f} GB/s and outputs out at "
                  f"{matmul.write_bw_Bps / 1e9:.1f} GB/s")
    elif matmul.stream_bw_Bps:
        stream = f", weights stream in and outputs out at {matmul.stream_bw_Bps / 1e9:.1f} GB/s"
    print(f"matmul peak       {matmul.peak_flops / 1e9:.1f} GFLOP/s fp32, efficiency halves at dimension "
          f"{matmul.half_dim:.0f}{stream} (median |error| {matmul.median_abs_error:.1%})")
    if matmul_cache:
        print(f"matmul cache      weights read again at {matmul_cache.cached_bw_Bps / 1e9:.1f} GB/s from a core's "
              f"cache, the share it holds by the bytes touched since: "
              + ", ".join(f"{format_size(kib * 1024)} {hit:.0%}" for kib, hit in matmul_cache.hits))
    print(f"matmul check      the fit puts the matmul probe's {_shape_text(probe_shape)} at {fitted_probe_s * 1e3:.2f} "
          f"ms a call, the probe read {probe_s * 1e3:.2f} ms (x{fitted_probe_s / probe_s:.2f}; a model whose layers "
          f"run this shape is priced as the fit has it)")
    for op, e in efficiency.items():
        extra = f", {_between_compute(step_overhead[op])}" if op in step_overhead else ""
        cached = (f", {cache_speedup[op]:.2f}x as fast up to {format_size(cache_bytes)} (a core's L2)"
                  if op in cache_speedup else "")
        print(f"{op.replace('_', '-'):<17} {overhead[op] * 1e6:.0f} us per call{extra}, bytes at {e:.0%} of link "
              f"speed{cached}")
    print(f"median |residual| {_median_error(rows):.1%} over {len(rows)} measurements")
    print(f"host speed        {probe_flops / 1e9:.1f} GFLOP/s, {probe_eager_s * 1e6:.0f} us per eager pass, "
          f"{probe_memory_Bps / 1e9:.1f} GB/s memory (the probes timed between the compute benchmarks; "
          "`parsim compare` times them again and follows them)")
    print(f"probes followed   {_elasticity_text(elasticity, probe_pairs)}")
    if collective_probe:
        print(f"collective probe  {_probe_text(collective_probe)} (an all-reduce on 2 ranks: the sweep's, the speed "
              f"the fits describe; `parsim compare` times it again and moves the collectives by it)")
    print(f"wrote {args.out}: use it as --cluster {args.out}")
    return 0


def _shape_text(shape: tuple[int, int, int]) -> str:
    """A matmul's (m, n, k) as m x k x n: its input's rows and width, and its output's width."""
    m, n, k = shape
    return f"{m}x{k}x{n}"


def _elasticity_text(elasticity: dict[str, float | None], pairs: dict[str, list]) -> str:
    """How far the work each probe stands for followed it, for calibrate's output."""
    powers = ", ".join(f"{probe} " + ("all the way (too few readings or too little spread to fit)" if power is None
                                      else f"{power:.2f}") for probe, power in elasticity.items())
    readings = " / ".join(str(n) for n in sorted({len(p) for p in pairs.values()}))
    return (f"{powers} (how far a few matmuls, the eager layers' passes and AdamW over memory, each timed right "
            f"after a reading, followed it: log-log slopes over {readings} readings; 1: in step, 0: not at all): "
            f"`parsim compare` scales each work by its probe's ratio to that power")


def fits_probe(results: list[CollectiveResult], probed: Curve) -> Curve:
    """The collective probe as it would read at the speed the fits describe: at each of its sizes, the all-reduce
    the fits were made of there (2 ranks, back to back, its median round), else the probe's own median
    ``probed``. Timed once a round, the probe can catch another speed than the sweeps: FP's read 369, 848 and
    3095 us at 256 KiB, 1 MiB and 4 MiB (a slow spell) where its all-reduce sweep measured 250, 367 and 1839
    (docs/calibration.md, "Collectives' slow spells")."""
    swept = {r.size_bytes // 1024: r.time_s for r in results
             if r.op == "all_reduce" and r.nranks == 2 and r.size_bytes % 1024 == 0}
    return tuple((kib, swept.get(kib, seconds)) for kib, seconds in probed)


def median_rounds(rounds: list[list[CollectiveResult]]) -> list[CollectiveResult]:
    """One result per (operation, ranks, size) measured in every round: the round with the median time (of an
    even count, the faster middle one), in the first round's order."""
    by_key: dict[tuple[str, int, int], list[CollectiveResult]] = {}
    for results in rounds:
        for r in results:
            by_key.setdefault((r.op, r.nranks, r.size_bytes), []).append(r)
    return [sorted(found, key=lambda r: r.time_s)[(len(found) - 1) // 2] for found in by_key.values()]


def _step_gap_curve(rows: list[dict], loop_gap_s: float) -> tuple[tuple[int, float], ...]:
    """The loop's time before each action by the gradients a rank holds: (KiB, seconds), the median over ranks of
    a generic data-parallel step's gaps at each of its sizes (:func:`executor.compute_bench.measure_step_gap_curve`),
    where measured; else the pipeline loop's, ``loop_gap_s``, for every rank."""
    return _medians_by_size(row.get("step_gaps") or () for row in rows) or ((0, loop_gap_s),)


def _loop_curve(rows: list[dict], key: str) -> tuple[tuple[int, float], ...] | None:
    """One of the pipeline loop's figures (``key``: a send's issue, a late receive's rendezvous, a waiting one's
    latency, the loop's own gap before an action) by the gradients a rank holds: (KiB, seconds), the median over
    ranks at each of its sizes (:func:`executor.compute_bench.measure_pipeline_loops`); None where no loop ran. A
    loop that saw no such event (no receive posted late at that size, say) reads 0 and is left out: the sizes
    around it stand in."""
    return _medians_by_size(((nbytes, loop[key]) for nbytes, loop in row.get("pipeline") or () if loop and loop[key])
                            for row in rows) or None


def _by_kib_us(curve: tuple[tuple[int, float], ...]) -> dict[str, float]:
    """A host cost by the gradients a rank holds, for --json: microseconds keyed by KiB (strings, as JSON keys)."""
    return {str(kib): seconds * 1e6 for kib, seconds in curve}


def _medians_by_size(per_rank: Iterable[Iterable[tuple[int, float]]]) -> tuple[tuple[int, float], ...]:
    """Each rank's (bytes of gradients, seconds) readings as (KiB, the median over ranks) points, smallest first."""
    by_size: dict[int, list[float]] = {}
    for readings in per_rank:
        for nbytes, seconds in readings:
            by_size.setdefault(int(nbytes) // 1024, []).append(seconds)
    return tuple((kib, float(np.median(values))) for kib, values in sorted(by_size.items()))


def _gap_text(curve: tuple[tuple[int, float], ...]) -> str:
    """A loop's time by the gradients a rank holds, for people: one figure, or each size's."""
    if len(curve) == 1:
        return f"{curve[0][1] * 1e6:.0f} us"
    gaps = "/".join(f"{gap * 1e6:.0f}" for _, gap in curve)
    sizes = "/".join(f"{kib / 1024:g}" for kib, _ in curve)
    return f"{gaps} us at {sizes} MiB of gradients a rank"


def _step_gap(rows: list[dict], loop_gap_s: float) -> float:
    """The loop's time before each action: the median over ranks of a generic data-parallel step's gaps
    (:func:`executor.compute_bench.measure_step_gaps`), where measured; else the pipeline loop's, ``loop_gap_s``
    (measured between a pipeline's passes and receives)."""
    gaps = [row["step_gaps"] for row in rows if row.get("step_gaps") is not None]
    return float(np.median(gaps)) if gaps else loop_gap_s


def _shared_cores(rows: list[dict], probe_flops: float, probe_eager_s: float) -> SharedCoreCosts | None:
    """The medians over ranks of :func:`executor.compute_bench.measure_on_shared_cores`' figures (None: not run),
    and its probes with two ranks on each core against those with one rank per core: how many times as long a
    matmul and an eager pass take there (at least 1). The one-per-core probes are the same run's, taken in turn
    with the shared ones, where measured; else ``probe_flops`` and ``probe_eager_s``, the compute benchmarks'."""
    loops = [row["pipeline"] for row in rows if row["pipeline"] is not None]
    if not loops:
        return None
    costs = SharedCoreCosts(*(_median(loops, key) for key in ("rendezvous", "latency", "action", "issue")))
    costs = replace(costs, action_overhead_s=_step_gap(rows, costs.action_overhead_s))
    one_core = fit_one_core_collective([row["one_core_allreduce"] for row in rows if row.get("one_core_allreduce")])
    if one_core is not None:
        costs = replace(costs, one_core_collective_latency_s=one_core[0], one_core_collective_bw_Bps=one_core[1])
    probes = np.array([row["speed_probe"] for row in rows if row.get("speed_probe")])
    if not len(probes):
        return costs
    flops, eager_s = np.median(probes, axis=0)[:2]
    alone = np.array([row["speed_probe_alone"] for row in rows if row.get("speed_probe_alone")])
    if len(alone):
        probe_flops, probe_eager_s = np.median(alone, axis=0)[:2]
    return replace(costs, matmul_stretch=max(float(probe_flops / flops), 1.0),
                   eager_stretch=max(float(eager_s / probe_eager_s), 1.0))


def _median(loops: list[dict], key: str) -> float:
    """The median over ranks of one of :func:`executor.compute_bench.measure_pipeline_loop`'s figures (0: none)."""
    return float(np.median([loop[key] for loop in loops])) if loops else 0.0


def _run_one_gpu(args: argparse.Namespace) -> int:
    """``--ranks 1``: this GPU's compute figures, over the built-in cluster with that GPU."""
    from executor._torch import require_torch
    from executor.gpu_bench import calibration_rows

    torch = require_torch()
    if not torch.cuda.is_available():
        raise ParsimError("--ranks 1 calibrates one GPU's compute, and this host has no CUDA GPU; "
                          "a CPU host measures with 2 ranks or more")
    device_name = torch.cuda.get_device_name()
    base_name = builtin_for_gpu(device_name)
    spec = load_cluster(base_name)
    progress(f"timing matmuls, attention, memory-bound kernels and the host on the {device_name}")
    rows = calibration_rows(torch.device("cuda"), torch.bfloat16)
    fit = fit_gpu(rows, spec)
    description = (f"{platform.node()}: one {device_name}, compute calibrated {datetime.date.today().isoformat()} "
                   f"over {base_name}")
    cluster = gpu_cluster(read_yaml(builtin_clusters()[base_name]), fit, args.name, description)
    parse_cluster(cluster, args.out)  # the file must load like any other
    header = (f"# Written by `parsim calibrate --ranks 1` on {platform.node()} "
              f"({datetime.datetime.now():%Y-%m-%d %H:%M}): the compute figures\n# measured on one {device_name} "
              f"(torch {torch.__version__}); everything else is {base_name}'s, from its spec sheets.\n")
    Path(args.out).write_text(header + yaml.safe_dump(cluster, sort_keys=False))
    if args.json:
        print_json("calibrate.gpu", gpu_payload(args.out, device_name, base_name, fit, rows))
        return 0
    table = [["matmul_efficiency.bf16", spec.matmul_efficiency_for("bf16"), fit.matmul_efficiency],
             ["memory_efficiency", spec.memory_efficiency, fit.memory_efficiency]]
    for p, curve in zip(("forward", "backward"), spec.attention_efficiency):
        table += [[f"attention_efficiency.{p} at {seq:,}", at_length(curve, seq), f]
                  for seq, f in fit.attention[p].items()]
    if fit.sm_cycles is not None:  # SM cycles per element of the kernels their arithmetic may bound
        old, new = spec.sm_cycles, fit.sm_cycles
        table += [[f"sm_cycles.softmax at {row:,}", at_length(old.softmax, row), f] for row, f in new.softmax]
        table += [["sm_cycles.dropout", old.dropout, new.dropout]]
        table += [[f"sm_cycles.{kind} {p}", getattr(old, kind)[i], getattr(new, kind)[i]]
                  for kind in ("gelu", "norm") for i, p in enumerate(("forward", "backward"))]
        table += [["sm_cycles.bias_add", old.bias_add, new.bias_add], ["sm_cycles.adamw", old.adamw, new.adamw]]
    rows = [[n, f"{a:.3f}", f"{b:.3f}"] for n, a, b in table]
    base, mine = host_us(spec), host_us(fit)
    rows += [[f"{name}_us (host, µs)", f"{base[name]:.1f}", f"{mine[name]:.1f}"] for name in base]
    print(render_table(["figure", base_name, "measured"], rows,
                       title=f"{device_name}: compute figures (links and NCCL stay {base_name}'s)"))
    print(f"wrote {args.out}: use it as --cluster {args.out}")
    return 0


def _median_error(rows: list) -> float:
    return float(np.median([abs(f / r.time_s - 1) for r, f in rows]))


def _rate(rows: list[tuple[int, float]]) -> float:
    """Bytes per second over all sizes together."""
    return sum(b for b, _ in rows) / sum(t for _, t in rows)


def _backend_algorithms(backend: str) -> dict[str, str]:
    """What the backend runs, in the simulator's algorithm names (gloo's are fixed; NCCL's tuner picks)."""
    if backend != "gloo":
        return {}
    return {"all_reduce": "ring", "all_gather": "ring", "reduce_scatter": "via_all_reduce",
            "broadcast": "recursive", "reduce": "ring", "gather": "direct", "scatter": "direct",
            "all_to_all": "direct", "send_recv": "direct"}


def _probe_text(curve: Curve) -> str:
    """"245 us at 256 KiB, 370 at 1 MiB, 1600 at 4 MiB"."""
    return ", ".join(f"{s * 1e6:.0f}{' us' if i == 0 else ''} at {format_size(kib * 1024)}"
                     for i, (kib, s) in enumerate(curve))


def _between_compute(extra: Curve) -> str:
    """A call's extra cost between bursts of compute, size by size: "+172 us at 256 KiB, +0 at 4 MiB between
    compute"."""
    parts = [f"+{s * 1e6:.0f}" + (" us" if i == 0 else "") + (f" at {format_size(kib * 1024)}" if kib else "")
             for i, (kib, s) in enumerate(extra)]
    return ", ".join(parts) + " between compute"
