"""The GPU kernel model against this machine's GPU, kernel by kernel.

Takes the kernels one plan's layer and head launch in a forward and a backward
(:func:`parsim.kernels.block_work`, what ``parsim explain compute`` prints),
runs each kind on this GPU with torch, and sets the time beside what the
cluster file's kernel model predicts (:class:`parsim.compute.ComputeModel`):

* every distinct matmul shape, as ``a[m, k] @ b[k, n]`` in the plan's dtype
  with the operand layouts ``nn.Linear`` uses, and the 8192 x 8192 x 8192
  shape the MAMF figures come from;
* the attention core, ``F.scaled_dot_product_attention`` with torch's
  default backend (what the executor runs) and with FlashAttention-2 and
  cuDNN alone: the forward, and forward + backward less the forward, at the
  FLOPs the model counts (causal tiles skipped); the default backend also at
  1k to 16k tokens per sequence (the model's efficiency varies by length);
* memory-bound kernels on 1 GiB tensors (copy, add, multiply, SiLU), at the
  bytes each reads and writes;
* a stream of tiny kernels: the GPU time per kernel and the host's time to
  issue one (eager PyTorch), beside the cluster's ``kernel_overhead_us``.

Nothing is fitted: the cluster file is only read. Times are CUDA-event means
after warm-up. Needs a CUDA GPU; on a CPU it runs (slowly, with wall-clock
timing) only so the script itself can be checked.

Run:  python benchmarks/gpu_kernels.py                      (cluster from the GPU's name)
      python benchmarks/gpu_kernels.py --cluster dgx-h100 --json kernels.json
      python benchmarks/gpu_kernels.py --measured benchmarks/gpu/h100-kernels-2026-11-26.json   (no GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from parsim.cluster import ClusterSpec, load_cluster
from parsim.compute import ComputeModel
from parsim.kernels import block_work
from parsim.errors import ParsimError
from parsim.model import AttentionCore, TransformerModel, flash_softmax_factor
from parsim.plan import DTYPE_BYTES, load_plan
from parsim.table import render_table

DEFAULT_PLAN = Path(__file__).parent / "gpu" / "one-gpu-step.yaml"
CLUSTER_BY_GPU = (("H200", "dgx-h200"), ("H100", "dgx-h100"), ("A100", "dgx-a100"), ("B200", "dgx-b200"))
MAMF_SHAPE = (8192, 8192, 8192)
MEMORY_ELEMENTS = 1 << 29  # 1 GiB of bf16 per operand
ATTENTION_LENGTHS = (1024, 2048, 4096, 8192, 16384)  # the default backend's, beside the plan's own (GPU only)


def timed(fn, device: torch.device, min_s: float = 0.05, max_iters: int = 200) -> float:
    """Mean seconds per call of ``fn`` after three warm-up calls, over at least ``min_s`` of calls."""
    for _ in range(3):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    iters = int(min(max_iters, max(3, min_s / max(time.perf_counter() - start, 1e-9))))
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / iters
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def row(kind: str, what: str, measured: float, work: dict, **extra) -> dict:
    """One measured kernel and the work the model prices for it (:func:`predict`)."""
    return {"kind": kind, "what": what, "measured_s": measured, "work": work, **extra}


def predict(r: dict, spec: ClusterSpec, dtype: str) -> float:
    """The kernel model's seconds for a measured row's work on ``spec``'s GPU."""
    work = r["work"]
    model = ComputeModel.for_cluster(spec, dtype, DTYPE_BYTES[dtype], attention_seq=work.get("seq", 0))
    if r["kind"] == "matmul":
        return model.matmul_time(*work["mnk"])
    if r["kind"] == "attention":
        forward, backward = model.attention_efficiency
        return work["flops"] / ((forward if work["pass"] == "forward" else backward) * model.peak_flops)
    if r["kind"] == "memory":
        return work["bytes"] / model.memory_bw_Bps
    return work["kernels"] * model.kernel_overhead_s


def matmul_rows(plan, dtype, device) -> list[dict]:
    """Every distinct matmul of the plan's layer and head, forward and backward, and the MAMF shape."""
    costs = {c.name: c for c in plan.stage_costs(plan.num_stages - 1) + plan.stage_costs(0)}
    # The shape the MAMF figures come from; hours on a CPU core, so only on a GPU.
    shapes: dict[tuple[int, int, int], tuple[str, str]] = {MAMF_SHAPE: ("MAMF shape", "dgrad")} \
        if device.type == "cuda" else {}
    for name in ("layer.0", "head"):
        for block in costs[name].blocks if name in costs else ():
            for kind in ("F", "B"):
                work = block_work(plan, block, kind, plan.tokens_per_rank)
                for shape, label, (_, role) in zip(work.matmuls, work.labels, work.sources):
                    shapes.setdefault(shape, (label, role))
    rows = []
    for (m, n, k), (label, role) in shapes.items():
        a, b = operands(m, n, k, role, dtype, device)
        seconds = timed(lambda: torch.matmul(a, b), device)
        rows.append(row("matmul", label, seconds, {"mnk": [m, n, k]}, shape=f"{m}x{n}x{k}",
                        tflops=2 * m * n * k / seconds / 1e12))
    return rows


def operands(m: int, n: int, k: int, role: str, dtype, device) -> tuple:
    """``a[m, k]`` and ``b[k, n]`` laid out as ``nn.Linear`` hands them to cuBLAS: the forward multiplies
    by the transposed weight ``W[n, k]ᵀ``, the input gradient by ``W`` as stored, and the weight gradient
    is ``dYᵀ X``, its first operand a transposed activation."""
    a = torch.randn(k, m, device=device, dtype=dtype).t() if role == "wgrad" else \
        torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(n, k, device=device, dtype=dtype).t() if role == "fwd" else \
        torch.randn(k, n, device=device, dtype=dtype)
    return a, b


def attention_flops(batch: int, seq: int, heads: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention as the model counts them (:func:`parsim.kernels.block_work`):
    ``4·s·d`` per token and head over the tiles executed; the backward is twice that."""
    core = AttentionCore(heads, head_dim, seq)
    return 4.0 * batch * seq * seq * heads * head_dim * core.executed_fraction() * flash_softmax_factor(head_dim)


def attention_rows(plan, dtype, device, lengths: tuple[int, ...] = ATTENTION_LENGTHS) -> list[dict]:
    """The attention core as the executor runs it (causal SDPA, torch's default backend), forward and
    backward, at the plan's shape; on a GPU also each of SDPA's fused backends alone (FlashAttention-2,
    cuDNN) there, and the default backend at other ``lengths`` with as many tokens in all."""
    m = plan.model
    batch, seq = plan.microbatch_size, m.seq_len
    backends = {"default": None}
    if device.type == "cuda":
        backends |= {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    rows = []
    for name, backend in backends.items():
        rows += attention_at(name, backend, batch, seq, m.num_heads, m.head_dim, dtype, device)
    for length in lengths:
        if length != seq:
            rows += attention_at("default", None, max(1, batch * seq // length), length, m.num_heads, m.head_dim,
                                 dtype, device)
    return rows


def attention_at(name: str, backend, batch: int, seq: int, heads: int, head_dim: int, dtype, device) -> list[dict]:
    """Causal SDPA on ``backend`` (None: torch's choice): forward, and forward + backward less it."""
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd():
        torch.autograd.grad(fwd(), (q, k, v), grad)

    try:
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            t_fwd, t_both = timed(fwd, device), timed(fwd_bwd, device)
    except RuntimeError as error:  # this backend does not take these inputs on this GPU
        print(f"attention, {name}: not run ({str(error).splitlines()[0][:120]})")
        return []
    forward = attention_flops(batch, seq, heads, head_dim)
    what = f"{name}, b{batch} h{heads} s{seq} d{head_dim} causal"
    return [row("attention", f"{what}, forward", t_fwd, {"flops": forward, "pass": "forward", "seq": seq},
                tflops=forward / t_fwd / 1e12),
            row("attention", f"{what}, backward", t_both - t_fwd,
                {"flops": 2 * forward, "pass": "backward", "seq": seq}, tflops=2 * forward / (t_both - t_fwd) / 1e12)]


def memory_rows(dtype, device, elements: int = MEMORY_ELEMENTS) -> list[dict]:
    """Memory-bound kernels at the bytes they read and write, against HBM x memory_efficiency."""
    x, y = torch.randn(elements, device=device, dtype=dtype), torch.randn(elements, device=device, dtype=dtype)
    out = torch.empty_like(x)
    size = x.element_size() * elements
    kernels = {
        "copy (read 1, write 1)": (lambda: out.copy_(x), 2),
        "add (read 2, write 1)": (lambda: torch.add(x, y, out=out), 3),
        "silu (read 1, write 1)": (lambda: F.silu(x), 2),
        "multiply (read 2, write 1)": (lambda: torch.mul(x, y, out=out), 3),
    }
    rows = []
    for what, (fn, passes) in kernels.items():
        seconds = timed(fn, device)
        rows.append(row("memory", what, seconds, {"bytes": passes * size}, GBps=passes * size / seconds / 1e9))
    return rows


def launch_rows(device, kernels: int = 2000) -> list[dict]:
    """Tiny kernels back to back: GPU time per kernel, and the host's time to issue one."""
    x = torch.zeros(1, device=device)
    gpu = timed(lambda: [x.add_(1) for _ in range(kernels)], device) / kernels
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(kernels):
        x.add_(1)
    host = (time.perf_counter() - start) / kernels
    if device.type == "cuda":
        torch.cuda.synchronize()
    return [row("launch", "tiny kernel, GPU time each (back to back)", gpu, {"kernels": 1}),
            row("launch", "tiny kernel, host time to issue one (eager)", host, {"kernels": 1})]


def measure(plan, device, memory_elements: int) -> list[dict]:
    """Every kind of kernel above, on ``device``; attention only for a transformer plan."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[plan.dtype]
    rows = []
    lengths = ATTENTION_LENGTHS if device.type == "cuda" else (getattr(plan.model, "seq_len", 2) // 2,)
    parts = [lambda: matmul_rows(plan, dtype, device), lambda: memory_rows(dtype, device, memory_elements),
             lambda: launch_rows(device)]
    if isinstance(plan.model, TransformerModel):
        parts.insert(1, lambda: attention_rows(plan, dtype, device, lengths))
    for part in parts:
        rows += part()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def report(rows: list[dict], spec: ClusterSpec, dtype: str) -> dict:
    """Print measured beside predicted, kernel by kernel, and the median |error| per kind."""
    for r in rows:
        r["predicted_s"] = predict(r, spec, dtype)
        r["error"] = r["predicted_s"] / r["measured_s"] - 1
    table = [[r["kind"], r["what"], r.get("shape", ""), r["measured_s"] * 1e6, r["predicted_s"] * 1e6,
              f"{r['error']:+.1%}", f"{r['tflops']:.0f}" if "tflops" in r else f"{r['GBps']:.0f} GB/s" if "GBps" in r
              else ""] for r in rows]
    print(render_table(["kind", "kernel", "m x n x k", "measured (us)", "predicted (us)", "error", "TFLOP/s"],
                       table))
    summary = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        errors = [abs(r["error"]) for r in rows if r["kind"] == kind and r["predicted_s"]]
        if errors:
            summary[kind] = {"median_abs_error": statistics.median(errors), "max_abs_error": max(errors)}
            print(f"{kind}: median |error| {summary[kind]['median_abs_error']:.1%}, "
                  f"max {summary[kind]['max_abs_error']:.1%} over {len(errors)} kernels")
    return summary


def main() -> None:
    try:
        run()
    except (ParsimError, OSError, KeyError, ValueError) as error:  # bad input: one line, exit 2
        print(f"gpu_kernels.py: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", default=str(DEFAULT_PLAN), help="plan whose kernels to run (default %(default)s)")
    parser.add_argument("--cluster", help="cluster file predicting them (default: from the GPU's name)")
    parser.add_argument("--json", metavar="FILE", help="also write every row as JSON")
    parser.add_argument("--measured", metavar="JSON", help="predict an earlier --json file's kernels instead of "
                        "measuring (no GPU needed)")
    parser.add_argument("--memory-elements", type=int, default=MEMORY_ELEMENTS, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.measured:
        earlier = json.loads(Path(args.measured).read_text())
        name, version, plan_name, rows = earlier["device"], earlier["torch"], earlier["plan"], earlier["rows"]
        dtype = earlier["dtype"]
    else:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
        version, plan = torch.__version__, load_plan(args.plan)
        plan_name, rows, dtype = plan.name, None, plan.dtype
    cluster = args.cluster or next((c for gpu, c in CLUSTER_BY_GPU if gpu in name), None)
    if cluster is None:
        raise ParsimError(f"no built-in cluster for {name!r}: name one with --cluster")
    spec = load_cluster(cluster)
    print(f"{name}, torch {version}; predicted by {spec.name}; kernels of {plan_name} ({dtype})", flush=True)
    if rows is None:
        rows = measure(plan, device, args.memory_elements)
    summary = report(rows, spec, dtype)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "torch": version, "cluster": spec.name,
                                               "plan": plan_name, "dtype": dtype, "rows": rows,
                                               "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
