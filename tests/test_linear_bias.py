"""Linear biases (``linear_bias``), priced as Megatron-LM's GPT runs them: parameters, the QKV bias's own kernel,
the gradients' sums over the tokens, the sequence-parallel gradient sum, and both tiers agreeing."""

from __future__ import annotations

import pytest

from parsim.errors import ConfigError
from parsim.hardware.cluster import HOPPER_SM_CYCLES, load_cluster
from parsim.lowering.kernels import block_work
from parsim.lowering.lower import lower
from parsim.search.fast import FastModel
from parsim.search.space import Candidate, SearchSpace, enumerate_settings
from parsim.sim.compute import SmWork
from parsim.sim.step import predict_step
from parsim.workload.model import load_model
from parsim.workload.plan import Plan

H, F, HEADS, KV_HEADS, LAYERS = 1024, 4096, 16, 4, 4
GPT = {"kind": "transformer", "name": "gpt", "num_layers": LAYERS, "hidden": H, "num_heads": HEADS,
       "num_kv_heads": KV_HEADS, "ffn_hidden": F, "ffn_type": "gelu", "seq_len": 512, "vocab_size": 1000}
QKV = H + 2 * H * KV_HEADS // HEADS  # queries, keys and values per token


def model(bias: bool = True, **keys):
    return load_model({**GPT, "linear_bias": bias, **keys})


def test_every_linear_has_a_bias_split_as_its_outputs_are():
    assert model().describe().endswith(", linear biases") and "bias" not in model(False).describe()
    added = model().num_params - model(False).num_params
    assert added == LAYERS * (QKV + H + F + H)
    layer = next(c for c in Plan(model=model(), tp=4).stage_costs(0) if c.name == "layer.0")
    plain = next(c for c in Plan(model=model(False), tp=4).stage_costs(0) if c.name == "layer.0")
    # column-parallel biases split with their outputs; row-parallel ones whole on every rank
    assert layer.params_per_rank(4) - plain.params_per_rank(4) == QKV // 4 + H + F // 4 + H
    swiglu = load_model({**GPT, "ffn_type": "swiglu", "linear_bias": True}).num_params
    assert swiglu - load_model({**GPT, "ffn_type": "swiglu"}).num_params == LAYERS * (QKV + H + 2 * F + H)


def kernels(plan: Plan, block: int, kind: str) -> dict:
    layer = next(c for c in plan.stage_costs(0) if c.name == "layer.0")
    work = block_work(plan, layer.blocks[block], kind, plan.tokens_per_rank)
    return {name: (nbytes, works) for name, nbytes, works in work.elementwise_parts}


@pytest.mark.parametrize("tp, sp", [(1, False), (4, False), (4, True)])
def test_the_qkv_bias_add_and_the_gradient_sums_by_their_bytes(tp, sp):
    """fp16: the QKV bias read and written in its own kernel (SM cycles per element read or written); backward,
    each gradient read once by its sum over the tokens. Row-parallel outputs are whole on a rank unless
    sequence parallelism splits them."""
    plan = Plan(model=model(), tp=tp, sequence_parallel=sp, dtype="fp16")
    tokens, d = plan.tokens_per_rank, 2
    row = H // tp if sp else H
    forward = kernels(plan, 0, "F")
    assert forward["attn.qkv.bias"] == (2 * QKV // tp * tokens * d, (SmWork("bias_add", 2 * QKV // tp * tokens),))
    attention, mlp = kernels(plan, 0, "B"), kernels(plan, 1, "B")
    assert attention["attn.qkv.bias"] == (QKV // tp * tokens * d, ())  # streams at the memory speed
    assert attention["attn.o.bias.grad"] == (row * tokens * d, ())
    assert mlp["mlp.in.bias.grad"] == (F // tp * tokens * d, ())
    assert mlp["mlp.out.bias.grad"] == (row * tokens * d, ())
    assert "mlp.in.bias.grad" not in kernels(plan, 1, "F")  # the bias goes into the GeLU's kernel


def test_eager_layers_add_their_biases_in_the_matmul_and_only_sum_the_gradients():
    plan = Plan(model=model(layer_kernels="eager"), dtype="bf16")
    assert sum(nbytes for name, (nbytes, _) in kernels(plan, 0, "F").items() if "bias" in name) == 0
    assert kernels(plan, 0, "B")["attn.qkv.bias.grad"] == (QKV * plan.tokens_per_rank * 2, ())


def test_the_bias_add_runs_as_long_as_the_sms_need(tmp_path, capsys):
    """On an H100 the broadcast add takes its SM cycles, longer than its bytes at the memory speed."""
    import json

    import yaml

    from parsim.cli.main import main

    path = tmp_path / "gpt.yaml"
    path.write_text(yaml.safe_dump({"model": {**GPT, "linear_bias": True}, "parallel": {"dp": 1}, "dtype": "fp16",
                                    "batch": {"microbatch_size": 8, "global_batch_size": 8}}))
    assert main(["explain", "compute", str(path), "--cluster", "dgx-h100", "--json"]) == 0
    rows = {(r["pass"], r["kernel"]): r for r in json.loads(capsys.readouterr().out)["kernels"]}
    add = rows[("F", "attn.qkv.bias")]
    elements = 2 * QKV * 8 * 512
    assert add["bound"] == "SMs"
    assert add["time_s"] == pytest.approx(elements * HOPPER_SM_CYCLES.bias_add / (132 * 1.98e9))


def test_sequence_parallelism_sums_the_row_biases_gradients_with_the_norms():
    """Megatron-LM's finalize_model_grads all-reduces every parameter sequence parallelism splits the inputs of:
    the norm gains and the row-parallel biases (h each), on each pipeline rank."""
    def summed(m) -> list[float]:
        plan = Plan(model=m, tp=2, pp=2, num_microbatches=2, sequence_parallel=True, dtype="bf16")
        return sorted(op.nbytes for op in lower(plan).ops
                      if op.name == "all_reduce tp params=norms" and op.rank in (0, plan.rank_of(pp=1)))

    layers_per_stage = LAYERS // 2
    added = [b - p for b, p in zip(summed(model()), summed(model(False)))]
    assert added == [2 * H * layers_per_stage * 4] * 2  # fp32 gradients under bf16 mixed precision


def test_both_tiers_price_the_biases_alike():
    """A biased GPT on 4 H100s, the first variant of every setting (tensor- and sequence-parallel ones
    included, no FSDP): the fast tier's memory is the event simulation's, its step is off the simulation's by
    what it is off without biases (contention it prices alone, docs/search.md), and the biases cost time."""
    cluster = load_cluster("dgx-h100")
    off, steps = {}, {}
    for bias in (True, False):
        space = SearchSpace(model(bias), 4, 4, dtype="bf16")
        fast = FastModel(space, cluster)
        prepared = [fast.prepare(s, variants) for s, variants in enumerate_settings(space)]
        jobs = [(p, 0) for p in prepared if not p.variants[0].fsdp]
        for (prep, i), estimate in zip(jobs, fast.estimate(jobs)):
            plan = Candidate(prep.setting, prep.variants[i]).plan(space)
            simulated = predict_step(plan, cluster)
            key = (bias, prep.setting)
            off[key], steps[key] = estimate.step_s / simulated.step_s - 1, estimate.step_s
            assert estimate.memory_bytes == pytest.approx(max(m.total for m in simulated.memory), rel=1e-12)
    settings = [s for bias, s in off if bias]
    assert len(settings) > 30 and all((False, s) in off for s in settings)
    assert max(abs(off[True, s] - off[False, s]) for s in settings) < 3e-3
    assert min(steps[True, s] / steps[False, s] for s in settings) > 1


@pytest.mark.parametrize("keys, problem", [
    ({"linear_bias": "yes"}, "linear_bias"),
    ({"linear_bias": True, "num_experts": 8}, "linear_bias"),
    ({"linear_bias": True, "attention": "mla", "num_kv_heads": HEADS}, "linear_bias"),
])
def test_biases_the_model_does_not_price_are_refused_naming_the_key(keys, problem):
    with pytest.raises(ConfigError, match=problem):
        load_model({**GPT, **keys})
