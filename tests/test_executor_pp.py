"""The pipeline runtime executes parsim's schedules on 2 gloo ranks, and trains exactly like one process.

For every schedule (GPipe, 1F1B, also with fewer microbatches than ranks,
interleaved 1F1B with 2 virtual stages per rank, also in one round of 3
microbatches as torch runs an odd count, ZB-H1 and ZB-H2 with their split
I / W backward, ZB-V, DualPipe-V), on the tiny transformer and on the course
MLP: each rank runs precisely the action list the simulator
times, in that order; the loss, the gradients and the weights after one AdamW
step equal the unpipelined model's; and the transfers are the simulator's, by
name and count.
"""

from __future__ import annotations

import importlib.util
import re
from collections import Counter

import pytest
from reference_runs import verify_plans

from parsim.lowering.lower import lower
from parsim.report.trace import compute_name
from parsim.workload.plan import load_plan

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
pytestmark = needs_torch

WORLD = 2
MLP = {"kind": "mlp", "name": "mlp", "num_layers": 4, "width": 64, "batch_size": 16}
GPT = {"kind": "transformer", "name": "gpt", "num_layers": 4, "hidden": 32, "num_heads": 4, "num_kv_heads": 2,
       "ffn_hidden": 64, "seq_len": 16, "vocab_size": 64}
COMPUTE = re.compile(r"^[FBIW] stage=\d+ mb=\d+$")


def gpt_plan(schedule: str, virtual_stages: int = 1, model: dict = GPT, microbatches: int = 4, **extra):
    return load_plan({"model": model, "parallel": {"pp": WORLD},
                      "batch": {"microbatch_size": 2, "num_microbatches": microbatches},
                      "schedule": schedule, "virtual_stages": virtual_stages, **extra})


PLANS = {
    "gpipe": gpt_plan("gpipe"),
    "1f1b": gpt_plan("1f1b"),
    "interleaved-1f1b v2": gpt_plan("interleaved-1f1b", 2),
    "interleaved-1f1b v2, 3 microbatches (torch's one round of 3)": gpt_plan("interleaved-1f1b", 2, microbatches=3),
    "1f1b, 1 microbatch (fewer than ranks)": gpt_plan("1f1b", microbatches=1),
    "zero-bubble": gpt_plan("zero-bubble"),
    "zb-h2": gpt_plan("zb-h2"),
    "1f1b, uneven stages (1 + 3 layers)": gpt_plan("1f1b", layers_per_stage=[1, 3]),
    "zbv (two stages per rank in a V)": gpt_plan("zbv", 2),
    "dualpipe-v": gpt_plan("dualpipe-v", 2),
    "zero-bubble, gelu, learned positions, tied embeddings": gpt_plan(
        "zero-bubble", model=dict(GPT, ffn_type="gelu", position_embedding="learned", tied_embeddings=True)),
    "course mlp, gpipe": load_plan({"model": MLP, "parallel": {"pp": WORLD}, "batch": {"num_microbatches": 4},
                                    "schedule": "gpipe"}),
    "course mlp, zero-bubble": load_plan({"model": MLP, "parallel": {"pp": WORLD}, "batch": {"num_microbatches": 4},
                                          "schedule": "zero-bubble"}),
}


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    return verify_plans(PLANS, WORLD)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", PLANS)
def test_pipelined_step_equals_single_process(results, name):
    index = list(PLANS).index(name)
    plan = PLANS[name]
    loss_rank = next(r for r in range(WORLD) if plan.num_stages - 1 in plan.stages_of(r))  # holds the last stage
    for rank in range(WORLD):
        r = results[rank][index]
        if rank == loss_rank:
            assert r["loss"] is not None and r["loss"] == pytest.approx(r["reference_loss"], rel=1e-5)
        assert r["max_grad_error"] < 1e-5, f"rank {rank}: {r['worst_grad']}"
        assert r["max_param_error"] < 1e-4, f"rank {rank}"


@pytest.mark.multiproc
@pytest.mark.parametrize("name", PLANS)
def test_each_rank_runs_the_schedule_action_list_in_order(results, name):
    schedule = PLANS[name].pipeline
    for rank in range(WORLD):
        ran = [n for n in results[rank][list(PLANS).index(name)]["events"] if COMPUTE.match(n)]
        assert ran == [compute_name(a.kind, a.stage, a.microbatch) for a in schedule.actions[rank]]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", PLANS)
def test_transfers_are_the_simulated_ones(results, name):
    program = lower(PLANS[name])
    for rank in range(WORLD):
        predicted = Counter(op.name for op in program.rank_ops(rank) if op.kind in ("send", "recv"))
        measured = Counter(n for n in results[rank][list(PLANS).index(name)]["events"]
                           if n.startswith(("send ", "recv ")))
        assert measured == predicted, f"rank {rank}"
