"""Expert all-to-alls beside the compute of a paired pass (``ep_comm_overlap``): DualPipe-V's pairs and
Megatron-LM's combined 1F1B (without a pipeline, or interleaved); and DeepSeek's fp8 dispatch
(``dispatch_fp8``)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from parsim.cli.main import main
from parsim.hardware.cluster import load_cluster
from parsim.lowering.lower import lower
from parsim.schedules import combined_1f1b, combined_interleaved_1f1b, make_schedule, peak_in_flight, validate
from parsim.sim.step import predict_step
from parsim.workload.memory import memory
from parsim.workload.model import load_model
from parsim.workload.plan import Plan, load_plan

# Four MoE layers of 64 experts, top-8, no dense layer: all-to-alls on two nodes weigh as much as the GEMMs.
MOE = load_model({"kind": "transformer", "name": "moe", "num_layers": 4, "hidden": 2048, "num_heads": 16,
                  "num_kv_heads": 8, "ffn_hidden": 8192, "seq_len": 4096, "vocab_size": 32000,
                  "num_experts": 64, "experts_per_token": 8, "expert_ffn_hidden": 1024})
H100 = load_cluster("dgx-h100")


def moe_plan(overlap: bool, **kw) -> Plan:
    base = dict(model=MOE, dp=16, ep=16, dtype="bf16", microbatch_size=1, num_microbatches=8)
    return Plan(**{**base, **kw}, ep_comm_overlap=overlap)


def test_combined_1f1b_runs_each_next_forward_with_the_backward_before_it():
    schedule = combined_1f1b(make_schedule("1f1b", 1, 4))
    assert schedule.format() == "rank 0: F0 F1 B0 F2 B1 F3 B2 B3"
    assert schedule.paired == (frozenset({1, 3, 5}),)
    validate(schedule)
    assert peak_in_flight(schedule) == [2]  # Megatron-LM holds two microbatches' activations


def test_dualpipe_v_pairs_a_forward_with_the_other_chunk_s_backward():
    pp, m = 4, 12
    schedule = make_schedule("dualpipe-v", pp, m)
    for rank, actions in enumerate(schedule.actions):
        paired = schedule.paired[rank]
        # DualPipeV.step: 2 pairs in each of step 4's rounds, one in each of step 5's, but for the last rank's
        # first forward and backward ("We don't overlap these two chunks to further reduce bubble size")
        assert len(paired) == 2 * (m - 2 * pp + rank + 1) + (pp - rank - 1) - (rank == pp - 1)
        for i in paired:
            forward, backward = actions[i], actions[i + 1]
            assert forward.kind == "F" and backward.kind == "B" and forward.stage != backward.stage
            assert {forward.stage, backward.stage} == set(schedule.stages_of(rank))


def test_megatron_s_interleaved_schedule_warms_up_one_more_forward_and_pairs_the_steady_state():
    pp, m, v = 4, 8, 2
    plain, combined = make_schedule("interleaved-1f1b", pp, m, v), combined_interleaved_1f1b(pp, m, v)
    validate(combined)
    for rank, (before, after) in enumerate(zip(plain.actions, combined.actions)):
        warmup = next(i for i, a in enumerate(after) if a.kind == "B") - 1  # the first pair's forward
        assert warmup == next(i for i, a in enumerate(before) if a.kind == "B")  # one more forward first
        assert sorted(after) == sorted(before)
        paired = combined.paired[rank]
        assert paired == frozenset(range(warmup, warmup + 2 * (m * v - warmup), 2))
        for i in paired:  # each pair's forward and backward are independent: another stage or microbatch
            f, b = after[i], after[i + 1]
            assert (f.kind, b.kind) == ("F", "B") and (f.stage, f.microbatch) != (b.stage, b.microbatch)
    assert [p - q for p, q in zip(peak_in_flight(combined), peak_in_flight(plain))] == [1] * pp


def test_an_interleaved_pipeline_overlaps_its_pairs_without_stalling():
    kw = dict(dp=8, pp=2, ep=8, schedule="interleaved-1f1b", virtual_stages=2, num_microbatches=8)
    alone, paired = (predict_step(moe_plan(overlap, **kw), H100) for overlap in (False, True))
    assert paired.step_s < 0.9 * alone.step_s
    assert max(m.activations for m in memory(moe_plan(True, **kw))) > max(
        m.activations for m in memory(moe_plan(False, **kw)))  # one more microbatch in flight


def test_a_paired_pass_runs_its_all_to_alls_on_their_own_stream():
    program = lower(moe_plan(True))
    a2a = [op for op in program.ops if op.group == "ep"]
    first_forward = [op for op in a2a if "mb=0 dir=fwd" in op.name]
    last_backward = [op for op in a2a if "mb=7 dir=bwd" in op.name]
    assert {op.stream for op in first_forward + last_backward} == {"compute"}  # alone: in line
    counts = [op for op in a2a if op.nbytes == 8 * 64]  # the dispatch's counts: an int64 per expert
    assert counts and {op.stream for op in counts} == {"compute"}  # the pass waits for them
    paired = [op for op in a2a if op not in first_forward + last_backward + counts]
    # the rows' all-to-alls (4 layers x 8 microbatches x 4) but mb 0's forward and mb 7's backward (2 a layer each)
    assert len(paired) == 4 * 8 * 4 - 2 * 4 * 2 and {op.stream for op in paired} == {"ep"}
    # Each waits for the compute before it in its own pass, and that pass's next compute waits for it.
    ops = program.ops
    for op in paired:
        assert all(ops[d].stream in ("compute", "ep") for d in op.deps)
        after = [o for o in ops if op.id in o.deps]
        assert after and all(o.stream in ("compute", "ep") for o in after)
    assert lower(moe_plan(False)).ops[0].stream == "compute"
    assert all(op.stream == "compute" for op in lower(moe_plan(False)).ops if op.group == "ep")


def test_overlapped_all_to_alls_hide_behind_the_other_pass_s_compute():
    alone, paired = (predict_step(moe_plan(overlap), H100) for overlap in (False, True))
    events = [e for e in paired.trace.events if e.rank == 0]
    compute = sum(e.dur_s for e in events if e.stream == "compute" and e.kind == "compute")
    exchanged = sum(e.dur_s for e in events if e.stream == "ep")
    assert exchanged > 0.3 * compute  # the all-to-alls weigh: there is something to hide
    assert paired.step_s < alone.step_s - 0.5 * exchanged
    assert paired.step_s > max(compute, exchanged)
    # The all-to-alls ran while the compute stream worked on the other pass.
    busy = [(e.start_s, e.end_s) for e in events if e.stream == "compute" and e.kind == "compute"]
    beside = sum(max(0.0, min(b, e.end_s) - max(a, e.start_s)) for e in events if e.stream == "ep"
                 for a, b in busy)
    assert beside > 0.5 * exchanged
    # The step's breakdown counts as the ep phase the all-to-alls of the passes run alone (the first forward,
    # the last backward), in line, and of the paired ones what the compute did not cover.
    in_line = sum(e.dur_s for e in events if e.stream == "compute" and e.args.get("phase") == "ep")
    # (the dispatches' counts, in line, may run while the other pass's all-to-all is under way: counted once)
    in_line -= sum(max(0.0, min(e.end_s, o.end_s) - max(e.start_s, o.start_s)) for e in events
                   if e.stream == "compute" and e.args.get("phase") == "ep" for o in events if o.stream == "ep")
    assert paired.ranks[0].seconds["ep"] == pytest.approx(in_line + exchanged - beside, rel=1e-9)
    assert paired.ranks[0].seconds["ep"] < 0.5 * alone.ranks[0].seconds["ep"]


def test_their_kernels_hold_sms_from_the_compute_beside_them():
    paired = predict_step(moe_plan(True), H100)
    assert paired.trace.meta["held_sms_s"]["0"] > 0


def test_dualpipe_v_s_pairs_send_once_both_passes_end_and_the_next_pass_waits_for_the_sends():
    plan = moe_plan(True, dp=8, pp=2, ep=8, schedule="dualpipe-v", num_microbatches=16)
    program = lower(plan)
    ops = program.ops
    sends = [op for op in ops if op.kind == "send" and len(op.deps) == 2]
    assert sends  # a pair's sends wait for the last op of each of its passes
    waiters = Counter(d for op in ops if op.stream == "compute" for d in op.deps if ops[d].kind == "send")
    # the next pass waits for them; where that is a pair, both its passes do
    assert all(waiters[op.id] >= 1 for op in sends) and sum(waiters[op.id] == 2 for op in sends) > 0.9 * len(sends)
    overlapped, alone = predict_step(plan, H100), predict_step(dataclasses.replace(plan, ep_comm_overlap=False), H100)
    assert overlapped.step_s < alone.step_s


def test_combined_1f1b_holds_two_microbatches_activations():
    one, two = memory(moe_plan(False))[0], memory(moe_plan(True))[0]
    assert two.activations == pytest.approx(2 * one.activations)


def test_the_settings_round_trip_through_a_plan_file():
    plan = moe_plan(True, dtype="fp8", dispatch_fp8=True)
    again = load_plan(plan.to_dict())
    assert again.ep_comm_overlap and again.dispatch_fp8 and again.pipeline.paired == plan.pipeline.paired


def test_fp8_dispatch_sends_tokens_and_down_projection_gradients_in_fp8_with_their_scales():
    def a2a_bytes(plan: Plan) -> dict[str, float]:
        return {op.name.split(" mb=")[1]: op.nbytes for op in lower(plan).ops
                if op.group == "ep" and " layer=layer.1 mb=0 " in op.name}

    bf16, fp8 = (a2a_bytes(moe_plan(False, dtype="fp8", dispatch_fp8=on)) for on in (False, True))
    assert set(bf16) == {"0 dir=fwd0", "0 dir=fwd1", "0 dir=fwd2", "0 dir=bwd0", "0 dir=bwd1"}
    # dispatch (fwd1, after the counts) and the combine's gradient (bwd0): one byte an element and an fp32
    # scale per 128
    for name in ("0 dir=fwd1", "0 dir=bwd0"):
        assert fp8[name] == pytest.approx(bf16[name] / 2 * (1 + 4 / 128))
    for name in ("0 dir=fwd0", "0 dir=fwd2", "0 dir=bwd1"):  # the counts, the combine, the dispatch's gradient
        assert fp8[name] == bf16[name]


@pytest.mark.parametrize("flags, message", [
    (["--model", "tiny-gpt", "--dp", "2"], "tiny-gpt is a dense model: it has no expert all-to-alls for "
                                           "ep_comm_overlap"),
    (["--model", "deepseek-v3", "--dp", "16", "--ep", "1", "--dtype", "bf16"], "with ep 1 there are none"),
    (["--model", "deepseek-v3", "--dp", "8", "--ep", "8", "--pp", "2", "--dtype", "bf16"],
     "1f1b with pp 2 is not modelled (--no-ep-comm-overlap turns it off)"),
    (["--model", "deepseek-v3", "--dp", "16", "--ep", "16", "--dtype", "bf16", "--dispatch-fp8"],
     "it needs dtype fp8 (this plan: bf16; --no-dispatch-fp8 turns it off)"),
    (["--model", "deepseek-v3", "--dp", "16", "--ep", "16", "--dtype", "bf16", "--activation-recompute", "full"],
     "ep_comm_overlap with full recomputation: Megatron-LM refuses it"),
])
def test_plans_it_cannot_pair_or_dispatch_in_fp8_are_refused_in_one_line(flags, message, capsys):
    assert main(["simulate", *flags, "--ep-comm-overlap"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err


def test_plan_show_and_the_simulate_header_say_how_the_all_to_alls_run(capsys):
    assert main(["plan", "show", "deepseek-v3-2048"]) == 0
    shown = capsys.readouterr().out
    assert ("NVLink to the experts' GPUs) dispatch and combine, tokens and their gradients into the experts in fp8, "
            "each beside the compute of the pass paired with its own (ep_comm_overlap)") in shown
    features = ", ".join(moe_plan(True, dtype="fp8", dispatch_fp8=True).features())
    assert "ep 16, all-to-alls beside the paired pass's compute, dispatched in fp8" in features


def test_the_executor_refuses_it():
    from executor.train.runner import check_plan

    from parsim.errors import ParsimError
    with pytest.raises(ParsimError, match="does not execute expert all-to-alls beside the compute"):
        check_plan(moe_plan(True))
