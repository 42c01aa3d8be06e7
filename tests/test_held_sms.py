"""SMs held by data-parallel and FSDP collectives' NCCL kernels slow the compute beside them (parsim.sim.held_sms)."""

from __future__ import annotations

import json

import pytest

from parsim.cli.main import main
from parsim.hardware.cluster import load_cluster
from parsim.sim import held_sms
from parsim.sim.compute import ComputeModel, SmWork
from parsim.sim.program import Op, Program
from parsim.sim.step import predict_step
from parsim.sim.stepsim import StepSimulator
from parsim.units import format_time
from parsim.workload.plan import resolve_plan

GEMM = ((8192, 8192, 8192),)  # about 1.5 ms on an H100 in bf16
NODE = tuple(range(8))


def _h100() -> tuple[StepSimulator, ComputeModel]:
    cluster = load_cluster("dgx-h100")
    compute = ComputeModel.for_cluster(cluster, "bf16", 2)
    return StepSimulator(cluster.build(1), compute), compute


def _all_reduce(nbytes: float, deps: tuple[int, ...] = ()) -> Op:
    return Op("all_reduce dp", "collective", "comm", deps=deps, collective="all_reduce", group="dp", ranks=NODE,
              nbytes=nbytes, phase="dp")


def _gemm(name: str, matmuls=GEMM) -> Op:
    return Op(name, "compute", "compute", matmuls=matmuls, phase="backward")


def _events(sim: StepSimulator, program: Program) -> dict[str, tuple[float, float]]:
    return {e.name: (e.start_s, e.start_s + e.dur_s) for e in sim.run(program).events}


def _slowed_end(start_s: float, works: list[tuple[float, float]], held_from: float, held_to: float) -> float:
    """When back-to-back ops end, each ``(seconds on every SM, times as long on the SMs left)``, starting at
    ``start_s``, with the SMs held over ``[held_from, held_to)``: at each moment the work goes at the speed of
    that moment."""
    t = start_s
    for work, slowdown in works:
        for edge in (held_from, held_to, float("inf")):
            if t >= edge:
                continue
            rate = 1.0 / slowdown if held_from <= t < held_to else 1.0
            if work <= (edge - t) * rate:
                t += work / rate
                break
            work -= (edge - t) * rate
            t = edge
    return t


def test_a_gemm_beside_a_gradient_all_reduce_runs_on_the_sms_its_kernel_leaves():
    """Both start at 0: the GEMM runs on the SMs the all-reduce's channels leave until the all-reduce ends, then
    on every SM (:meth:`ComputeModel.beside_collective_time`, the tensor-parallel overlap's closed form)."""
    sim, compute = _h100()
    program = Program(8)
    program.add(0, _gemm("gemm"))
    program.add(0, _all_reduce(64 * 2**20))
    events = _events(sim, program)
    sms = sim.kernel_sms("all_reduce", NODE, 64 * 2**20)
    alone, reserved = compute.time(GEMM), compute.time(GEMM, sm_reserved=sms)
    collective_s = events["all_reduce dp"][1]
    assert sms > 0 and reserved > alone and collective_s < reserved
    assert events["gemm"][1] == pytest.approx(compute.beside_collective_time(alone, reserved, collective_s), rel=1e-12)


def test_a_collective_that_starts_under_way_slows_the_rest_of_the_chain():
    """Rank 1's short GEMM lets rank 0's all-reduce start while rank 0's first GEMM runs; the rest of that GEMM
    and the GEMM chained after it run on fewer SMs until the all-reduce ends."""
    sim, compute = _h100()
    small = ((2048, 2048, 2048),)
    program = Program(8)
    program.add(0, _gemm("first"))
    program.add(0, _gemm("second"))
    trigger = program.add(1, _gemm("trigger", small))
    program.add(0, _all_reduce(512 * 2**20, deps=(trigger,)))
    events = _events(sim, program)
    sms = sim.kernel_sms("all_reduce", NODE, 512 * 2**20)
    alone = compute.time(GEMM)
    slowdown = compute.time(GEMM, sm_reserved=sms) / alone
    held_from, held_to = events["trigger"][1], events["all_reduce dp"][1]
    assert 0 < held_from < events["first"][1] < held_to < events["second"][1]
    assert events["first"][1] == pytest.approx(_slowed_end(0.0, [(alone, slowdown)], held_from, held_to), rel=1e-12)
    assert events["second"][1] == pytest.approx(
        _slowed_end(0.0, [(alone, slowdown)] * 2, held_from, held_to), rel=1e-12)


def test_an_fsdp_step_on_a_gpu_pays_for_the_sms_its_collectives_hold(monkeypatch):
    """FSDP's gathers and reduce-scatters run beside the passes: holding SMs lengthens the compute, on a GPU;
    a CPU host's gloo holds none."""
    plan, cluster = resolve_plan("llama3-8b-fsdp8"), load_cluster("dgx-h100")
    held = predict_step(plan, cluster)
    monkeypatch.setattr(held_sms, "HOLDING_STREAMS", ())
    monkeypatch.setattr("parsim.sim.stepsim.HOLDING_STREAMS", ())
    free = predict_step(plan, cluster)
    assert held.step_s > free.step_s
    busy = lambda p: p.ranks[0].seconds["forward"] + p.ranks[0].seconds["backward"]  # noqa: E731
    assert busy(held) > busy(free)
    assert held.ranks[0].seconds["fsdp"] <= free.ranks[0].seconds["fsdp"]
    # what the prediction reports is what its compute phases gained
    compute = lambda p: sum(p.ranks[0].seconds[k] for k in ("forward", "backward", "recompute", "optimizer"))  # noqa
    assert free.held_sms_s == {} and held.held_sms_s[0] == pytest.approx(compute(held) - compute(free), rel=1e-9)


def test_simulate_says_what_the_held_sms_cost(capsys):
    """``parsim simulate`` names the cost in one line (the prediction's figure and its share of the step) and
    per rank in its JSON; where it is under 0.1% of the step (the default plan's), no line."""
    held = predict_step(resolve_plan("llama3-8b-fsdp8"), load_cluster("dgx-h100"))
    seconds = held.held_sms_s[0]
    assert main(["simulate", "llama3-8b-fsdp8"]) == 0
    assert (f"SMs held by communication kernels (data-parallel, FSDP and paired expert all-to-alls: NCCL's "
            f"one per channel, DeepEP's 20) slowed the compute beside them by {format_time(seconds)} on rank 0 "
            f"({seconds / held.step_s:.1%} of the step") \
        in capsys.readouterr().out
    assert main(["simulate", "llama3-8b-fsdp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"][0]["held_sms_s"] == seconds
    assert main(["simulate"]) == 0
    assert "SMs held" not in capsys.readouterr().out
    assert main(["simulate", "course-ddp", "--cluster", "dgx-a100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"][0]["held_sms_s"] == 0


def test_the_attention_core_and_the_kernels_the_sms_bound_run_at_the_share_of_sms_left():
    """Beside a kernel holding 24 of an H100's 132 SMs, FlashAttention's thread blocks and a softmax's SM cycles
    spread over the 108 left: 132/108 times as long; a memory-bound copy keeps its speed."""
    _, compute = _h100()
    spread = 132 / 108
    attention = compute.time(attention_flops=1e12, attention_grad_flops=2e12)
    assert compute.time(attention_flops=1e12, attention_grad_flops=2e12, sm_reserved=24) == \
        pytest.approx(attention * spread, rel=1e-12)
    assert compute.time(hbm_bytes=1e9, sm_reserved=24) == compute.time(hbm_bytes=1e9)
    cycles_s = compute.sm_excess(((0.0, (SmWork("softmax", 2**30, row=8192),)),))
    assert cycles_s > 0 and compute.sm_excess(((0.0, (SmWork("softmax", 2**30, row=8192),)),), spread) == \
        pytest.approx(cycles_s * spread, rel=1e-12)
