"""``parsim search``: every parallelism plan of a model on some GPUs, ranked; the best simulated."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys

from ..errors import ParsimError
from ..hardware.cluster import load_cluster
from ..report.jsondoc import print_json
from ..search.search import SORTS, SearchRequest, run_search
from ..units import parse_size
from ..workload.model import Model, TransformerModel, builtin_models, load_model
from ..workload.plan import ADAMW_IMPLEMENTATIONS, DEFAULT_ADAMW, DISPATCHERS, DTYPE_BYTES, REDUCE_DTYPES
from .common import DEFAULT_CLUSTER, OpsProgress, check_outputs, note, note_unmeasured_matmuls

HELP = """\
Search every parallelism plan the simulator can express for a model on some
GPUs -- dp, tp, pp, cp, ep, virtual stages, the layers split evenly or
balanced for the embedding's and head's work, microbatch size and count,
schedule, ZeRO stage or FSDP, recomputation (whole layers, all or as few as
fit, or for a mixture of experts or latent attention the cheap modules, as
DeepSeek-V3), sequence
parallelism (its collectives in line or overlapped with the GEMMs, within a
node), placement, and for a mixture of experts its all-to-alls beside a paired
pass's compute (combined 1F1B, DualPipe-V's overlap) -- drop those that do
not fit in memory (counted by reason), rank the rest with a fast analytical
tier built on the simulator's own costs, and run the best through the event
simulation. The table marks which figures are simulated and
how far the fast tier was from them; every row prints a `parsim simulate`
command (or, with --save-plans, a plan file) that re-runs it. ZeRO-1/2 plans
run as Megatron-LM's distributed optimizer does in NVIDIA's recipes, the
weights' all-gather overlapped with the next forward (--overlap-param-gather).

The fast tier prices each plan's passes, pipeline schedule, gradient sync and
optimizer as the simulator does; contention between overlapping collectives
is left out, except a context-parallel exchange or a pipeline send slowed by
the FSDP gather beside it. How it compares: docs/search.md.

examples:
  parsim search --model llama3-70b --gpus 1024 --global-batch 4M-tokens
  parsim search --model llama3-8b --gpus 8,64 --global-batch 1M-tokens --tokens 15T --explain
  parsim search --model llama3-70b --gpus 256,512,1024 --global-batch 512 --sort cost --plot front.png
  parsim search --model llama3-70b --gpus 1024 --tp 8 --pp 2,4,8      # only Megatron-style layouts
  parsim search --model deepseek-v3 --gpus 2048 --cluster hgx-h800 --global-batch 15360 --dtype fp8 \\
      --dispatch-fp8 --dispatcher deepep --dp 128 --pp 16 --ep 64 --tp 1 --cp 1   # DeepSeek-V3's degrees
  parsim search --model llama3-405b --gpus 16384 --global-batch 16M-tokens --max-memory 75GB --json
"""

DEGREES = {"dp": "data-parallel", "tp": "tensor-parallel", "pp": "pipeline-parallel", "cp": "context-parallel",
           "ep": "expert-parallel"}
_TOKENS = re.compile(r"^\s*(.+?)\s*-?\s*tok(en)?s?\s*$", re.IGNORECASE)
_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*$")
_DECIMAL = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def register(subparsers) -> None:
    p = subparsers.add_parser("search", help="search every plan of a model on some GPUs: ranked, best simulated",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="NAME|FILE",
                   help=f"model preset ({', '.join(sorted(builtin_models()))}) or a model YAML file")
    p.add_argument("--cluster", default=DEFAULT_CLUSTER, metavar="NAME|FILE", help="cluster (default dgx-h100)")
    p.add_argument("--gpus", required=True, metavar="N[,N...]", help="GPU count, or several to compare (whole nodes)")
    p.add_argument("--global-batch", metavar="SEQUENCES|TOKENS",
                   help="samples per step (512), or tokens (4M-tokens: K, M, G are powers of two, as papers count "
                        "batches); default: the model's batch (MLP) or 4M tokens")
    p.add_argument("--seq", type=int, metavar="N", help="sequence length (default: the model's)")
    p.add_argument("--dtype", choices=tuple(DTYPE_BYTES),
                   help="compute precision (default: the model's, as it was trained: bf16 for Llama 3, fp8 for "
                        "DeepSeek-V3)")
    p.add_argument("--adamw", choices=ADAMW_IMPLEMENTATIONS, default=DEFAULT_ADAMW,
                   help="AdamW's implementation in every plan: foreach (torch's default) or fused (torch's "
                        "fused=True, torchtitan's default; Apex's and TE's FusedAdam)")
    p.add_argument("--grad-clip", type=float, metavar="NORM",
                   help="every plan clips its gradients to this global L2 norm before its optimizer step (torch's "
                        "clip_grad_norm_, Megatron-LM's --clip-grad; default: no clipping)")
    p.add_argument("--reduce-dtype", choices=REDUCE_DTYPES,
                   help="the dtype every plan reduces gradients in (default fp32 with bf16 or fp8 weights, as "
                        "Megatron-LM and torchtitan do; else the weights' dtype)")
    p.add_argument("--dispatcher", choices=DISPATCHERS, default="alltoall",
                   help="MoE: how every plan with expert parallelism sends tokens to their experts: alltoall, a copy "
                        "per expert (Megatron-LM's default), or deepep, a copy per node across the network, then "
                        "NVLink (DeepEP)")
    p.add_argument("--dispatch-fp8", action="store_true",
                   help="MoE, --dtype fp8: every plan with expert parallelism sends the tokens to their experts, and "
                        "the gradients back to the experts' down-projections, in fp8, as DeepSeek-V3 does (half "
                        "the all-to-all bytes of bf16; default: in the activations' dtype)")
    p.add_argument("--expert-load", type=float, default=1.0, metavar="X",
                   help="MoE: the busiest expert's tokens over the mean in every plan (default 1: balanced); its "
                        "rank computes, keeps and moves its extra rows, and the others wait for it")
    for dim, what in DEGREES.items():
        p.add_argument(f"--{dim}", metavar="N[,N...]", help=f"search only these {what} degrees (default: all)")
    p.add_argument("--max-memory", metavar="SIZE", help="memory a plan may use per GPU, e.g. 75GB (default: all)")
    p.add_argument("--price-per-gpu-hour", type=float, metavar="USD",
                   help="US dollars per GPU-hour (default: the cluster file's, an example rate)")
    p.add_argument("--tokens", metavar="N", help="tokens to train on, e.g. 15T (decimal K, M, B, T): days and cost")
    p.add_argument("--sort", choices=SORTS, default="time",
                   help="rank by step time (= days to train), cost (= $ per token; and MFU per GPU-second), mfu, "
                        "or memory (default time)")
    p.add_argument("--top", type=int, default=10, metavar="N", help="rows shown (default 10)")
    p.add_argument("--simulate", type=int, default=10, metavar="N",
                   help="best plans run through the event simulation (default 10; 0: fast tier only)")
    p.add_argument("--explain", action="store_true", help="why the winner beats the runner-up, phase by phase")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--plot", metavar="PNG", help="draw the Pareto front of step time, memory and cost")
    p.add_argument("--save-plans", metavar="DIR", help="write each shown row as a plan file parsim simulate reads")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_outputs(args, pictures=("--plot",), folders=("--save-plans",))
    request = request_from_args(args)
    progress = _Progress()
    try:
        result = run_search(request, progress)
    finally:
        progress.close()
    note_unmeasured_matmuls("search", request.cluster, request.dtype)
    from ..search import report as rep

    rows = result.ranked[:args.top]
    files = rep.save_plans(result, rows, args.save_plans) if args.save_plans else [None] * len(rows)
    commands = [rep.command(result, r, f) for r, f in zip(rows, files)]
    if args.json:
        print_json("search", rep.to_json(result, rows, commands))
    else:
        print(rep.report(result, commands, args.top))
        if args.explain:
            print()
            print(rep.explain(result))
    drawn = args.plot and result.estimated_plans
    if drawn:
        from ..search.plot import plot_front

        plot_front(result, args.plot)
    elif args.plot:
        note(f"--plot: no plan to draw; {args.plot} not written")
    written = [f"wrote {args.plot}"] if drawn else []
    written += [f"wrote {len(files)} plan files to {args.save_plans}"] if args.save_plans else []
    for line in written:
        print(line, file=sys.stderr if args.json else sys.stdout)
    return 0


def request_from_args(args: argparse.Namespace) -> SearchRequest:
    cluster = load_cluster(args.cluster)
    model = load_model(args.model)
    spec = args.model
    if args.seq is not None:
        if not isinstance(model, TransformerModel):
            raise ParsimError(f"--seq: model {model.name} ({model.kind}) has no sequence")
        if args.seq < 1:
            raise ParsimError(f"--seq {args.seq}: a sequence needs at least one token")
        model = dataclasses.replace(model, seq_len=args.seq)
        spec = model.to_dict()  # plan files then carry the model inline
    gpus = _gpus(args.gpus, cluster)
    degrees = _degrees(args)
    _check_degrees(degrees, gpus, model)
    if args.top < 1:  # no rows shown would print empty tables and exit 0, as if the search found nothing
        raise ParsimError(f"--top {args.top}: give a count >= 1 (the rows shown)")
    if args.simulate < 0:  # (0 is meaningful: the fast tier alone)
        raise ParsimError(f"--simulate {args.simulate}: give a count >= 0")
    if args.price_per_gpu_hour is not None and not (math.isfinite(args.price_per_gpu_hour)
                                                    and args.price_per_gpu_hour > 0):
        raise ParsimError(f"--price-per-gpu-hour {args.price_per_gpu_hour}: give a positive number of US dollars")
    max_memory = None
    if args.max_memory is not None:
        max_memory = parse_size(args.max_memory)
        if not max_memory:
            raise ParsimError(f"--max-memory {args.max_memory!r}: give a size such as 75GB")
    return SearchRequest(model, spec, cluster, gpus, _global_batch(args.global_batch, model), args.dtype or model.dtype,
                         max_memory,
                         args.price_per_gpu_hour, None if args.tokens is None else parse_count(args.tokens, "--tokens"),
                         args.sort, keep=max(50, args.top, args.simulate), simulate=args.simulate,
                         degrees=degrees, adamw=args.adamw, reduce_dtype=args.reduce_dtype,
                         grad_clip=args.grad_clip, dispatcher=args.dispatcher,
                         dispatch_fp8=args.dispatch_fp8, expert_load=args.expert_load)


def _degrees(args: argparse.Namespace) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``--tp 8 --pp 2,4`` as ``(("tp", (8,)), ("pp", (2, 4)))``."""
    out = []
    for dim in DEGREES:
        text = getattr(args, dim)
        if text is None:
            continue
        try:
            values = tuple(sorted({int(part) for part in str(text).split(",")}))
        except ValueError:
            raise ParsimError(f"--{dim} {text!r}: give whole numbers separated by commas, e.g. 2,4,8") from None
        if not values or values[0] < 1:
            raise ParsimError(f"--{dim} {text!r}: degrees are positive")
        out.append((dim, values))
    return tuple(out)


def _check_degrees(degrees: tuple[tuple[str, tuple[int, ...]], ...], gpus: tuple[int, ...], model: Model) -> None:
    """Refuse a degree no plan can have: ``dp x tp x pp x cp`` is the GPU count, so each divides it (and ``ep``,
    which groups data-parallel ranks, too); expert parallelism needs experts."""
    for dim, values in degrees:
        if dim == "ep" and values != (1,) and not getattr(model, "is_moe", False):
            raise ParsimError(f"--ep {','.join(map(str, values))}: {model.name} is a dense model, with no experts "
                              f"to spread over ranks")
        impossible = [v for v in values if not any(n % v == 0 for n in gpus)]
        if impossible:
            counts = " or ".join(f"{n:,}" for n in gpus)
            raise ParsimError(f"--{dim} {','.join(map(str, impossible))}: no plan of {counts} GPUs has it (dp x tp "
                              f"x pp x cp is the GPU count, so each degree divides it)")


def _gpus(text: str, cluster) -> tuple[int, ...]:
    counts = []
    for part in str(text).split(","):
        try:
            n = int(part)
        except ValueError:
            raise ParsimError(f"--gpus {text!r}: give whole numbers separated by commas, e.g. 256,512,1024") from None
        cluster.nodes_for(gpus=n)  # whole nodes, at least one GPU
        counts.append(n)
    return tuple(dict.fromkeys(counts))


def _global_batch(text: str | None, model) -> int:
    """Samples per step from ``512`` or ``4M-tokens`` (default 4M tokens, or an MLP model's own batch)."""
    per_sample = model.tokens_per_sample
    given = text is not None
    if text is None:
        if per_sample == 1:
            return model.batch_size
        text = "4M-tokens"
    match = _TOKENS.match(text)
    if match:
        try:
            tokens = parse_size(match.group(1))  # K, M, G as powers of two, as papers count batches
        except ParsimError:  # (its message speaks of bytes)
            raise ParsimError(f"--global-batch {text!r}: give a whole number of tokens, e.g. 4M-tokens") from None
        if tokens % per_sample or not tokens:
            raise ParsimError(f"{'' if given else 'the default '}--global-batch {text}: {tokens:,} tokens is not a "
                              f"whole number of {per_sample:,}-token sequences"
                              f"{'' if given else '; give --global-batch in sequences or tokens'}")
        return tokens // per_sample
    try:
        samples = int(text)
    except ValueError:
        raise ParsimError(f"--global-batch {text!r}: give sequences (512) or tokens (4M-tokens)") from None
    if samples < 1:
        raise ParsimError(f"--global-batch {text}: give at least one sequence")
    return samples


def parse_count(text: str, flag: str) -> float:
    """``15T`` -> 1.5e13 (decimal K, M, B or G, T), ``2.5e12`` as written."""
    match = _COUNT.match(str(text))
    if not match:
        raise ParsimError(f"{flag} {text!r}: give a count such as 15T, 300B or 2.5e12")
    value = float(match.group(1)) * _DECIMAL[match.group(2).upper()]
    if not 0 < value < math.inf:  # 1e400 is inf, which would print "days inf"
        raise ParsimError(f"{flag} {text!r}: give a finite, positive count")
    return value


class _Progress(OpsProgress):
    """``search: estimating 45%`` redrawn on a terminal's stderr; silent elsewhere."""

    def __call__(self, stage: str, done: float) -> None:  # type: ignore[override]
        self.show(f"search: {stage} {done:.0%}")
