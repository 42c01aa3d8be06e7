"""The fast tier against the simulator: memory exactly, step times closely, bounds below estimates."""

from __future__ import annotations

import numpy as np
import pytest
from simulated import steps_and_memory

from parsim.hardware.cluster import load_cluster
from parsim.schedules import SCHEDULES, in_flight_by_stage, make_schedule
from parsim.search.fast import KINDS, FastModel, _drained_stages, schedule_facts
from parsim.search.space import Candidate, SearchSpace, enumerate_settings
from parsim.sim.step import predict_step
from parsim.workload.memory import memory
from parsim.workload.model import load_model


@pytest.fixture(scope="module")
def small():
    """Every plan of tiny-gpt on 4 H100s with a batch of 2 sequences, estimated."""
    space = SearchSpace(load_model("tiny-gpt"), 4, 2, dtype="bf16")
    cluster = load_cluster("dgx-h100")
    fast = FastModel(space, cluster)
    prepared = [fast.prepare(s, variants) for s, variants in enumerate_settings(space)]
    jobs = [(p, i) for p in prepared for i in range(len(p.variants))]
    return space, cluster, jobs, fast.estimate(jobs)


def test_memory_is_exactly_the_simulators_for_every_plan(small):
    space, _, jobs, estimates = small
    for (prep, i), estimate in zip(jobs, estimates):
        plan = Candidate(prep.setting, prep.variants[i]).plan(space)
        assert estimate.memory_bytes == pytest.approx(max(m.total for m in memory(plan)), rel=1e-12)


def test_the_bound_never_exceeds_the_estimate(small):
    _, _, jobs, estimates = small
    assert all(prep.bound[i] <= e.step_s * (1 + 1e-12) for (prep, i), e in zip(jobs, estimates))


def test_the_bound_of_a_zero_bubble_pipeline_counts_its_drain(small):
    """Zero-bubble schedules end on deferred W passes: the bound takes the last microbatch's input gradient back
    through the stages, then the first rank's W passes after it. With one microbatch a step is that path exactly
    (forwards down, I passes back up, then the first rank's W and optimizer; the other ranks' W run beside it)."""
    _, _, jobs, estimates = small
    lone = [(prep.bound[i], e.step_s) for (prep, i), e in zip(jobs, estimates) if prep.setting.num_microbatches == 1
            and prep.setting.pp == 4 and prep.setting.schedule in ("zero-bubble", "zb-h2")]
    assert len(lone) >= 2
    assert all(bound == pytest.approx(step, rel=1e-9) for bound, step in lone)


def test_the_bound_of_one_microbatch_through_a_pipeline_is_its_whole_path(small):
    """With one microbatch and nothing to sync, a step is the microbatch's forward down the stages, its backward
    back up and the first rank's optimizer: the bound counts the gradient's way back from the last rank's last
    pass (the drain) and so meets the estimate."""
    _, _, jobs, estimates = small
    lone = [(prep.bound[i], e.step_s) for (prep, i), e in zip(jobs, estimates) if prep.setting.num_microbatches == 1
            and prep.setting.pp == 4 and prep.setting.schedule in ("1f1b", "gpipe")]
    assert len(lone) == 4
    assert all(bound == pytest.approx(step, rel=1e-9) for bound, step in lone)


def test_step_times_agree_with_the_event_simulation_over_the_whole_space(small):
    """Exhaustive: every plan simulated. Plans without FSDP agree to rounding; FSDP on this latency-bound toy
    model is off where gathers, exchanges and reductions contend (the fast tier prices them alone)."""
    space, cluster, jobs, estimates = small
    errors, fsdp = [], []
    plans = [Candidate(prep.setting, prep.variants[i]).plan(space) for prep, i in jobs]
    for (prep, i), estimate, (simulated, _) in zip(jobs, estimates, steps_and_memory(plans, cluster)):
        (fsdp if prep.variants[i].fsdp else errors).append(estimate.step_s / simulated - 1)
    assert len(errors) + len(fsdp) == len(jobs) > 300
    assert np.abs(errors).max() < 1e-3  # contention between overlapping collectives, which the simulator shares
    assert np.abs(fsdp).max() < 0.25  # docs/search.md: FSDP gathers on a latency-bound model


def test_fsdp_of_a_mixture_of_experts_costs_about_the_same_in_both_tiers():
    """Every FSDP plan of a small mixture of experts on 4 H100s: memory exactly the simulator's, step times
    close (434 plans, HSDP with cp 4 among them: median 0.53%, at worst 7.1%, with cp 4, where the fast tier
    prices K/V exchanges beside the dense weights' gathers only). Layers are gathered over the data-parallel
    ranks and experts over the ranks holding them (none where ep spans them all), in both tiers; under a
    pipeline once a step."""
    model = load_model({"kind": "transformer", "name": "moe", "num_layers": 4, "hidden": 512, "num_heads": 8,
                        "num_kv_heads": 4, "ffn_hidden": 2048, "seq_len": 1024, "vocab_size": 1000,
                        "num_experts": 8, "experts_per_token": 2, "expert_ffn_hidden": 1024, "dense_layers": 1})
    space = SearchSpace(model, 4, 4, dtype="bf16")
    cluster = load_cluster("dgx-h100")
    fast = FastModel(space, cluster)
    prepared = [fast.prepare(s, variants) for s, variants in enumerate_settings(space)]
    jobs = [(p, i) for p in prepared for i in range(len(p.variants)) if p.variants[i].fsdp]
    errors, sharded_experts, pipelined = [], 0, 0
    plans = [Candidate(prep.setting, prep.variants[i]).plan(space) for prep, i in jobs]
    for plan, estimate, (step_s, peak) in zip(plans, fast.estimate(jobs), steps_and_memory(plans, cluster)):
        sharded_experts += plan.expert_shard_size > 1
        pipelined += plan.pp > 1
        assert estimate.memory_bytes == pytest.approx(peak, rel=1e-12)
        errors.append(estimate.step_s / step_s - 1)
    assert len(errors) > 300 and sharded_experts > 100 and pipelined > 100
    assert np.median(np.abs(errors)) < 0.01 and np.abs(errors).max() < 0.1


def test_hsdp_of_a_mixture_of_experts_costs_about_the_same_in_both_tiers():
    """Every HSDP plan of a small mixture of experts on 32 H100s (tp 1, cp 1): shard groups of a node's 8
    ranks, experts sharded over those holding them (8 / ep; whole where ep is 8, all-reduced only), every
    shard all-reduced across the nodes. Memory exactly the simulator's; step times as close as dense HSDP's
    on this latency-bound size (2026-11-28: 200 plans, median 1.63%, at worst 7.86%)."""
    model = load_model({"kind": "transformer", "name": "moe", "num_layers": 4, "hidden": 512, "num_heads": 8,
                        "num_kv_heads": 4, "ffn_hidden": 2048, "seq_len": 1024, "vocab_size": 1000,
                        "num_experts": 8, "experts_per_token": 2, "expert_ffn_hidden": 1024, "dense_layers": 1})
    space = SearchSpace(model, 32, 32, dtype="bf16", degrees=(("tp", (1,)), ("cp", (1,))))
    cluster = load_cluster("dgx-h100")
    fast = FastModel(space, cluster)
    prepared = [fast.prepare(s, variants) for s, variants in enumerate_settings(space)]
    jobs = [(p, i) for p in prepared for i in range(len(p.variants)) if p.variants[i].shard_group]
    errors, whole = [], 0
    plans = [Candidate(prep.setting, prep.variants[i]).plan(space) for prep, i in jobs]
    for plan, estimate, (step_s, peak) in zip(plans, fast.estimate(jobs), steps_and_memory(plans, cluster)):
        whole += plan.expert_shard_size == 1
        assert estimate.memory_bytes == pytest.approx(peak, rel=1e-12)
        errors.append(estimate.step_s / step_s - 1)
    assert len(errors) > 150 and whole > 10
    assert np.median(np.abs(errors)) < 0.03 and np.abs(errors).max() < 0.12


def test_a_tied_table_split_across_pipeline_ranks_costs_the_same_in_both_tiers():
    """tiny-gpt with tied embeddings, every pipelined plan on 4 H100s without FSDP: the head's copy of the table
    (memory, its data-parallel sync) and the two copies' gradient sum after it, as the simulator has them.
    Step times agree to 1.5%, not to rounding: each pipeline rank's sum runs when that rank is ready, and in
    the simulation its flows can meet the other rank's last data-parallel all-reduce or transfer on NVLink
    (1.0% at most on this microsecond-scale model), which the fast tier prices alone."""
    model = load_model(dict(load_model("tiny-gpt").to_dict(), tied_embeddings=True))
    space = SearchSpace(model, 4, 2, dtype="bf16", degrees=(("pp", (2, 4)),))
    cluster = load_cluster("dgx-h100")
    fast = FastModel(space, cluster)
    prepared = [fast.prepare(s, variants) for s, variants in enumerate_settings(space)]
    jobs = [(p, i) for p in prepared for i in range(len(p.variants)) if not p.variants[i].fsdp]
    tied = 0
    plans = [Candidate(prep.setting, prep.variants[i]).plan(space) for prep, i in jobs]
    for plan, estimate, (step_s, peak) in zip(plans, fast.estimate(jobs), steps_and_memory(plans, cluster)):
        tied += plan.copies_embedding_table
        assert estimate.step_s == pytest.approx(step_s, rel=0.015)
        assert estimate.memory_bytes == pytest.approx(peak, rel=1e-12)
    assert tied > 20


@pytest.mark.parametrize("adamw", ["foreach", "fused"])
def test_llama_plans_agree_within_a_few_percent(adamw):
    space = SearchSpace(load_model("llama3-8b"), 8, 32, model_spec="llama3-8b", adamw=adamw)
    cluster = load_cluster("dgx-h100")
    fast = FastModel(space, cluster)
    prepared = [fast.prepare(s, variants) for s, variants in enumerate_settings(space)]
    fits = [(p, int(i)) for p in prepared for i in np.flatnonzero(np.isfinite(p.bound))]
    picks = [fits[k] for k in np.random.default_rng(1).choice(len(fits), 12, replace=False)]
    plans = [Candidate(prep.setting, prep.variants[i]).plan(space) for prep, i in picks]
    assert all(plan.adamw == adamw for plan in plans)
    for estimate, (step_s, peak) in zip(fast.estimate(picks), steps_and_memory(plans, cluster)):
        assert estimate.step_s == pytest.approx(step_s, rel=0.05)
        assert estimate.memory_bytes == pytest.approx(peak, rel=1e-12)


def test_fsdp_on_one_node_pays_for_the_sms_its_collectives_hold_in_both_tiers():
    """Llama 3 8B, FSDP over one node of H100s: each gather's and reduce-scatter's NCCL kernel holds 24 of the
    132 SMs beside most of the passes (parsim.sim.held_sms), which the fast tier times entry by entry as the
    simulation does: FSDP over all 8 GPUs within 0.1% (3.9% optimistic leaving them out). (With tp > 1 the
    tensor-parallel collectives share NVLink with FSDP's in the simulation, which the fast tier leaves out.)"""
    space = SearchSpace(load_model("llama3-8b"), 8, 32, model_spec="llama3-8b")
    cluster = load_cluster("dgx-h100")
    fast = FastModel(space, cluster)
    prepared = [fast.prepare(s, variants) for s, variants in enumerate_settings(space)
                if s.pp == 1 and s.tp == 1 and s.cp == 1 and s.microbatch_size == 1]
    fits = [(p, int(i)) for p in prepared for i in np.flatnonzero(np.isfinite(p.bound))
            if p.variants[i].fsdp and p.variants[i].recompute == "none" and not p.variants[i].shard_group]
    assert fits
    (prep, i), estimate = fits[0], fast.estimate(fits[:1])[0]
    simulated = predict_step(Candidate(prep.setting, prep.variants[i]).plan(space), cluster)
    assert estimate.step_s == pytest.approx(simulated.step_s, rel=0.005)
    held = fast._held_tables(prep.setting, prep.variants[i])
    assert held and (held[3] >= held[1]).all() and (held[3] > held[1]).any()
    assert sum(estimate.phases.values()) == pytest.approx(estimate.step_s, rel=1e-9)


@pytest.mark.parametrize("pp", [1, 2])
def test_zero_buckets_slow_the_final_backward_beside_them_in_both_tiers(pp):
    """Llama 3 8B, ZeRO-2 over 64 H100s: each gradient bucket's reduce-scatter kernel holds SMs while it runs
    beside the rest of the final backward (parsim.sim.held_sms). The fast tier slows each stage's final
    backward by what its buckets hold, and the pipeline carries the delay on: within 0.7% of the simulation
    (1.5% optimistic leaving the SMs out, at pp 1)."""
    space = SearchSpace(load_model("llama3-8b"), 64, 128, model_spec="llama3-8b")
    cluster = load_cluster("dgx-h100")
    fast = FastModel(space, cluster)
    prepared = [fast.prepare(s, variants) for s, variants in enumerate_settings(space)
                if s.pp == pp and s.tp == 1 and s.cp == 1 and s.microbatch_size == 1 and s.schedule == "1f1b"]
    fits = [(p, int(i)) for p in prepared for i in np.flatnonzero(np.isfinite(p.bound))
            if p.variants[i].zero == 2]  # (two microbatches or more: the gradients accumulate whole, as ZeRO-1's)
    (prep, i), estimate = fits[0], fast.estimate(fits[:1])[0]
    simulated = predict_step(Candidate(prep.setting, prep.variants[i]).plan(space), cluster)
    assert estimate.step_s == pytest.approx(simulated.step_s, rel=0.007)
    extra = prep.inputs[i].final_extra
    assert extra.shape == (pp,) and (extra > 0).all()
    assert sum(estimate.phases.values()) == pytest.approx(estimate.step_s, rel=1e-9)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_clipping_and_loss_scaling_cost_the_same_in_both_tiers(dtype):
    """Llama 3 8B on 16 H100s, plans with pipeline, tensor and sharded data parallelism, each clipping its
    gradients (and in fp16 unscaling them first): each check's pass, its all-reduces (the pipeline ranks'
    waiting for the last of them), and the scaling in the step agree with the event simulation as other plans
    do, and the clip costs time."""
    cluster = load_cluster("dgx-h100")
    spaces = {clip: SearchSpace(load_model("llama3-8b"), 16, 64, dtype=dtype, model_spec="llama3-8b",
                                grad_clip=clip, degrees=(("pp", (2, 4)),)) for clip in (None, 1.0)}
    fast = {clip: FastModel(space, cluster) for clip, space in spaces.items()}
    prepared = [fast[1.0].prepare(s, variants) for s, variants in enumerate_settings(spaces[1.0])]
    fits = [(p, int(i)) for p in prepared for i in np.flatnonzero(np.isfinite(p.bound))]
    picks = [fits[k] for k in np.random.default_rng(2).choice(len(fits), 8, replace=False)]
    unclipped = fast[None].estimate([(fast[None].prepare(p.setting, p.variants), i) for p, i in picks])
    for (prep, i), estimate, plain in zip(picks, fast[1.0].estimate(picks), unclipped):
        plan = Candidate(prep.setting, prep.variants[i]).plan(spaces[1.0])
        assert plan.grad_clip == 1.0 and plan.scales_loss == (dtype == "fp16") and estimate.step_s > plain.step_s
        simulated = predict_step(plan, cluster)
        assert estimate.step_s == pytest.approx(simulated.step_s, rel=0.05)
        ranks = {b.rank: b for b in simulated.ranks}
        # The phase holds a pipeline rank's wait for the others in the check's all-reduce: a difference of two
        # ranks' finishing times, each as close as the step (FSDP's gathers beside its reduce-scatters, which the
        # fast tier prices alone, docs/search.md), so it is held to 5% of itself or 1% of the step.
        assert estimate.phases["optimizer"] == pytest.approx(
            ranks[plan.rank_of(pp=estimate.rank)].seconds["optimizer"], rel=0.05, abs=0.01 * simulated.step_s)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_long_schedules_are_read_off_three_rounds(name):
    pp = 4
    v = {"interleaved-1f1b": 2, "zbv": 2, "dualpipe-v": 2}.get(name, 1)
    for m in range(3 * pp + 1, 6 * pp + 1):
        try:
            schedule = make_schedule(name, pp, m, v)
        except Exception:
            continue
        in_flight, counts, final = schedule_facts(name, pp, m, v)
        moments = [[tuple(row) for row in rows.astype(int).tolist() if any(row)] for rows in in_flight]
        assert moments == in_flight_by_stage(schedule)
        last = {a.stage: KINDS.index(a.kind) for acts in schedule.actions for a in acts
                if a.microbatch == m - 1 and a.kind in "BW"}
        assert list(final) == [last[s] for s in range(schedule.num_stages)]
        full = np.zeros_like(counts)
        for r, actions in enumerate(schedule.actions):
            for a in actions:
                full[r, a.stage * 4 + KINDS.index(a.kind)] += 1
        assert (full == counts).all()
        # each rank's last backward of the last microbatch, and the passes it runs after it: the bound's drain
        drained, trailing = _drained_stages(name, pp, m, v)
        for r, actions in enumerate(schedule.actions):
            last = max(i for i, a in enumerate(actions) if a.kind in "BI" and a.microbatch == m - 1)
            after = np.zeros(schedule.num_stages * 4)
            for a in actions[last + 1:]:
                after[a.stage * 4 + KINDS.index(a.kind)] += 1
            assert drained[r] == actions[last].stage and (trailing[r] == after).all()


def test_an_exchange_beside_a_gather_on_the_same_nics_moves_at_half_speed():
    from ideal_cluster import ideal_spec

    from parsim.search.costs import CommCosts
    from parsim.sim.compute import ComputeModel

    spec = ideal_spec()
    comm = CommCosts(spec, 32, ComputeModel.for_cluster(spec, "bf16", 2, 8))
    pair, inside = (0, 8), (0, 1)  # one GPU on each of two nodes: each ring crosses the same two NICs
    alone = comm.time("collective", "all_gather", pair, 64e6)
    latency = sum(p.latency_s for p in comm.sim.comm_phases("collective", "all_gather", pair, (), 64e6))
    beside = comm.beside("all_gather", pair, 64e6, "all_gather", pair, 64e6)
    assert beside - latency == pytest.approx(2 * (alone - latency), rel=1e-6)
    # A ring inside node 1 shares no link with one inside node 0: no change.
    assert comm.beside("all_gather", (8, 9), 64e6, "all_gather", inside, 64e6) == pytest.approx(
        comm.time("collective", "all_gather", (8, 9), 64e6))


def test_a_send_beside_a_gather_on_the_same_nics_moves_at_half_speed():
    """A pipeline send under FSDP shares the sender's NIC with the next pass's gather (``FastModel._hops``)."""
    from ideal_cluster import ideal_spec

    from parsim.search.costs import CommCosts
    from parsim.sim.compute import ComputeModel

    spec = ideal_spec()
    comm = CommCosts(spec, 32, ComputeModel.for_cluster(spec, "bf16", 2, 8))
    pair = (0, 8)  # a pipeline boundary between nodes 0 and 1
    alone = comm.time("send", "send_recv", pair, 64e6)
    latency = sum(p.latency_s for p in comm.sim.comm_phases("send", "send_recv", pair, (), 64e6))
    beside = comm.beside("send_recv", pair, 64e6, "all_gather", pair, 64e6, kind="send")
    assert beside - latency == pytest.approx(2 * (alone - latency), rel=1e-6)
    assert comm.beside("send_recv", (8, 9), 64e6, "all_gather", (0, 1), 64e6, kind="send") == pytest.approx(
        comm.time("send", "send_recv", (8, 9), 64e6))


def test_a_pipeline_send_carries_the_whole_microbatch():
    """Every pipelined plan of a small GPT on two 8-GPU nodes with microbatches of 2 and 4 sequences, where
    each pipeline send crosses the nodes' NICs: the fast tier's sends carry what the simulator's do (they once
    carried one sequence however large the microbatch, and plans of many virtual stages came out 5% fast)."""
    model = load_model({"kind": "transformer", "name": "gpt", "num_layers": 8, "hidden": 1024, "num_heads": 16,
                        "ffn_hidden": 4096, "seq_len": 2048, "vocab_size": 32000})
    space = SearchSpace(model, 16, 16, dtype="bf16", degrees=(("dp", (1,)), ("tp", (8,)), ("pp", (2,))))
    cluster = load_cluster("dgx-h100")
    fast = FastModel(space, cluster)
    prepared = [fast.prepare(s, variants) for s, variants in enumerate_settings(space) if s.microbatch_size in (2, 4)]
    jobs = [(p, i) for p in prepared for i in range(len(p.variants)) if not p.variants[i].fsdp]
    errors = []
    for (prep, i), estimate in zip(jobs, fast.estimate(jobs)):
        simulated = predict_step(Candidate(prep.setting, prep.variants[i]).plan(space), cluster)
        assert max(r.fraction("pp") for r in simulated.ranks) > 0.02  # the sends weigh in the step
        errors.append(estimate.step_s / simulated.step_s - 1)
    assert len(errors) > 10
    assert np.abs(errors).max() < 1e-3


def test_the_bound_never_exceeds_the_estimate_of_a_mixture_of_experts_under_a_pipeline():
    """The expert all-to-alls' groups follow the placement order: each order's passes bound its own plans
    (2026-12-02: one pass table for both orders put the bound above the estimate in 210 of these 880 plans, by
    up to 72%, and by up to 129% with tp 2 and pp 4 as well: plans the search would have pruned wrongly)."""
    moe = {"kind": "transformer", "name": "moe", "num_layers": 8, "hidden": 2048, "num_heads": 16,
           "num_kv_heads": 8, "ffn_hidden": 8192, "seq_len": 4096, "vocab_size": 32000, "num_experts": 64,
           "experts_per_token": 8, "expert_ffn_hidden": 1024}
    space = SearchSpace(load_model(moe), 32, 64, dtype="bf16", degrees=(("tp", (1,)), ("cp", (1,)), ("pp", (2,)),
                                                                        ("ep", (4, 8))))
    fast = FastModel(space, load_cluster("dgx-h100"))
    prepared = [fast.prepare(s, variants) for s, variants in enumerate_settings(space)]
    jobs = [(p, i) for p in prepared for i in range(len(p.variants)) if p.bound[i] < float("inf")]
    assert len({p.variants[i].order for p, i in jobs}) == 2
    assert all(prep.bound[i] <= e.step_s * (1 + 1e-12) for (prep, i), e in zip(jobs, fast.estimate(jobs)))
