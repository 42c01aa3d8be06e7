"""fp16 steps scale the loss as torch.amp.GradScaler does, and equal one process doing the same.

On 4 gloo ranks, fp16 plans of the tiny transformer scale the loss by 2^16,
unscale the gradients after the sync and check them for overflow over every
rank holding other gradients, then step: every rank's gradients and weights
equal the single-process reference's (which scales and unscales alike) to
fp16's precision, and the events are the simulator's (``unscale grads``,
``all_reduce found_inf dim=D``). In one process: an overflow anywhere skips
the step and halves the scale; good steps double it after the growth interval.
"""

from __future__ import annotations

import importlib.util

import pytest
from reference_runs import FIRST_STEP_SIGN_FLIP, FP16_EPS, assert_events_as_simulated, plan_runs, verify_plans

from parsim.workload.plan import load_plan

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
pytestmark = needs_torch

WORLD = 4
GPT = {"kind": "transformer", "name": "gpt", "num_layers": 4, "hidden": 32, "num_heads": 4, "num_kv_heads": 2,
       "ffn_hidden": 64, "seq_len": 16, "vocab_size": 64}
BATCH = {"microbatch_size": 2, "num_microbatches": 2}
BUCKETS = {"grad_sync": "bucketed", "bucket_size": "8KiB", "overlap": True}


def _plan(parallel: dict, data_parallel: dict = BUCKETS, **settings):
    return load_plan({"model": GPT, "parallel": parallel, "batch": BATCH, "data_parallel": data_parallel,
                      "dtype": "fp16", **settings})


PLANS = {
    "dp2 x pp2, 1f1b": _plan({"dp": 2, "pp": 2}),
    "zero1 dp2 x tp2": _plan({"dp": 2, "tp": 2}, dict(BUCKETS, zero=1)),
    "fsdp dp4": _plan({"dp": 4}, {"grad_sync": "fsdp"}),
    "dp2 x pp2, clipped to 0.05": _plan({"dp": 2, "pp": 2}, grad_clip=0.05),
}


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    return verify_plans(PLANS, WORLD, timeout_s=180)


def _runs(results, name: str) -> list[dict]:
    return plan_runs(results, PLANS, name)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", PLANS)
def test_an_fp16_step_with_loss_scaling_equals_the_single_process_step(results, name):
    plan = PLANS[name]
    runs = _runs(results, name)
    # clip_grad_norm_ on the reference's fp16 gradients rounds each norm, their norm and the coefficient to fp16;
    # the executor takes them in fp32: a few more roundings apart
    tolerance = (16 if plan.grad_clip is not None else 4) * FP16_EPS
    losses = 0
    for rank, r in enumerate(runs):
        if r["loss"] is not None:
            losses += 1
            assert r["loss"] == pytest.approx(r["reference_loss"], rel=4 * FP16_EPS), f"rank {rank}"
        assert r["max_grad_error"] < tolerance, f"rank {rank}: {r['worst_grad']}"
        assert r["max_param_error"] < FIRST_STEP_SIGN_FLIP, f"rank {rank}"
        if plan.grad_clip is not None:
            assert r["grad_norm"] == pytest.approx(r["reference_grad_norm"], rel=4 * FP16_EPS), f"rank {rank}"
    assert losses == plan.dp * plan.tp


@pytest.mark.multiproc
@pytest.mark.parametrize("name", PLANS)
def test_loss_scaling_events_are_named_as_the_simulator_names_them(results, name):
    assert_events_as_simulated(PLANS[name], _runs(results, name))


def test_an_overflow_skips_the_step_and_halves_the_scale_and_good_steps_double_it():
    import torch

    from executor.train.held_gradients import HeldGradients
    from executor.train.loss_scale import DynamicLossScaler
    from executor.train.trace_recorder import Recorder

    grads = [torch.full((4,), 8.0), torch.full((3,), 16.0, dtype=torch.float16)]
    held = HeldGradients(lambda: [(g, 1.0) for g in grads], [], Recorder(0), torch.device("cpu"))
    scaler = DynamicLossScaler(held, scale=8.0, growth_interval=2)
    assert scaler.unscale()
    assert grads[0].tolist() == [1.0] * 4 and grads[1].tolist() == [2.0] * 3  # divided by the scale
    scaler.update(True)
    assert scaler.scale == 8.0
    scaler.update(True)
    assert scaler.scale == 16.0  # two good steps in a row
    grads[1][0] = float("inf")
    assert not scaler.unscale()
    scaler.update(False)
    assert scaler.scale == 8.0
    assert [e.name for e in held.recorder.events] == ["unscale grads", "unscale grads"]
