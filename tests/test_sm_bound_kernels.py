"""Memory-bound kernels the SMs bound (softmax, dropout, GeLU, norms) against closed forms."""

from pathlib import Path

import pytest

from parsim.cluster import builtin_clusters, load_cluster
from parsim.compute import ComputeModel, at_length
from parsim.kernels import block_work
from parsim.model import DROPOUT_SM_CYCLES, GELU_SM_CYCLES, NORM_SM_CYCLES, SOFTMAX_SM_CYCLES
from parsim.files import read_yaml
from parsim.plan import load_plan

SC21_LAYER = Path(__file__).parent.parent / "benchmarks" / "gpu" / "sc21-1.7b.yaml"

H100 = ComputeModel(peak_flops=989.5e12, hbm_bw_Bps=3350e9, dtype_bytes=2, sm_count=132, memory_efficiency=0.852,
                    sm_cycles_per_s=132 * 1.98e9)


def test_a_kernel_takes_the_longer_of_its_bytes_and_its_sm_cycles():
    nbytes = 4.3e9
    memory_s = nbytes / (3350e9 * 0.852)
    slow, fast = 1.2 * memory_s * 132 * 1.98e9, 0.5 * memory_s * 132 * 1.98e9  # cycles: 1.2x and 0.5x the bytes' time
    assert H100.time(hbm_bytes=nbytes, sm_bound=((nbytes, slow),)) == pytest.approx(1.2 * memory_s)
    assert H100.time(hbm_bytes=nbytes, sm_bound=((nbytes, fast),)) == pytest.approx(memory_s)
    # each kernel on its own: a memory-bound one does not hide another's cycles
    both = H100.time(hbm_bytes=2 * nbytes, sm_bound=((nbytes, slow), (nbytes, fast)))
    assert both == pytest.approx(2.2 * memory_s)


def test_without_an_sm_clock_only_bytes_count():
    cpu_like = ComputeModel(peak_flops=1e12, hbm_bw_Bps=100e9, dtype_bytes=4, memory_efficiency=0.5)
    assert cpu_like.time(hbm_bytes=1e9, sm_bound=((1e9, 1e15),)) == pytest.approx(1e9 / 50e9)


def test_built_in_gpu_clocks_are_the_ones_behind_their_fp32_peaks():
    """FP32 peak = SMs x FP32 lanes per SM x 2 (an FMA) x clock: 64 lanes on A100 (SM80), 128 on Hopper,
    Ada and Blackwell."""
    for name in builtin_clusters():
        gpu = load_cluster(name).gpu
        if not gpu.sm_clock_Hz:
            continue
        lanes = 64 if "A100" in gpu.model else 128
        assert gpu.sm_cycles_per_s * lanes * 2 == pytest.approx(gpu.peak_flops["fp32"], rel=0.003), name


def sc21_layer(dropout: float = 0.1):
    """SC21's 1.7B GPT layer (unfused attention, fp16) on one GPU: 16 x 2,048 tokens."""
    data = read_yaml(SC21_LAYER)
    data["model"]["dropout"] = dropout
    data["parallel"] = {"dp": 1}
    data["batch"] = {"microbatch_size": 16, "global_batch_size": 16}
    plan = load_plan(data)
    return plan, next(c for c in plan.stage_costs(0) if c.name == "layer.0")


def parts(plan, block, kind):
    work = block_work(plan, block, kind, plan.tokens_per_rank)
    return {name: (nbytes, cycles) for name, nbytes, cycles in work.elementwise_parts}


def test_the_unfused_cores_softmax_and_dropout_cycles_per_score():
    plan, layer = sc21_layer()
    attention = layer.blocks[0]
    scores = plan.tokens_per_rank * 24 * 2048
    forward = parts(plan, attention, "F")
    assert forward["attn.softmax"] == pytest.approx((4 * scores, 2 * scores * SOFTMAX_SM_CYCLES[2][1]))
    # dropout reads and writes the scores and writes a one-byte mask in one kernel, a random number per score
    assert forward["attn.dropout"] == pytest.approx((5 * scores, DROPOUT_SM_CYCLES * scores))
    backward = parts(plan, attention, "B")
    assert backward["attn.dropout"] == (5 * scores, 0.0) and backward["attn.softmax"] == (6 * scores, 0.0)


def test_norm_gelu_and_residual_dropout_cycles_per_token():
    plan, layer = sc21_layer()
    mlp = layer.blocks[1]
    tokens, h, f = plan.tokens_per_rank, 2304, 9216
    forward, backward = parts(plan, mlp, "F"), parts(plan, mlp, "B")
    assert forward["mlp.norm"] == pytest.approx((4 * h * tokens, 2 * h * tokens * NORM_SM_CYCLES[0]))
    assert backward["mlp.norm"] == pytest.approx((6 * h * tokens, 3 * h * tokens * NORM_SM_CYCLES[1]))
    assert forward["mlp.act"] == pytest.approx((4 * f * tokens, 2 * f * tokens * GELU_SM_CYCLES[0]))
    assert forward["mlp.residual"] == pytest.approx((7 * h * tokens, DROPOUT_SM_CYCLES * h * tokens))
    plan, layer = sc21_layer(dropout=0.0)
    assert parts(plan, layer.blocks[1], "F")["mlp.residual"] == (6 * h * tokens, 0.0)


def test_softmax_cycles_follow_the_row_length_in_log2():
    assert at_length(SOFTMAX_SM_CYCLES, 2048) == SOFTMAX_SM_CYCLES[2][1]
    middle = (SOFTMAX_SM_CYCLES[2][1] + SOFTMAX_SM_CYCLES[3][1]) / 2
    assert at_length(SOFTMAX_SM_CYCLES, round(2048 * 2 ** 0.5)) == pytest.approx(middle, rel=1e-3)


def test_explain_compute_marks_the_kernels_the_sms_bound(capsys):
    import json

    from parsim.cli.main import main

    assert main(["explain", "compute", str(SC21_LAYER), "--cluster", "dgx-h100", "--json"]) == 0
    rows = {(r["pass"], r["kernel"]): r for r in json.loads(capsys.readouterr().out)["kernels"]}
    softmax = rows[("F", "attn.softmax")]
    scores = 32768 * 24 * 2048
    assert softmax["bound"] == "SMs"
    assert softmax["time_s"] == pytest.approx(2 * scores * SOFTMAX_SM_CYCLES[2][1] / (132 * 1.98e9))
    assert rows[("F", "attn.core.copies")]["bound"] == "memory"


def test_the_cycles_are_the_mean_of_the_kept_h100_and_h200_runs():
    """parsim.model's SM cycles come from benchmarks/gpu/score_kernels.py's runs kept beside it."""
    import json

    runs = [json.loads((SC21_LAYER.parent / f"{gpu}-score-kernels-2026-11-26.json").read_text())
            for gpu in ("h100", "h200")]

    def mean(what, per_run=lambda run, row: row["sm_cycles_per_access"]):
        return sum(per_run(run, next(r for r in run["rows"] if r["what"] == what)) for run in runs) / len(runs)

    def backward(what, accesses):  # the backward's share of a forward + backward timing, per access
        return lambda run, row: (row["s"] - next(r for r in run["rows"] if r["what"] == f"{what} fwd")["s"]) \
            * run["sm_cycles_per_s"] / accesses

    for length, cycles in SOFTMAX_SM_CYCLES:
        assert cycles == pytest.approx(mean(f"softmax fwd, rows of {length}"), abs=6e-4)
    assert DROPOUT_SM_CYCLES == pytest.approx(mean("dropout fwd p=0.1"), abs=6e-4)
    n = 32768 * 2304  # the layer's tokens x hidden
    assert GELU_SM_CYCLES == pytest.approx((mean("gelu fwd"), mean("gelu fwd+bwd", backward("gelu", 12 * n))), abs=6e-4)
    norm = (mean("layernorm fwd"), mean("layernorm fwd+bwd", backward("layernorm", 3 * n)))
    assert NORM_SM_CYCLES == pytest.approx(norm, abs=6e-4)
