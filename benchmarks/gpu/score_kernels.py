"""Time the memory-bound kernels the SMs, not the memory, may bound, as `parsim calibrate --ranks 1` does
(executor.gpu_bench.sm_rows: softmax forward by row length, dropout, GeLU and LayerNorm) on 1.07e9 fp16 scores,
and beside them a plain copy, the backward of softmax and of dropout, a causal mask, the linear biases' add and
gradient sums, the unfused attention core's batched matmuls, and what launched each kernel of SC21's 1.7B layer
(benchmarks/gpu/unfused_layer.py).

Prints each kernel's time and rate, and the SM cycles per element the kernel model takes from them
(parsim.calibrate.gpu.fit_sm_cycles: seconds x SMs x clock over the elements the model counts).
parsim.hardware.cluster.HOPPER_SM_CYCLES is the mean of this script's runs on an H100 and an H200, kept in
benchmarks/gpu/h100-score-kernels-2026-11-26.json and h200-...

Usage: python benchmarks/gpu/score_kernels.py [--json OUT]     (one CUDA GPU; about 30 s)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from executor.gpu_bench import open_json_out, row, sm_rows, timed  # noqa: E402
from parsim.calibrate.gpu import fit_sm_cycles, sm_cycles_mapping  # noqa: E402
from parsim.errors import ParsimError  # noqa: E402
from parsim.hardware.cluster import builtin_for_gpu, load_cluster  # noqa: E402

HALF = torch.float16
SCORES = 1 << 30  # 1.07e9 fp16 scores: 2 GiB


class Bench:
    def __init__(self, device: torch.device):
        self.device = device
        self.rows: list[dict] = []

    def kernel(self, what: str, fn, nbytes: float) -> None:
        seconds = timed(fn, self.device, min_s=0.3)
        self.rows.append(row("memory", what, seconds, {"bytes": nbytes}))
        print(f"{what:<40} {seconds * 1e3:8.3f} ms  {nbytes / seconds / 1e9:6.0f} GB/s", flush=True)

    def matmul(self, what: str, fn, flops: float) -> None:
        seconds = timed(fn, self.device, min_s=0.3)
        self.rows.append(row("bmm", what, seconds, {"flops": flops}))
        print(f"{what:<40} {seconds * 1e3:8.3f} ms  {flops / seconds / 1e12:6.1f} TFLOP/s", flush=True)


def streaming(bench: Bench) -> None:
    """A copy, and the backward kernels that stream: softmax's (a product, then cunn_SoftMaxBackward beyond
    1,024 entries) and dropout's; a causal mask by masked_fill."""
    x = torch.randn(SCORES, device=bench.device, dtype=HALF)
    out = torch.empty_like(x)
    bench.kernel("copy", lambda: out.copy_(x), 4 * SCORES)
    y = torch.softmax(x.view(-1, 2048), -1)
    g = torch.randn_like(y)
    bench.kernel("softmax backward, rows of 2048", lambda: torch._softmax_backward_data(g, y, -1, HALF), 6 * SCORES)
    _, mask = torch.native_dropout(x, 0.1, True)
    bench.kernel("dropout backward", lambda: torch.ops.aten.native_dropout_backward(x, mask, 1 / 0.9), 5 * SCORES)
    causal = torch.ones(2048, 2048, device=bench.device, dtype=torch.bool).triu(1)
    bench.kernel("causal masked_fill", lambda: x.view(-1, 2048, 2048).masked_fill(causal, float("-inf")),
                 4 * SCORES)


def bias_kernels(bench: Bench) -> None:
    """The linear biases' own kernels at SC21 1.7B's shapes (32,768 tokens, hidden 2,304), as Megatron-LM ran them:
    the QKV bias added after its matmul (torch 1.8's ``F.linear`` on 3-D input: ``output += bias``), and each
    bias gradient summed over the tokens (``grad_output.sum(dim=0)``; autograd's sum to the bias's shape)."""
    tokens, h = 32768, 2304
    qkv = torch.randn(tokens, 3 * h, device=bench.device, dtype=HALF)
    bias = torch.randn(3 * h, device=bench.device, dtype=HALF)
    bench.kernel("QKV bias add, in place (3h)", lambda: qkv.add_(bias), 2 * qkv.numel() * 2)
    for width, what in ((3 * h, "QKV"), (4 * h, "fc1"), (h, "dense or fc2")):
        grad = torch.randn(tokens, width, device=bench.device, dtype=HALF)
        bench.kernel(f"{what} bias gradient, sum over tokens", lambda grad=grad: grad.sum(0), grad.numel() * 2)


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


def layer_ops(device: torch.device) -> dict[str, float]:
    """GPU milliseconds of SC21's layer (forward and backward) by the op, and the input shapes, that ran them."""
    sys.path.insert(0, str(Path(__file__).parent))
    from unfused_layer import HEADS, HIDDEN, MICROBATCH, SEQ, Layer
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
    out_file = open_json_out("score_kernels.py", parser.parse_args().json)
    name = torch.cuda.get_device_name()
    try:  # the built-in cluster with this GPU: its SMs x clock and its figures, beside which the fit prints
        spec = load_cluster(builtin_for_gpu(name))
    except ParsimError as error:
        print(f"score_kernels.py: {error}", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    timed_sm = sm_rows(device, HALF, elements=SCORES)
    for r in timed_sm:
        cycles = r["measured_s"] * spec.gpu.sm_cycles_per_s / r["work"]["elements"]
        print(f"{r['what']:<40} {r['measured_s'] * 1e3:8.3f} ms  {r['work']['bytes'] / r['measured_s'] / 1e9:6.0f} GB/s"
              f"  {cycles:6.3f} SM cycles per element", flush=True)
    torch.cuda.empty_cache()
    bench = Bench(device)
    for measure in (streaming, bias_kernels, core_matmuls):
        measure(bench)
        torch.cuda.empty_cache()
    ops = layer_ops(device)
    for what, ms in ops.items():
        print(f"  {ms:8.3f} ms  {what}")
    fitted = sm_cycles_mapping(fit_sm_cycles(timed_sm, spec.gpu.sm_cycles_per_s, spec.sm_cycles))
    print(f"compute.sm_cycles: {json.dumps(fitted)}")
    if out_file:
        with out_file:
            json.dump({"gpu": name, "torch": torch.__version__, "sm_cycles_per_s": spec.gpu.sm_cycles_per_s,
                       "sm_cycles": fitted, "rows": timed_sm + bench.rows, "layer_ops_ms": ops}, out_file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
