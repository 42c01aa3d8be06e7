"""GEMMs back to back for seconds, and the SM clock and power the GPU holds meanwhile.

The matmul figures the kernel model starts from (`compute.matmul_efficiency`, the maximum achievable matmul
FLOPS) are short runs: `mamf-finder.py` averages 100 iterations after 50 warm-up ones, and
`benchmarks/gpu_kernels.py` times at least 0.3 s. A GPU at its power limit lowers its clock after that. This
script runs each bf16 shape of a Llama 3 8B layer (and the MAMF shape) for ``--seconds`` while `nvidia-smi`
samples the SM clock, the board power and the throttle reasons every 100 ms, and prints the rate sustained
beside the clock and power held. It measures a GPU; nothing in the model reads it.

    python benchmarks/gpu/sustained_gemm.py [--seconds 4] [--json OUT]     (one CUDA GPU, nvidia-smi)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from executor.gpu_bench import open_json_out  # noqa: E402

SHAPES = ((8192, 8192, 8192), (8192, 4096, 1024), (14336, 4096, 8192), (8192, 4096, 4096))  # (m, n, k)
SAMPLE_MS = 100
QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"


def sustained(m: int, n: int, k: int, seconds: float) -> dict:
    """``a[m, k] @ W[n, k]ᵀ`` in bf16 for ``seconds``: TFLOP/s over the whole run (CUDA events), and the median
    SM clock and board power `nvidia-smi` sampled, with every throttle reason it reported."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        a @ w.t()
    torch.cuda.synchronize()
    sampler = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                "-lms", str(SAMPLE_MS)], stdout=subprocess.PIPE, text=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began, calls = time.perf_counter(), 0
    start.record()
    while time.perf_counter() - began < seconds:
        for _ in range(50):
            a @ w.t()
        calls += 50
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    sampler.terminate()
    samples = [line.split(",") for line in sampler.communicate()[0].strip().splitlines()[3:]]  # past the start
    return {"mnk": [m, n, k], "seconds": start.elapsed_time(end) / 1e3,
            "tflops": 2 * m * n * k * calls / (start.elapsed_time(end) / 1e3) / 1e12,
            "sm_clock_MHz": statistics.median(float(s[0]) for s in samples),
            "power_W": statistics.median(float(s[1]) for s in samples),
            "throttle_reasons": sorted({s[2].strip() for s in samples})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="how long each shape runs (default 4)")
    parser.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    args = parser.parse_args()
    if args.seconds < 1:  # nvidia-smi's first samples are skipped: a shorter run may leave none
        parser.error(f"--seconds {args.seconds:g}: give at least 1")
    out_file = open_json_out("sustained_gemm.py", args.json)
    rows = []
    for shape in SHAPES:
        r = sustained(*shape, args.seconds)
        rows.append(r)
        print(f"{'x'.join(map(str, r['mnk'])):<18} {r['tflops']:6.0f} TFLOP/s over {r['seconds']:.1f} s, "
              f"SM clock {r['sm_clock_MHz']:,.0f} MHz, {r['power_W']:.0f} W, throttle {r['throttle_reasons']}",
              flush=True)
    if out_file:
        with out_file:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, out_file,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
