"""Time the memory-bound kernels the SMs, not the memory, may bound: softmax by row length, dropout, GeLU and
LayerNorm, beside a plain copy; the unfused attention core's batched matmuls; and what launched each kernel
of SC21's 1.7B layer (benchmarks/gpu/unfused_layer.py) in its forward and backward.

Each kernel's row gives its seconds, the bytes parsim's model charges for it, the fraction of the GPU's HBM
bandwidth that makes, and its SM cycles per element accessed if the SMs bound it (seconds x SMs x clock /
elements read and written). parsim.model.SOFTMAX_SM_CYCLES and its neighbours are the mean of these over
H100 and H200 (h100-score-kernels-2026-11-26.json, h200-...).

Usage: python benchmarks/gpu/score_kernels.py [--json OUT]     (one CUDA GPU; about 20 s)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from executor.gpu_bench import timed  # noqa: E402
from parsim.cluster import builtin_for_gpu, load_cluster  # noqa: E402
from parsim.errors import ParsimError  # noqa: E402

F = torch.nn.functional
HALF = torch.float16
SCORES = 1 << 30  # 1.07e9 fp16 scores: 2 GiB
ROW_LENGTHS = (512, 1024, 2048, 4096, 8192)
TOKENS, HIDDEN = 32768, 2304  # SC21's 1.7B layer: 16 x 2,048 tokens


class Bench:
    def __init__(self, device: torch.device, sm_cycles_per_s: float):
        self.device, self.sm_cycles_per_s = device, sm_cycles_per_s
        self.rows: list[dict] = []

    def kernel(self, what: str, fn, nbytes: float, accesses: float) -> None:
        """Time ``fn``, which reads and writes ``accesses`` elements in ``nbytes`` bytes."""
        seconds = timed(fn, self.device, min_s=0.3)
        cycles = seconds * self.sm_cycles_per_s / accesses
        self.rows.append({"what": what, "s": seconds, "bytes": nbytes, "GBps": nbytes / seconds / 1e9,
                          "sm_cycles_per_access": cycles})
        print(f"{what:<40} {seconds * 1e3:8.3f} ms  {nbytes / seconds / 1e9:6.0f} GB/s  {cycles:6.3f} cycles/access",
              flush=True)

    def matmul(self, what: str, fn, flops: float) -> None:
        seconds = timed(fn, self.device, min_s=0.3)
        self.rows.append({"what": what, "s": seconds, "flops": flops, "tflops": flops / seconds / 1e12})
        print(f"{what:<40} {seconds * 1e3:8.3f} ms  {flops / seconds / 1e12:6.1f} TFLOP/s", flush=True)


def scores(bench: Bench) -> None:
    """Softmax forward and backward over rows of each length, dropout forward and backward, a causal mask."""
    x = torch.randn(SCORES, device=bench.device, dtype=HALF)
    out = torch.empty_like(x)
    bench.kernel("copy", lambda: out.copy_(x), 4 * SCORES, 2 * SCORES)
    for length in ROW_LENGTHS:
        rows = x.view(-1, length)
        y = torch.softmax(rows, -1)
        g = torch.randn_like(y)
        bench.kernel(f"softmax fwd, rows of {length}", lambda: torch.softmax(rows, -1), 4 * SCORES, 2 * SCORES)
        # torch's backward beyond 1,024 entries: a product, then cunn_SoftMaxBackward (6 accesses in all)
        bench.kernel(f"softmax bwd, rows of {length}", lambda: torch._softmax_backward_data(g, y, -1, HALF),
                     6 * SCORES, 3 * SCORES)
    probs = torch.softmax(x.view(-1, 2048), -1).view(-1)
    bench.kernel("dropout fwd p=0.1", lambda: torch.native_dropout(probs, 0.1, True), 5 * SCORES, SCORES)
    _, mask = torch.native_dropout(probs, 0.1, True)
    bench.kernel("dropout bwd", lambda: torch.ops.aten.native_dropout_backward(probs, mask, 1 / 0.9),
                 5 * SCORES, 3 * SCORES)
    causal = torch.ones(2048, 2048, device=bench.device, dtype=torch.bool).triu(1)
    bench.kernel("causal masked_fill", lambda: x.view(-1, 2048, 2048).masked_fill(causal, float("-inf")),
                 4 * SCORES, 2 * SCORES)


def core_matmuls(bench: Bench) -> None:
    """The unfused core's batched matmuls at SC21 1.7B's shapes: 16 x 24 heads of 2,048 x 96."""
    heads, seq, dim = 384, 2048, 96
    q, k, v = (torch.randn(heads, seq, dim, device=bench.device, dtype=HALF) for _ in range(3))
    p = torch.randn(heads, seq, seq, device=bench.device, dtype=HALF)
    buffer = torch.empty_like(p)
    flops = 2 * heads * seq * seq * dim
    bench.matmul("scores = baddbmm(Q, Kt)", lambda: torch.baddbmm(buffer, q, k.transpose(1, 2), beta=0.0), flops)
    bench.matmul("context = bmm(P, V)", lambda: torch.bmm(p, v), flops)
    bench.matmul("dP = bmm(dC, Vt)", lambda: torch.bmm(q, v.transpose(1, 2)), flops)
    bench.matmul("dV = bmm(Pt, dC)", lambda: torch.bmm(p.transpose(1, 2), v), flops)
    bench.matmul("dQ = bmm(dS, K)", lambda: torch.bmm(p, k), flops)
    bench.matmul("dK = bmm(dSt, Q)", lambda: torch.bmm(p.transpose(1, 2), q), flops)


def layer_kernels(bench: Bench) -> None:
    """LayerNorm and GeLU at the layer's widths, forward and forward + backward."""
    a = torch.randn(TOKENS, HIDDEN, device=bench.device, dtype=HALF, requires_grad=True)
    norm = torch.nn.LayerNorm(HIDDEN).to(bench.device, HALF)
    da = torch.randn_like(a)
    n = TOKENS * HIDDEN
    bench.kernel("layernorm fwd", lambda: norm(a), 4 * n, 2 * n)
    bench.kernel("layernorm fwd+bwd", lambda: torch.autograd.grad(norm(a), (a, norm.weight, norm.bias), da),
                 10 * n, 5 * n)
    b = torch.randn(TOKENS, 4 * HIDDEN, device=bench.device, dtype=HALF, requires_grad=True)
    db = torch.randn_like(b)
    bench.kernel("gelu fwd", lambda: F.gelu(b), 16 * n, 8 * n)
    bench.kernel("gelu fwd+bwd", lambda: torch.autograd.grad(F.gelu(b), b, db), 40 * n, 20 * n)


def layer_ops(device: torch.device) -> dict[str, float]:
    """GPU milliseconds of SC21's layer (forward and backward) by the op, and the input shapes, that ran them."""
    sys.path.insert(0, str(Path(__file__).parent))
    from unfused_layer import HEADS, MICROBATCH, SEQ, Layer
    layer = Layer(HIDDEN, HEADS).to(device, HALF)
    x = torch.randn(SEQ, MICROBATCH, HIDDEN, device=device, dtype=HALF, requires_grad=True)
    grad = torch.randn_like(x)
    for _ in range(2):
        layer(x).backward(grad)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        layer(x).backward(grad)
        torch.cuda.synchronize()
    by_op: dict[str, float] = defaultdict(float)
    for event in prof.key_averages(group_by_input_shape=True):
        if event.device_time_total > 200:  # us
            by_op[f"{event.key} {str(event.input_shapes)[:100]}"] += event.device_time_total / 1e3
    return dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:45])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("score_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        out_file = open(args.json, "w") if args.json else None  # refused now, not after the timing
    except OSError as error:
        print(f"score_kernels.py: --json: {error}", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    try:  # SMs x clock as the model takes them: from the built-in cluster with this GPU
        gpu = load_cluster(builtin_for_gpu(name)).gpu
    except ParsimError as error:
        print(f"score_kernels.py: {error}", file=sys.stderr)
        return 2
    bench = Bench(torch.device("cuda"), gpu.sm_cycles_per_s)
    for measure in (scores, core_matmuls, layer_kernels):
        measure(bench)
        torch.cuda.empty_cache()
    ops = layer_ops(bench.device)
    for what, ms in ops.items():
        print(f"  {ms:8.3f} ms  {what}")
    if out_file:
        with out_file:
            json.dump({"gpu": name, "torch": torch.__version__,
                       "sm_cycles_per_s": bench.sm_cycles_per_s, "rows": bench.rows, "layer_ops_ms": ops},
                      out_file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
