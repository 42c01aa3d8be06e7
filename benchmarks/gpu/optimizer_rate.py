"""AdamW's step on a GPU: the bytes it moves per second, by implementation and tensor size, beside a plain copy's.

The kernel model prices an AdamW step as memory-bound traffic at the GPU's streaming rate
(`parsim.lowering.lower.adamw_costs`: fused, 7 fp32 accesses a parameter; foreach, 21). On one H200 the
one-GPU step's fused AdamW moved its bytes at about 3.2 TB/s against 4.0-4.4 TB/s for copies
(docs/kernel-model.md). This script times `torch.optim.AdamW` steps over the one-GPU step's own tensors
(`benchmarks/gpu/one-gpu-step.yaml`: Llama 3 8B's shapes, 4 layers, fp32 master weights; and the same in
bf16, half the bytes for the same arithmetic) and over 256M fp32 parameters cut into tensors of 64K to 256M
elements, counts the kernels one step launches (torch.profiler), and prints the rate of each beside a 1 GiB
copy's, with the SM clock `nvidia-smi` read while it ran. It measures a GPU; nothing in the model reads it.

    python benchmarks/gpu/optimizer_rate.py [--json OUT]     (one CUDA GPU)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from executor.gpu_bench import ClockSampler, dump_rows, open_json_out, params_with_grads, timed  # noqa: E402
from parsim.lowering.lower import ADAMW_ACCESSES, FP32, FUSED_ADAMW_ACCESSES  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ACCESSES = {"fused": FUSED_ADAMW_ACCESSES, "foreach": ADAMW_ACCESSES}
SPLIT_TOTAL = 1 << 28  # parameters in each uniform split
SPLIT_SIZES = (1 << 16, 1 << 20, 1 << 24, 1 << 28)  # elements per tensor


def step_shapes(layers: int = 4, hidden: int = 4096, kv: int = 1024, ffn: int = 14336,
                vocab: int = 128256) -> list[tuple[int, ...]]:
    """The executor's parameter tensors for one-gpu-step.yaml: embedding, per layer two norms and the separate
    q, k, v, o, gate, up and down projections, the final norm and the untied LM head."""
    layer = [(hidden,), (hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (hidden,),
             (ffn, hidden), (ffn, hidden), (hidden, ffn)]
    return [(vocab, hidden)] + layer * layers + [(hidden,), (vocab, hidden)]


def kernels_of(step) -> tuple[int, float]:
    """(kernels launched, their summed GPU seconds) in one call of ``step``, by torch.profiler."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels), sum(e.device_time_total for e in kernels) / 1e6


def measure(name: str, shapes: list[tuple[int, ...]], implementation: str, dtype: str, clock: ClockSampler) -> dict:
    """One AdamW step's seconds (mean of steps after warm-up), its bytes as the model counts them (its accesses
    of ``dtype``'s elements), its kernels and the SM clock while it was timed."""
    device = torch.device("cuda")
    params = params_with_grads(shapes, device, DTYPES[dtype])
    flag = {"fused": True} if implementation == "fused" else {"foreach": True}
    optimizer = torch.optim.AdamW(params, lr=1e-4, **flag)
    began = time.perf_counter()
    seconds = timed(optimizer.step, device, min_s=0.3)
    mhz = clock.median_since(began)
    kernels, kernel_s = kernels_of(optimizer.step)
    count = sum(p.numel() for p in params)
    nbytes = count * ACCESSES[implementation] * params[0].element_size()
    del optimizer, params
    torch.cuda.empty_cache()
    return {"case": name, "implementation": implementation, "dtype": dtype, "tensors": len(shapes),
            "params": count, "bytes": nbytes, "measured_s": seconds, "TBps": nbytes / seconds / 1e12,
            "kernels": kernels, "kernel_s": kernel_s, "sm_clock_MHz": mhz}


def after_gemms(clock: ClockSampler, rounds: int = 10, gemms: int = 40) -> dict:
    """The one-GPU step's fused fp32 AdamW as a training step runs it: right after bf16 GEMMs (``gemms`` of
    8192^3, about 60 ms, a step's backward in small), timed alone by CUDA events; the median of ``rounds``."""
    device = torch.device("cuda")
    params = params_with_grads(step_shapes(), device)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    optimizer.step()
    times, clocks = [], []
    for _ in range(rounds):
        for _ in range(gemms):
            a @ a
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        began = time.perf_counter()
        begin.record()
        optimizer.step()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
        clocks.append(clock.median_since(began))
    count = sum(p.numel() for p in params)
    nbytes = count * ACCESSES["fused"] * FP32
    seconds = statistics.median(times)
    del optimizer, params
    torch.cuda.empty_cache()
    known = [c for c in clocks if c is not None]
    return {"case": "step's, after GEMMs", "implementation": "fused", "dtype": "fp32", "tensors": len(step_shapes()),
            "params": count, "bytes": nbytes, "measured_s": seconds, "TBps": nbytes / seconds / 1e12,
            "sm_clock_MHz": statistics.median(known) if known else None}


def copy_rate(clock: ClockSampler) -> dict:
    """A 1 GiB fp32 copy: bytes read and written per second."""
    device = torch.device("cuda")
    src = torch.randn(1 << 28, device=device)
    dst = torch.empty_like(src)
    began = time.perf_counter()
    seconds = timed(lambda: dst.copy_(src), device, min_s=0.3)
    nbytes = 2 * src.numel() * FP32
    return {"case": "copy 1 GiB fp32", "bytes": nbytes, "measured_s": seconds, "TBps": nbytes / seconds / 1e12,
            "sm_clock_MHz": clock.median_since(began)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    out = open_json_out("optimizer_rate.py", args.json)
    clock = ClockSampler()
    rows = [copy_rate(clock)]
    cases = [("one-gpu-step's tensors", step_shapes(), dtype) for dtype in DTYPES]
    cases += [(f"{SPLIT_TOTAL // size} x {size}", [(size,)] * (SPLIT_TOTAL // size), "fp32") for size in SPLIT_SIZES]
    for name, shapes, dtype in cases:
        for implementation in ("fused", "foreach"):
            rows.append(measure(name, shapes, implementation, dtype, clock))
    rows.append(after_gemms(clock))
    clock.stop()
    print(f"{'case':24s} {'impl':8s} {'dtype':5s} {'params':>13s} {'ms':>8s} {'TB/s':>6s} {'kernels':>8s} "
          f"{'kernel ms':>9s} {'SM MHz':>7s}")
    for r in rows:
        print(f"{r['case']:24s} {r.get('implementation', ''):8s} {r.get('dtype', ''):5s} {r.get('params', 0):13,d} "
              f"{r['measured_s'] * 1e3:8.3f} {r['TBps']:6.2f} {r.get('kernels', ''):>8} "
              f"{r.get('kernel_s', 0) * 1e3:9.3f} {r['sm_clock_MHz'] or 0:7.0f}")
    dump_rows(out, rows)


if __name__ == "__main__":
    main()
