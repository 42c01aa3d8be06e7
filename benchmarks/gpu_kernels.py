"""The GPU kernel model against this machine's GPU, kernel by kernel.

Takes the kernels one plan's layer and head launch in a forward and a backward
(:func:`parsim.lowering.kernels.block_work`, what ``parsim explain compute`` prints),
runs each kind on this GPU with torch, and sets the time beside what the
cluster file's kernel model predicts (:class:`parsim.sim.compute.ComputeModel`):

* every distinct matmul shape, as ``a[m, k] @ b[k, n]`` in the plan's dtype
  with the operand layouts ``nn.Linear`` uses, and the 8192 x 8192 x 8192
  shape the MAMF figures come from;
* the attention core, ``F.scaled_dot_product_attention`` with torch's
  default backend (what the executor runs) and with FlashAttention-2 and
  cuDNN alone: the forward, and forward + backward less the forward, at the
  FLOPs the model counts (causal tiles skipped); the default backend also at
  1k to 16k tokens per sequence (the model's efficiency varies by length);
* memory-bound kernels on 1 GiB tensors (copy, add, multiply, SiLU), at the
  bytes each reads and writes; and those whose arithmetic may outlast their
  bytes (softmax by row length, dropout, GeLU, LayerNorm), at their bytes and
  SM cycles (``compute.sm_cycles``);
* a stream of tiny kernels: the GPU time per kernel and the host's time to
  issue one (eager PyTorch), beside the cluster's ``kernel_overhead_us``.

Nothing is fitted: the cluster file is only read. Times are CUDA-event means
after warm-up. Needs a CUDA GPU; on a CPU it runs (slowly, with wall-clock
timing) only so the script itself can be checked.

Run:  python benchmarks/gpu_kernels.py                      (cluster from the GPU's name)
      python benchmarks/gpu_kernels.py --cluster dgx-h100 --json kernels.json
      python benchmarks/gpu_kernels.py --dtype fp8        (the same shapes' GEMMs in fp8)
      python benchmarks/gpu_kernels.py --measured benchmarks/gpu/h100-kernels-2026-11-26.json   (no GPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

from executor.gpu_bench import (MEMORY_ELEMENTS, SM_ELEMENTS, SM_ROW_LENGTHS, SM_TOKENS, attention_at, launch_rows,
                                matmul_row, memory_rows, sm_rows)
from parsim.errors import ParsimError
from parsim.hardware.cluster import ClusterSpec, builtin_for_gpu, load_cluster
from parsim.lowering.kernels import block_work
from parsim.report.table import render_table
from parsim.sim.compute import ComputeModel, SmWork
from parsim.workload.model import TransformerModel
from parsim.workload.plan import DTYPE_BYTES, load_plan

DEFAULT_PLAN = Path(__file__).parent / "gpu" / "one-gpu-step.yaml"
MAMF_SHAPE = (8192, 8192, 8192)
ATTENTION_LENGTHS = (1024, 2048, 4096, 8192, 16384)  # the default backend's, beside the plan's own (GPU only)


def predict(r: dict, spec: ClusterSpec, dtype: str) -> float:
    """The kernel model's seconds for a measured row's work on ``spec``'s GPU."""
    work = r["work"]
    model = ComputeModel.for_cluster(spec, dtype, DTYPE_BYTES[dtype], attention_seq=work.get("seq", 0))
    if r["kind"] == "matmul":
        return model.matmul_time(*work["mnk"])
    if r["kind"] == "attention":
        return model.time(**{"attention_flops" if work["pass"] == "forward" else "attention_grad_flops": work["flops"]})
    if r["kind"] == "memory":
        return model.time(hbm_bytes=work["bytes"])
    if r["kind"] == "sm":  # a memory-bound kernel whose arithmetic may outlast its bytes
        arithmetic = SmWork(work["sm"], work["elements"], work["pass"] == "backward", work.get("row", 0))
        return model.time(hbm_bytes=work["bytes"], sm_bound=((work["bytes"], (arithmetic,)),))
    return model.time(kernels=work["kernels"])


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
    return [matmul_row(m, n, k, role, label, dtype, device) for (m, n, k), (label, role) in shapes.items()]


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


def measure(plan, device, memory_elements: int) -> list[dict]:
    """Every kind of kernel above, on ``device``; attention only for a transformer plan. An fp8 plan runs its
    matmuls in fp8 and the rest in bf16, as Transformer Engine's recipe does."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.bfloat16}[plan.dtype]
    matmul_dtype = torch.float8_e4m3fn if plan.dtype == "fp8" else dtype
    rows = []
    on_gpu = device.type == "cuda"
    scores, tokens = (SM_ELEMENTS, SM_TOKENS) if on_gpu else (4 * max(SM_ROW_LENGTHS), 4)  # a CPU: a quick look
    parts = [lambda: matmul_rows(plan, matmul_dtype, device), lambda: memory_rows(dtype, device, memory_elements),
             lambda: sm_rows(device, dtype, scores, tokens), lambda: launch_rows(device)]
    if isinstance(plan.model, TransformerModel):
        lengths = ATTENTION_LENGTHS if device.type == "cuda" else (plan.model.seq_len // 2,)
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
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16", "fp8"),
                        help="run them in this dtype instead of the plan's (fp8: the matmuls by torch._scaled_mm, as "
                             "Transformer Engine runs them, the rest in bf16)")
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
        plan = load_plan(args.plan, overrides={"dtype": args.dtype} if args.dtype else None)
        version = torch.__version__
        plan_name, rows, dtype = plan.name, None, plan.dtype
    spec = load_cluster(args.cluster or builtin_for_gpu(name))
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
