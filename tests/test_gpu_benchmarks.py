"""The GPU benchmark scripts as a host without a GPU runs them: a kept GPU measurement re-predicted with
today's kernel model (its figures pinned), and bad input or a missing GPU refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).parents[1]
H100_KERNELS = "benchmarks/gpu/h100-kernels-2026-11-26.json"


def script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_kept_h100_measurement_is_repredicted_kernel_by_kernel():
    done = script("benchmarks/gpu_kernels.py", "--measured", H100_KERNELS)
    assert done.returncode == 0, done.stderr
    assert "predicted by dgx-h100; kernels of one-gpu-step (bf16)" in done.stdout
    for line in ("matmul: median |error| 2.3%, max 7.3% over 13 kernels",
                 "memory: median |error| 6.7%, max 7.4% over 4 kernels"):
        assert line in done.stdout


def test_a_kept_h100_fp8_measurement_is_repredicted_at_the_fp8_rate():
    """The same GEMM shapes in fp8 (``--dtype fp8``: torch._scaled_mm, as Transformer Engine runs them) against
    dgx-h100's fp8 figure and Hopper's k term, fitted on bf16 GEMMs and taken as a time (twice the steps of k in
    fp8): nothing fitted to fp8."""
    done = script("benchmarks/gpu_kernels.py", "--measured", "benchmarks/gpu/h100-fp8-kernels-2026-11-26.json")
    assert done.returncode == 0, done.stderr
    assert "kernels of one-gpu-step (fp8)" in done.stdout
    assert "matmul: median |error| 2.3%, max 12.7% over 13 kernels" in done.stdout


@pytest.mark.parametrize("args, expected", [
    (("benchmarks/gpu_kernels.py", "--measured", "no-such.json"), "No such file"),
    (("benchmarks/gpu_kernels.py", "--measured", H100_KERNELS, "--cluster", "nosuch"), "unknown cluster 'nosuch'"),
])
def test_bad_input_to_the_kernel_benchmark_is_one_line(args, expected):
    done = script(*args)
    assert done.returncode == 2 and expected in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["unfused_layer.py", "score_kernels.py", "sustained_gemm.py", "optimizer_rate.py",
                                  "unvectorized_ops.py"])
def test_the_gpu_benchmarks_need_a_gpu_and_say_so_in_one_line(name):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    done = script(f"benchmarks/gpu/{name}")
    assert done.returncode == 2 and done.stderr.strip() == f"{name} needs a CUDA GPU"


def test_a_gpu_benchmark_refuses_an_unwritable_json_in_one_line_before_timing(tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    from executor.gpu_bench import open_json_out

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit) as done:
        open_json_out("score_kernels.py", str(tmp_path / "no-such-dir" / "out.json"))
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2 and err.startswith("score_kernels.py: --json: ") and len(err.splitlines()) == 1
    assert open_json_out("score_kernels.py", None) is None
