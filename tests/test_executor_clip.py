"""Gradient clipping on 4 gloo ranks equals ``clip_grad_norm_`` in one process, however the plan splits gradients.

Each plan takes one step with ``grad_clip`` well under the tiny models'
gradient norm, so every gradient is scaled: every rank must find the
reference's global norm and hold the reference's clipped gradients (and
weights after AdamW). The layouts cover each way a gradient can be split or
copied: data-parallel replicas, ZeRO-1/2 slices (with tensor-parallel copies
of the norms inside them), FSDP and HSDP shards, tensor-parallel slices and
copies, pipeline stages with a tied table's two copies, routed experts over
expert-parallel ranks, fp32 master weights beside bf16 ones. The events are
the simulator's: ``grad norm`` and one ``all_reduce grad_norm dim=D`` per
dimension that holds different gradients.
"""

from __future__ import annotations

import importlib.util

import pytest
from reference_runs import (BF16_EPS, FIRST_STEP_SIGN_FLIP, assert_events_as_simulated, assert_step_equals_reference,
                            plan_runs, verify_plans)

from parsim.workload.plan import load_plan

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
pytestmark = needs_torch

WORLD = 4
CLIP = 0.05
GPT = {"kind": "transformer", "name": "gpt", "num_layers": 4, "hidden": 32, "num_heads": 4, "num_kv_heads": 2,
       "ffn_hidden": 64, "seq_len": 16, "vocab_size": 64}
MOE = dict(GPT, name="moe", num_experts=4, experts_per_token=2, expert_ffn_hidden=32, shared_experts=1,
           dense_layers=1)
BATCH = {"microbatch_size": 2, "num_microbatches": 2}
BUCKETS = {"grad_sync": "bucketed", "bucket_size": "8KiB", "overlap": True}


def _plan(parallel: dict, model: dict = GPT, data_parallel: dict = BUCKETS, **settings):
    return load_plan({"model": model, "parallel": parallel, "batch": BATCH, "data_parallel": data_parallel,
                      "grad_clip": CLIP, **settings})


PLANS = {
    "dp4 buckets": _plan({"dp": 4}),
    "dp2 x pp2, 1f1b": _plan({"dp": 2, "pp": 2}),
    "tp2 x pp2, zero-bubble, tied across stages": _plan({"tp": 2, "pp": 2}, dict(GPT, tied_embeddings=True),
                                                        schedule="zero-bubble"),
    "zero1 dp2 x tp2": _plan({"dp": 2, "tp": 2}, data_parallel=dict(BUCKETS, zero=1)),
    "zero2 dp4, hsdp shard_group 2": _plan({"dp": 4}, data_parallel=dict(BUCKETS, zero=2, shard_group=2)),
    "fsdp dp2 x tp2 (2-D)": _plan({"dp": 2, "tp": 2}, data_parallel={"grad_sync": "fsdp"}),
    "fsdp dp4, hsdp shard_group 2": _plan({"dp": 4}, data_parallel={"grad_sync": "fsdp", "shard_group": 2}),
    "moe dp4 ep2": _plan({"dp": 4, "ep": 2}, MOE),
    "moe dp4 ep2, zero1 (experts sharded over the 2 holding them)": _plan({"dp": 4, "ep": 2}, MOE,
                                                                          data_parallel=dict(BUCKETS, zero=1)),
    "moe dp4 ep2, fsdp": _plan({"dp": 4, "ep": 2}, MOE, data_parallel={"grad_sync": "fsdp"}),
    "bf16 master weights, dp2 x pp2": _plan({"dp": 2, "pp": 2}, dtype="bf16"),
}


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    return verify_plans(PLANS, WORLD, timeout_s=180)


def _runs(results, name: str) -> list[dict]:
    return plan_runs(results, PLANS, name)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", PLANS)
def test_every_rank_finds_the_global_norm_and_clips_as_one_process(results, name):
    plan = PLANS[name]
    runs = _runs(results, name)
    tolerance = 4 * BF16_EPS if plan.dtype == "bf16" else 1e-5
    for rank, r in enumerate(runs):
        assert r["reference_grad_norm"] > 4 * CLIP  # every gradient is scaled down
        assert r["grad_norm"] == pytest.approx(r["reference_grad_norm"], rel=tolerance), f"rank {rank}"
    if plan.dtype == "bf16":  # the executor clips fp32 main gradients, the reference its bf16 gradients
        for rank, r in enumerate(runs):
            assert r["max_grad_error"] < 4 * BF16_EPS, f"rank {rank}: {r['worst_grad']}"
            assert r["max_param_error"] < FIRST_STEP_SIGN_FLIP, f"rank {rank}"
    else:
        assert_step_equals_reference(plan, runs)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", PLANS)
def test_clipping_events_are_named_as_the_simulator_names_them(results, name):
    assert_events_as_simulated(PLANS[name], _runs(results, name))
