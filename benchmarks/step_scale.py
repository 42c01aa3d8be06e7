"""Simulator wall time for one training step, from a laptop plan to frontier scale.

Each case lowers and simulates one step in a fresh process (so one slow case
cannot hide behind another's caches) and prints the wall time of
``predict_step`` (lowering, simulation, reports), the ops simulated, and the
prediction itself. Three tables:

1. the issue's targets: Llama 3 70B on 1,024 H100 (bf16 and fp32), Megatron's
   146B and 1T plans (Narayanan et al. 2021, Table 1) on A100s, Llama 3 405B on
   16,384 H100 (PP 16 with Meta's 7/8x14/7 layers) and on PP 14 / PP 9 with
   even stages, and the ``llama3-405b-16k`` example (ZeRO-2, sequence
   parallelism) with its gradients clipped;
2. wall time against GPUs, 8 to 16,384 (Llama 3 70B, TP 8, PP 8 where it fits);
3. wall time against pipeline depth x microbatches, 8 to 32,768 (Megatron 1T
   shape, TP 8).

Run:  python benchmarks/step_scale.py            (all three tables)
      python benchmarks/step_scale.py --only targets --timeout 60
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


# Megatron-LM GPT shapes (Narayanan et al. 2021, Table 1): seq 2048, vocabulary 51,200, GeLU MLP of 4h,
# learned positions, tied embeddings.
def megatron_gpt(name: str, layers: int, hidden: int, heads: int) -> dict:
    return {"name": name, "kind": "transformer", "num_layers": layers, "hidden": hidden, "num_heads": heads,
            "num_kv_heads": heads, "ffn_hidden": 4 * hidden, "ffn_type": "gelu", "seq_len": 2048,
            "vocab_size": 51200, "tied_embeddings": True, "position_embedding": "learned"}


GPT_146B = megatron_gpt("megatron-146b", 80, 12288, 96)
GPT_1T = megatron_gpt("megatron-1t", 128, 25600, 160)
MEGATRON = {"dtype": "bf16", "tensor_parallel": "megatron",
            "data_parallel": {"grad_sync": "bucketed", "bucket_size": "40MiB", "overlap": True}}


def plan(model, dp: int, tp: int, pp: int, mb: int, schedule: str = "1f1b", v: int = 1, dtype: str = "bf16") -> dict:
    return {"model": model, "parallel": {"dp": dp, "tp": tp, "pp": pp},
            "batch": {"microbatch_size": 1, "num_microbatches": mb}, "schedule": schedule,
            "virtual_stages": v, "dtype": dtype, "tensor_parallel": "megatron",
            "data_parallel": {"grad_sync": "bucketed", "bucket_size": "25MiB", "overlap": True}}


def example(name: str, **changes) -> dict:
    """A built-in example plan's file as data, with ``changes``."""
    from parsim.files import read_yaml
    from parsim.workload.plan import builtin_plans
    return read_yaml(builtin_plans()[name]) | changes


TARGETS = [
    ("Llama 3 70B TP8 PP8 DP16, 16 mb, bf16", "dgx-h100", plan("llama3-70b", 16, 8, 8, 16), "1 s"),
    ("Llama 3 70B TP8 PP8 DP16, 16 mb, fp32", "dgx-h100", plan("llama3-70b", 16, 8, 8, 16, dtype="fp32"), "1 s"),
    ("GPT 146B TP8 PP8 v2 DP24, 48 mb", "dgx-a100",
     plan(GPT_146B, 24, 8, 8, 48, "interleaved-1f1b", 2) | MEGATRON, ""),
    ("GPT 1T TP8 PP64 DP6, 512 mb", "dgx-a100", plan(GPT_1T, 6, 8, 64, 512) | MEGATRON, "10 s"),
    ("Llama 3 405B TP8 PP16 DP128, 16 mb", "dgx-h100", plan("llama3-405b", 128, 8, 16, 16), "2 s"),
    ("Llama 3 405B TP8 PP14 DP128, 16 mb", "dgx-h100", plan("llama3-405b", 128, 8, 14, 16), "2 s"),
    ("Llama 3 405B TP8 PP9 DP128, 16 mb", "dgx-h100", plan("llama3-405b", 128, 8, 9, 16), "2 s"),
    # Meta's layout with ZeRO-2, sequence parallelism and gradient clipping: the examples' heaviest flow
    # simulation (the most transfers contending at once)
    ("llama3-405b-16k example, clipped", "dgx-h100", example("llama3-405b-16k", grad_clip=1.0), ""),
]

GPU_SWEEP = [(f"{tp * pp * dp:,} GPUs: TP{tp} PP{pp} DP{dp}", "dgx-h100", plan("llama3-70b", dp, tp, pp, 16), "")
             for tp, pp, dp in [(8, 1, 1), (8, 8, 1), (8, 8, 4), (8, 8, 16), (8, 8, 64), (8, 8, 256)]]

PIPELINE_SWEEP = [(f"PP{pp} x {mb} mb = {pp * mb:,}", "dgx-a100", plan(GPT_1T, 1, 8, pp, mb) | MEGATRON, "")
                  for pp, mb in [(2, 4), (4, 16), (8, 64), (16, 128), (32, 256), (64, 512)]]

TABLES = {"targets": ("Targets (issue 6)", TARGETS), "gpus": ("Wall time against GPUs", GPU_SWEEP),
          "pipeline": ("Wall time against pipeline depth x microbatches", PIPELINE_SWEEP)}


def measure(cluster: str, plan_data: dict) -> dict:
    """Run in a child process: lower and simulate once, report wall time and the prediction."""
    from parsim.hardware.cluster import load_cluster
    from parsim.sim.step import predict_step
    from parsim.workload.plan import load_plan

    spec = load_cluster(cluster)
    p = load_plan(plan_data)
    start = time.perf_counter()
    prediction = predict_step(p, spec)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "gpus": p.world, "step_s": prediction.step_s, "mfu": prediction.mfu,
            "ops": len(prediction.trace.events)}


def run_case(cluster: str, plan_data: dict, timeout: float) -> dict | None:
    code = "import json,sys; from benchmarks.step_scale import measure; " \
           "a = json.loads(sys.argv[1]); print(json.dumps(measure(a['cluster'], a['plan'])))"
    try:
        out = subprocess.run([sys.executable, "-c", code, json.dumps({"cluster": cluster, "plan": plan_data})],
                             capture_output=True, text=True, timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return None
    except subprocess.CalledProcessError as err:
        return {"error": err.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(TABLES), action="append", help="run only these tables")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before a case counts as not finished")
    args = parser.parse_args()
    from parsim.report.table import render_table
    from parsim.units import format_time

    for key in args.only or list(TABLES):
        title, cases = TABLES[key]
        rows = []
        for label, cluster, plan_data, target in cases:
            r = run_case(cluster, plan_data, args.timeout)
            if r is None:
                rows.append([label, cluster, "", "", "", "", f"> {args.timeout:g}", target])
            elif "error" in r:
                rows.append([label, cluster, "", "", "", "", r["error"][:60], target])
            else:
                rows.append([label, cluster, f"{r['gpus']:,}", f"{r['ops']:,}", format_time(r["step_s"]),
                             f"{r['mfu']:.1%}", f"{r['wall_s']:.2f}", target])
            print(f"  {label}: {rows[-1][6]} s", file=sys.stderr, flush=True)
        print(render_table(["case", "cluster", "GPUs", "events", "step", "MFU", "wall s", "target"], rows,
                           title=title))
        print()


if __name__ == "__main__":
    main()
