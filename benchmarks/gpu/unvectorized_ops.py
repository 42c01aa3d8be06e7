"""Eager ops torch runs through its non-vectorized elementwise loop, timed alone on a GPU.

The kernel model prices an eager layer's broadcast, strided and bf16-to-fp32 ops at the bias add's SM cycles per
element read or written (`Elementwise.unvectorized` in `parsim/workload/model.py`, `compute.sm_cycles.bias_add`),
as an H200 profile of the one-GPU step showed them. This script times each such op of the executor's layers at
Llama 3 8B's shapes (8,192 tokens, 32 query and 8 K/V heads of 128), beside a plain copy of the same output, and
prints its SM cycles per element as the model counts them (seconds x SMs x clock / elements), with the SM clock
`nvidia-smi` reads meanwhile. Also the ops it does not price so yet: a weight gradient cast into or added to an
fp32 `main_grad`, and `cat`. It measures a GPU; nothing in the model reads it.

    python benchmarks/gpu/unvectorized_ops.py [--json OUT]     (one CUDA GPU)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from executor.gpu_bench import ClockSampler, dump_rows, open_json_out, timed  # noqa: E402
from parsim.hardware.cluster import HOPPER_SM_CYCLES  # noqa: E402

TOKENS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 8192, 4096, 32, 8, 128, 14336


def ops(device) -> list[tuple[str, object, int, str]]:
    """(what, the op, elements read or written as the model counts them, how the model prices it)."""
    bf16 = torch.bfloat16
    x = torch.randn(1, TOKENS, HIDDEN, device=device, dtype=bf16)
    weight = torch.randn(HIDDEN, device=device, dtype=bf16)
    scale = torch.randn(1, TOKENS, 1, device=device, dtype=bf16)
    q = torch.randn(1, TOKENS, HEADS, HEAD_DIM, device=device, dtype=bf16).transpose(1, 2)  # the heads' view
    table = torch.randn(TOKENS, HEAD_DIM, device=device, dtype=bf16)
    kv = torch.randn(1, KV_HEADS, TOKENS, HEAD_DIM, device=device, dtype=bf16)
    grad = torch.randn(FFN, HIDDEN, device=device, dtype=bf16)
    main_grad = torch.zeros(FFN, HIDDEN, device=device)
    half = HEAD_DIM // 2
    n, nq, nw = x.numel(), q.numel(), grad.numel()
    return [
        ("copy, contiguous", lambda: x.clone(), 2 * n, "memory"),
        ("norm: x * weight (broadcast)", lambda: x * weight, 2 * n, "unvectorized"),
        ("norm: x * per-row scale (broadcast)", lambda: x * scale, 2 * n, "unvectorized"),
        ("norm: x.float() (bf16 to fp32)", lambda: x.float(), 2 * n, "unvectorized"),
        ("rope: q * cos table (strided, broadcast)", lambda: q * table, 2 * nq, "unvectorized"),
        ("rope: q + q (strided)", lambda: q + q, 3 * nq, "unvectorized"),
        ("rope: -q[..., half:] (strided)", lambda: -q[..., half:], nq, "unvectorized"),
        ("rope: cat of the halves", lambda: torch.cat((q[..., half:], q[..., :half]), dim=-1), 2 * nq,
         "unvectorized"),
        ("K/V heads: repeat_interleave by 4", lambda: kv.repeat_interleave(HEADS // KV_HEADS, dim=1), 2 * nq,
         "unvectorized"),
        ("weight gradient: main_grad.copy_(bf16)", lambda: main_grad.copy_(grad), 2 * nw, "memory"),
        ("weight gradient: main_grad.add_(bf16)", lambda: main_grad.add_(grad), 3 * nw, "memory"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    out = open_json_out("unvectorized_ops.py", args.json)
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    clock = ClockSampler()
    rows = []
    for what, op, elements, priced in ops(device):
        began = time.perf_counter()
        seconds = timed(op, device, min_s=0.2)
        mhz = clock.median_since(began)
        cycles = seconds * props.multi_processor_count * (mhz or 0) * 1e6 / elements
        rows.append({"op": what, "measured_s": seconds, "elements": elements, "sm_clock_MHz": mhz,
                     "cycles_per_element": cycles if mhz else None, "priced": priced})
    clock.stop()
    print(f"SM cycles per element read or written; the bias add's, which the model prices the unvectorized ones "
          f"at: {HOPPER_SM_CYCLES.bias_add}")
    print(f"{'op':44s} {'us':>8s} {'elements':>12s} {'cycles':>7s} {'SM MHz':>7s}  priced as")
    for r in rows:
        cycles = f"{r['cycles_per_element']:7.3f}" if r["cycles_per_element"] is not None else f"{'-':>7s}"
        print(f"{r['op']:44s} {r['measured_s'] * 1e6:8.1f} {r['elements']:12,d} {cycles} "
              f"{r['sm_clock_MHz'] or 0:7.0f}  {r['priced']}")
    dump_rows(out, rows)


if __name__ == "__main__":
    main()
