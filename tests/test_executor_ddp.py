"""Data parallelism on 4 gloo ranks equals one process training on the whole batch.

The lecture's DDP (one all-reduce with average per parameter, in reverse
order, after the backward) and torch DDP's buckets (serial, or overlapped with
the backward through gradient hooks, with gradient accumulation over
microbatches): every rank's loss equals the reference's on its rows, its
gradients equal the full-batch gradients, and its weights after one AdamW
step equal the reference's. The events are those the simulator names.
"""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest
from reference_runs import verify_plans

from parsim.lowering.lower import lower
from parsim.workload.plan import load_plan

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
pytestmark = needs_torch

WORLD = 4
MLP = {"kind": "mlp", "name": "mlp", "num_layers": 4, "width": 64, "batch_size": 16}
GPT = {"kind": "transformer", "name": "gpt", "num_layers": 2, "hidden": 32, "num_heads": 4, "num_kv_heads": 2,
       "ffn_hidden": 64, "seq_len": 16, "vocab_size": 64}
LAYER_BYTES = 64 * 64 * 4

PLANS = {
    "course per-parameter all-reduce": load_plan({
        "model": MLP, "parallel": {"dp": WORLD}, "data_parallel": {"grad_sync": "per_param"}}),
    "buckets overlapped, 2 microbatches": load_plan({
        "model": MLP, "parallel": {"dp": WORLD}, "batch": {"num_microbatches": 2},
        "data_parallel": {"grad_sync": "bucketed", "bucket_size": 2 * LAYER_BYTES, "overlap": True}}),
    "buckets after the backward": load_plan({
        "model": MLP, "parallel": {"dp": WORLD},
        "data_parallel": {"grad_sync": "bucketed", "bucket_size": 3 * LAYER_BYTES, "overlap": False}}),
    "buckets after the backward, fused AdamW": load_plan({
        "model": MLP, "parallel": {"dp": WORLD}, "adamw": "fused",
        "data_parallel": {"grad_sync": "bucketed", "bucket_size": 3 * LAYER_BYTES, "overlap": False}}),
    "transformer buckets overlapped": load_plan({
        "model": GPT, "parallel": {"dp": WORLD}, "batch": {"microbatch_size": 1, "num_microbatches": 2},
        "data_parallel": {"grad_sync": "bucketed", "bucket_size": "8KiB", "overlap": True}}),
}


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    return verify_plans(PLANS, WORLD)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", PLANS)
def test_data_parallel_step_equals_single_process(results, name):
    index = list(PLANS).index(name)
    for rank in range(WORLD):
        r = results[rank][index]
        assert r["loss"] == pytest.approx(r["reference_loss"], rel=1e-5), f"rank {rank}"
        assert r["max_grad_error"] < 1e-5, f"rank {rank}: {r['worst_grad']}"
        assert r["max_param_error"] < 1e-4, f"rank {rank}"


@pytest.mark.multiproc
@pytest.mark.parametrize("name", PLANS)
def test_gradient_sync_events_are_named_as_the_simulator_names_them(results, name):
    plan = PLANS[name]
    predicted = lower(plan).rank_ops(0)
    measured = results[0][list(PLANS).index(name)]["events"]
    dp_names = Counter(op.name for op in predicted if op.phase == "dp")
    assert Counter(n for n in measured if " dp " in n) == dp_names
    assert len(dp_names) == (4 if plan.grad_sync == "per_param" else len(dp_names))
    assert set(measured) == {op.name for op in predicted}


def test_buckets_fill_in_order_up_to_the_size_and_never_split_a_parameter():
    import torch

    from executor.train.parallel import _buckets

    params = [torch.zeros(n) for n in (10, 10, 30, 5, 5, 5)]  # 40, 40, 120, 20, 20, 20 bytes
    sizes = [[p.numel() for p in bucket] for bucket in _buckets(params, bucket_size=100)]
    assert sizes == [[10, 10], [30], [5, 5, 5]]
    assert [[p.numel() for p in b] for b in _buckets(params, bucket_size=1)] == [[10], [10], [30], [5], [5], [5]]
