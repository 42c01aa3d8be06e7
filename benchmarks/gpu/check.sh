#!/usr/bin/env bash
# What a host with one GPU can check (docs/kernel-model.md, "Measured on a GPU"):
#   1. the kernel model, kernel by kernel (benchmarks/gpu_kernels.py), AdamW's steps
#      (benchmarks/gpu/optimizer_rate.py: fused and foreach, fp32 and bf16, the SM clock) and the eager ops
#      torch does not vectorize (benchmarks/gpu/unvectorized_ops.py);
#   2. one training step, measured by the executor on NCCL and predicted (parsim compare --nproc 1),
#      for a compute-bound plan (benchmarks/gpu/one-gpu-step.yaml) and a launch-bound one (tiny-gpt);
#   3. parsim calibrate --ranks 1 (this GPU's compute and host figures) and both steps again with them;
#   4. SC21's 1.7B layer as Megatron-LM ran it (benchmarks/gpu/unfused_layer.py) beside its prediction, and
#      the kernels whose SM cycles the model prices (benchmarks/gpu/score_kernels.py);
#   5. a torch.profiler trace of the compute-bound step, for `parsim compare --measured` anywhere.
# Collectives need two GPUs: NCCL refuses two ranks on one.
# Usage: bash benchmarks/gpu/check.sh [OUT_DIR]     (default gpu-check/; python3 with torch and CUDA)
set -uo pipefail
out=${1:-gpu-check}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The built-in cluster with this GPU, as parsim calibrate --ranks 1 picks it (parsim.hardware.cluster.builtin_for_gpu)
cluster=$($py -c "import sys, torch
from parsim.hardware.cluster import builtin_for_gpu
from parsim.errors import ParsimError
if not torch.cuda.is_available():
    sys.exit('check.sh: this host has no CUDA GPU')
try:
    print(builtin_for_gpu(torch.cuda.get_device_name()))
except ParsimError as error:
    sys.exit(f'check.sh: {error}')") || exit 2
step=benchmarks/gpu/one-gpu-step.yaml
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,power.limit,memory.total --format=csv \
  | tee "$out/gpu.txt"
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" \
  | tee -a "$out/gpu.txt"
echo "== kernels against $cluster"
timeout 150 $py benchmarks/gpu_kernels.py --cluster "$cluster" --json "$out/kernels.json" 2>&1 | tee "$out/kernels.txt"
timeout 90 $py benchmarks/gpu/optimizer_rate.py --json "$out/optimizer-rate.json" 2>&1 | grep -v -i warn \
  | tee "$out/optimizer-rate.txt"
timeout 60 $py benchmarks/gpu/unvectorized_ops.py --json "$out/unvectorized-ops.json" 2>&1 | grep -v -i warn \
  | tee "$out/unvectorized-ops.txt"
echo "== one step of $step"
timeout 180 $py -m parsim compare "$step" --cluster "$cluster" --nproc 1 --backend nccl --steps 5 --timeout 170 \
  --trace "$out/step-trace.json" 2>&1 | tee "$out/step.txt"
echo "== one step of tiny-gpt"
timeout 90 $py -m parsim compare tiny-dp2 --dp 1 --cluster "$cluster" --nproc 1 --backend nccl --steps 5 \
  --timeout 80 2>&1 | tee "$out/tiny.txt"
echo "== calibrate this GPU, then the step with its figures"
timeout 120 $py -m parsim calibrate --ranks 1 --name "this-gpu" --out "$out/this-gpu.yaml" 2>&1 | tee -a "$out/step.txt"
timeout 180 $py -m parsim compare "$step" --cluster "$out/this-gpu.yaml" --nproc 1 --backend nccl --steps 5 \
  --timeout 170 2>&1 | tee -a "$out/step.txt"
timeout 90 $py -m parsim compare tiny-dp2 --dp 1 --cluster "$out/this-gpu.yaml" --nproc 1 --backend nccl --steps 5 \
  --timeout 80 2>&1 | tee -a "$out/tiny.txt"
echo "== SC21's 1.7B layer (unfused attention, fp16): measured, then predicted"
timeout 90 $py benchmarks/gpu/unfused_layer.py --json "$out/unfused-layer.json" 2>&1 | grep -v -i warn
$py -m parsim explain compute benchmarks/gpu/sc21-1.7b.yaml --cluster "$cluster" | tail -3
timeout 90 $py benchmarks/gpu/score_kernels.py --json "$out/score-kernels.json" 2>&1 | grep -v -i warn
echo "== profile of $step"
timeout 150 $py -m parsim run "$step" --nproc 1 --backend nccl --steps 2 --timeout 140 --profile "$out/profile" 2>&1 \
  | tail -4
ls -la "$out" "$out/profile"
