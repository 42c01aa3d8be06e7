"""Memory-bound kernels the SMs bound (softmax, dropout, GeLU, norms) against closed forms."""

import json
from pathlib import Path

import pytest

from parsim.files import read_yaml
from parsim.hardware.cluster import HOPPER_SM_CYCLES, builtin_clusters, load_cluster
from parsim.lowering.kernels import block_work
from parsim.lowering.lower import adamw_costs
from parsim.sim.compute import ComputeModel, SmWork, at_length
from parsim.workload.plan import load_plan

SC21_LAYER = Path(__file__).parent.parent / "benchmarks" / "gpu" / "sc21-1.7b.yaml"

H100 = ComputeModel(peak_flops=989.5e12, hbm_bw_Bps=3350e9, dtype_bytes=2, sm_count=132, memory_efficiency=0.852,
                    sm_cycles_per_s=132 * 1.98e9)


def dropout_drawing(seconds: float) -> tuple[SmWork, ...]:
    """Dropout whose random numbers take ``seconds`` on H100's SMs."""
    return (SmWork("dropout", seconds * 132 * 1.98e9 / HOPPER_SM_CYCLES.dropout),)


def test_a_kernel_takes_the_longer_of_its_bytes_and_its_sm_cycles():
    nbytes = 4.3e9
    memory_s = nbytes / (3350e9 * 0.852)
    slow, fast = dropout_drawing(1.2 * memory_s), dropout_drawing(0.5 * memory_s)
    assert H100.time(hbm_bytes=nbytes, sm_bound=((nbytes, slow),)) == pytest.approx(1.2 * memory_s)
    assert H100.time(hbm_bytes=nbytes, sm_bound=((nbytes, fast),)) == pytest.approx(memory_s)
    # each kernel on its own: a memory-bound one does not hide another's cycles
    both = H100.time(hbm_bytes=2 * nbytes, sm_bound=((nbytes, slow), (nbytes, fast)))
    assert both == pytest.approx(2.2 * memory_s)
    # a kernel's kinds of arithmetic add up: a residual add drawing a dropout mask
    assert H100.time(hbm_bytes=nbytes, sm_bound=((nbytes, slow + fast),)) == pytest.approx(1.7 * memory_s)


def test_each_kind_at_its_cycles_per_element():
    figures = HOPPER_SM_CYCLES
    assert H100.cycles(SmWork("softmax", 1e9, row=2048)) == pytest.approx(1e9 * at_length(figures.softmax, 2048))
    assert H100.cycles(SmWork("gelu", 1e9, backward=True)) == pytest.approx(1e9 * figures.gelu[1])
    assert H100.cycles(SmWork("norm", 1e9)) == pytest.approx(1e9 * figures.norm[0])


def test_a_fused_adamw_step_adds_its_sm_cycles_to_its_bytes():
    """The one-GPU step's 1.92B fp32 parameters: 28 bytes each at the memory-bound rate, then 0.39 cycles each
    over 132 SMs at 1.98 GHz (not the longer of the two, as the kernels above)."""
    params = 1.923e9
    costs = adamw_costs("fused", params, 49)
    memory_s = 28 * params / (3350e9 * 0.852)
    cycles_s = params * HOPPER_SM_CYCLES.adamw / (132 * 1.98e9)
    assert H100.time(**costs) == pytest.approx(memory_s + cycles_s)
    assert cycles_s == pytest.approx(2.87e-3, rel=0.01)
    # the foreach implementation's many kernels stream at the memory-bound rate alone
    assert H100.time(**adamw_costs("foreach", params, 49)) == pytest.approx(84 * params / (3350e9 * 0.852))
    cpu_like = ComputeModel(peak_flops=1e12, hbm_bw_Bps=100e9, dtype_bytes=4, memory_efficiency=0.5)
    assert cpu_like.time(**costs) == pytest.approx(28 * params / 50e9)  # no SM clock: its bytes alone


def test_without_an_sm_clock_only_bytes_count():
    cpu_like = ComputeModel(peak_flops=1e12, hbm_bw_Bps=100e9, dtype_bytes=4, memory_efficiency=0.5)
    assert cpu_like.time(hbm_bytes=1e9, sm_bound=((1e9, dropout_drawing(100.0)),)) == pytest.approx(1e9 / 50e9)


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
    return {name: (nbytes, works) for name, nbytes, works in work.elementwise_parts}


def test_the_unfused_cores_softmax_and_dropout_cycles_per_score():
    plan, layer = sc21_layer()
    attention = layer.blocks[0]
    scores = plan.tokens_per_rank * 24 * 2048
    forward = parts(plan, attention, "F")
    assert forward["attn.softmax"] == (4 * scores, (SmWork("softmax", 2 * scores, row=2048),))
    # dropout reads and writes the scores and writes a one-byte mask in one kernel, a random number per score
    assert forward["attn.dropout"] == (5 * scores, (SmWork("dropout", scores),))
    backward = parts(plan, attention, "B")
    assert backward["attn.dropout"] == (5 * scores, ())
    # the softmax's backward carries its arithmetic (a CPU core's is slower than its bytes), but streams on a GPU
    assert backward["attn.softmax"] == (6 * scores, (SmWork("softmax", 3 * scores, backward=True, row=2048),))
    assert H100.sm_excess((backward["attn.softmax"],)) == 0.0


def test_norm_gelu_and_residual_dropout_cycles_per_token():
    plan, layer = sc21_layer()
    mlp = layer.blocks[1]
    tokens, h, f = plan.tokens_per_rank, 2304, 9216
    forward, backward = parts(plan, mlp, "F"), parts(plan, mlp, "B")
    assert forward["mlp.norm"] == (4 * h * tokens, (SmWork("norm", 2 * h * tokens),))
    assert backward["mlp.norm"] == (6 * h * tokens, (SmWork("norm", 3 * h * tokens, backward=True),))
    assert forward["mlp.act"] == (4 * f * tokens, (SmWork("gelu", 2 * f * tokens),))
    assert forward["mlp.residual"] == (7 * h * tokens, (SmWork("dropout", h * tokens),))
    plan, layer = sc21_layer(dropout=0.0)
    assert parts(plan, layer.blocks[1], "F")["mlp.residual"] == (6 * h * tokens, ())


def test_eager_layers_unvectorized_ops_take_the_bias_adds_cycles_per_element():
    """The one-GPU step's eager layer (Llama 3 8B's shapes): RoPE, the norms' broadcast products and their cast
    to fp32, the K/V heads' copies run through torch's non-vectorized loop (an H200's profile, 2026-11-30)."""
    plan = load_plan(SC21_LAYER.parent / "one-gpu-step.yaml")
    layer = next(c for c in plan.stage_costs(0) if c.name == "layer.0")
    attention = layer.blocks[0]
    tokens, h, q, kv = plan.tokens_per_rank, 4096, 4096, 1024
    forward, backward = parts(plan, attention, "F"), parts(plan, attention, "B")
    unvectorized = {name: sum(w.elements for w in works if w.kind == "bias_add") / tokens
                    for name, (_, works) in forward.items()}
    assert {name: n for name, n in unvectorized.items() if n} == {
        "attn.norm": 4 * h, "attn.norm.cast.fp32": 2 * h, "attn.rope.q": 10 * q, "attn.rope.k": 10 * kv,
        "attn.kv.repeat": 4 * q}
    assert backward["attn.rope.q"][1] == (SmWork("bias_add", 13 * q * tokens),)
    assert backward["attn.rope.k"][1] == (SmWork("bias_add", 7 * kv * tokens),)
    assert backward["attn.kv.grad.copy"][1] == (SmWork("bias_add", 4 * kv * tokens),)
    # RoPE on the queries: its SM cycles outlast its bytes, 470 us on an H200 (measured 476: neg, cat, two
    # products and the sum)
    rope = forward["attn.rope.q"]
    assert H100.time(hbm_bytes=rope[0], sm_bound=(rope,)) == pytest.approx(
        10 * q * tokens * HOPPER_SM_CYCLES.bias_add / (132 * 1.98e9))


def test_weight_gradients_added_into_main_grad_of_another_dtype_take_their_unvectorized_cycles():
    """bf16 gradients added into fp32 main_grad (read both, write one: 3 elements a weight) cast on the fly, so
    torch runs the add unvectorized: the longer of its 10 bytes a weight and the bias add's cycles."""
    plan = load_plan(SC21_LAYER.parent / "one-gpu-step.yaml")
    assert (plan.accumulation.bytes, plan.accumulation.elements) == (10.0, 3.0)
    layer = next(c for c in plan.stage_costs(0) if c.name == "layer.0")
    mlp = block_work(plan, layer.blocks[1], "B", plan.tokens_per_rank)
    weights = 3 * 14336 * 4096
    assert (mlp.accumulate_bytes, mlp.accumulate_elements) == (10.0 * weights, 3.0 * weights)
    priced = H100.time(hbm_bytes=mlp.accumulate_bytes, stream_bytes=mlp.accumulate_bytes,
                       accumulate_elements=mlp.accumulate_elements)
    cycles_s = 3 * weights * HOPPER_SM_CYCLES.bias_add / (132 * 1.98e9)
    assert priced == pytest.approx(max(10 * weights / (3350e9 * 0.852), cycles_s)) == pytest.approx(cycles_s)
    # same dtypes (an fp32 plan, no main_grad): a vectorized add, its bytes alone
    fp32 = load_plan({**read_yaml(SC21_LAYER.parent / "one-gpu-step.yaml"), "dtype": "fp32"})
    assert fp32.accumulation.elements == 0.0


def test_softmax_cycles_follow_the_row_length_in_log2():
    curve = HOPPER_SM_CYCLES.softmax
    assert at_length(curve, 2048) == dict(curve)[2048]
    middle = (dict(curve)[2048] + dict(curve)[4096]) / 2
    assert at_length(curve, round(2048 * 2 ** 0.5)) == pytest.approx(middle, rel=1e-3)


def test_explain_compute_marks_the_kernels_the_sms_bound(capsys):
    import json

    from parsim.cli.main import main

    assert main(["explain", "compute", str(SC21_LAYER), "--cluster", "dgx-h100", "--json"]) == 0
    rows = {(r["pass"], r["kernel"]): r for r in json.loads(capsys.readouterr().out)["kernels"]}
    softmax = rows[("F", "attn.softmax")]
    scores = 32768 * 24 * 2048
    assert softmax["bound"] == "SMs"
    assert softmax["time_s"] == pytest.approx(2 * scores * dict(HOPPER_SM_CYCLES.softmax)[2048] / (132 * 1.98e9))
    assert rows[("F", "attn.core.copies")]["bound"] == "memory"


def test_explain_compute_prices_the_eager_layers_unvectorized_ops_and_main_grad_adds_at_their_cycles(capsys):
    """The one-GPU step on an H100: RoPE's forward and the MLP's weight gradients added into fp32 main_grad are
    bound by the SMs, at the bias add's cycles; the header names them among the kernels the SMs may bound."""
    from parsim.cli.main import main

    step = str(SC21_LAYER.parent / "one-gpu-step.yaml")
    assert main(["explain", "compute", step, "--cluster", "dgx-h100"]) == 0
    assert "bias adds, unvectorized eager ops: the longer of bytes and SM cycles" in capsys.readouterr().out
    assert main(["explain", "compute", step, "--cluster", "dgx-h100", "--json"]) == 0
    rows = {(r["pass"], r["kernel"]): r for r in json.loads(capsys.readouterr().out)["kernels"]}
    per_element = HOPPER_SM_CYCLES.bias_add / (132 * 1.98e9)
    rope, added = rows[("F", "attn.rope.q")], rows[("B", "add weight gradients into main_grad")]
    assert (rope["bound"], added["bound"]) == ("SMs", "SMs")
    assert rope["time_s"] == pytest.approx(10 * 4096 * 8192 * per_element)
    assert added["time_s"] == pytest.approx(3 * 3 * 14336 * 4096 * per_element)  # gate, up and down


def h100_with(sm_cycles: object) -> dict:
    from parsim.files import read_yaml as read

    data = read(builtin_clusters()["dgx-h100"])
    data["compute"]["sm_cycles"] = sm_cycles
    return data


def test_a_cluster_file_gives_its_own_cycles_and_keeps_hoppers_for_the_rest():
    from parsim.hardware.cluster import parse_cluster

    spec = parse_cluster(h100_with({"softmax": {2048: 0.5}, "norm": {"forward": 0.1, "backward": 0.2},
                                    "bias_add": 0.3, "adamw": 0.5}), "mine")
    assert spec.sm_cycles.softmax == ((2048, 0.5),) and spec.sm_cycles.norm == (0.1, 0.2)
    assert (spec.sm_cycles.bias_add, spec.sm_cycles.adamw) == (0.3, 0.5)
    assert (spec.sm_cycles.dropout, spec.sm_cycles.gelu) == (HOPPER_SM_CYCLES.dropout, HOPPER_SM_CYCLES.gelu)
    assert parse_cluster(h100_with({"softmax": 0.3}), "mine").sm_cycles.softmax == ((0, 0.3),)  # every length


@pytest.mark.parametrize("value, where", [
    ({"exp": 1.0}, "compute.sm_cycles"),
    ({"dropout": -1}, "compute.sm_cycles.dropout"),
    ({"bias_add": "fast"}, "compute.sm_cycles.bias_add"),
    ({"adamw": -0.1}, "compute.sm_cycles.adamw"),
    ({"gelu": 0.2}, "compute.sm_cycles.gelu"),
    ({"norm": {"forward": 0.2, "backward": "slow"}}, "compute.sm_cycles.norm.backward"),
    ({"softmax": {"2k": 0.3}}, "compute.sm_cycles.softmax"),
])
def test_bad_sm_cycles_are_refused_naming_the_key(value, where):
    from parsim.errors import ConfigError
    from parsim.hardware.cluster import parse_cluster

    with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
        parse_cluster(h100_with(value), "mine")


def test_hoppers_cycles_are_the_mean_of_the_kept_h100_and_h200_runs():
    """parsim.hardware.cluster.HOPPER_SM_CYCLES: benchmarks/gpu/score_kernels.py's fits on both GPUs, averaged."""
    import json

    fits = [json.loads((SC21_LAYER.parent / f"{gpu}-score-kernels-2026-11-26.json").read_text())["sm_cycles"]
            for gpu in ("h100", "h200")]

    def mean(*keys):
        values = []
        for fit in fits:
            for key in keys:
                fit = fit[key]
            values.append(fit)
        return sum(values) / 2

    figures = HOPPER_SM_CYCLES
    assert dict(figures.softmax) == pytest.approx({n: mean("softmax", str(n)) for n, _ in figures.softmax}, abs=6e-4)
    assert figures.dropout == pytest.approx(mean("dropout"), abs=6e-4)
    for kind in ("gelu", "norm"):
        assert getattr(figures, kind) == pytest.approx((mean(kind, "forward"), mean(kind, "backward")), abs=6e-4)


def test_hoppers_bias_add_is_the_mean_of_the_kept_h100_and_h200_runs():
    """The bias add's cycles, from the later runs of benchmarks/gpu/score_kernels.py that timed it (its row of
    executor.gpu_bench.sm_rows): seconds x SMs x clock over the elements read and written."""
    import json

    fits = []
    for gpu in ("h100", "h200"):
        run = json.loads((SC21_LAYER.parent / f"{gpu}-score-kernels-bias-2026-11-26.json").read_text())
        [timed] = [r for r in run["rows"] if r["work"].get("sm") == "bias_add"]
        fits.append(timed["measured_s"] * run["sm_cycles_per_s"] / timed["work"]["elements"])
    assert HOPPER_SM_CYCLES.bias_add == pytest.approx(sum(fits) / 2, abs=6e-4)
