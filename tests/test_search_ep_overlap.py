"""The search tries a mixture of experts' all-to-alls beside a paired pass's compute (``ep_comm_overlap``:
Megatron-LM's combined 1F1B without a pipeline or interleaved, DualPipe-V), timed by the fast tier as the
simulator times the pairs (:func:`parsim.search.fast.pair_seconds`; each pair one pass of the pipeline's
sweep, :func:`parsim.search.pipeline.compile_schedule`)."""

from __future__ import annotations

import json
import statistics

import pytest
from simulated import steps_and_memory

from parsim.cli.main import main
from parsim.hardware.cluster import load_cluster
from parsim.search.fast import FastModel
from parsim.search.space import Candidate, SearchSpace, enumerate_settings
from parsim.workload.model import load_model

# tests/test_ep_overlap.py's MoE: all-to-alls on two nodes weigh as much as the GEMMs
MOE_SPEC = {"kind": "transformer", "name": "moe", "num_layers": 4, "hidden": 2048, "num_heads": 16,
            "num_kv_heads": 8, "ffn_hidden": 8192, "seq_len": 4096, "vocab_size": 32000, "num_experts": 64,
            "experts_per_token": 8, "expert_ffn_hidden": 1024}
DEGREES = (("tp", (1,)), ("cp", (1,)), ("pp", (1, 2)), ("ep", (8, 16)))


@pytest.mark.parametrize("dispatcher", ["alltoall", "deepep"])
def test_the_fast_tier_times_paired_passes_as_the_simulator_does(dispatcher):
    """2026-12-02, 16 H100s: 42 paired plans each, combined 1F1B without a pipeline and interleaved, and
    DualPipe-V (one microbatch has nothing to pair); the fast tier within 0.35% (plain all-to-all) and 0.76%
    (DeepEP) of the simulation at the median, 1.24% and 2.01% at worst (that DeepEP plan's unpaired twin is
    off by 1.96% itself); the pairs add at most 1.16 and 0.33 points to the error of the plan unpaired.
    Memory to the byte; the bound below. The pairs save 2.2-25% (plain) and 1.2-14% (DeepEP) of the step."""
    space = SearchSpace(load_model(MOE_SPEC), 16, 64, dtype="bf16", dispatcher=dispatcher, degrees=DEGREES)
    cluster = load_cluster("dgx-h100")
    fast = FastModel(space, cluster)
    prepared = [fast.prepare(s, variants) for s, variants in enumerate_settings(space)]
    paired = [(p, i) for p in prepared for i, v in enumerate(p.variants) if v.ep_overlap and p.bound[i] < float("inf")]
    assert {p.setting.schedule for p, _ in paired} == {"1f1b", "dualpipe-v", "interleaved-1f1b"}
    assert {p.setting.schedule for p, _ in paired if p.setting.pp > 1} == {"dualpipe-v", "interleaved-1f1b"}
    apart_jobs = [(p, p.variants.index(p.variants[i]._replace(ep_overlap=False))) for p, i in paired]
    assert {Candidate(p.setting, p.variants[i]).schedule_text() for p, i in paired} == {
        "combined 1f1b", "combined interleaved-1f1b v2", "dualpipe-v + ep overlap"}  # the table's schedule column
    errors, added, savings = [], [], []
    candidates = [Candidate(prep.setting, prep.variants[i]) for prep, i in paired]
    plans = [c.plan(space) for c in candidates] + [c._replace(variant=c.variant._replace(ep_overlap=False)).plan(space)
                                                   for c in candidates]
    simulated = steps_and_memory(plans, cluster)
    for (prep, i), candidate, plan, estimate, apart_estimate, (step_s, peak), (apart_s, _) in zip(
            paired, candidates, plans, fast.estimate(paired), fast.estimate(apart_jobs), simulated[:len(paired)],
            simulated[len(paired):]):
        assert plan.ep_comm_overlap and candidate.mapping(space)["moe"]["ep_comm_overlap"] is True
        assert estimate.memory_bytes == pytest.approx(peak, rel=1e-12)
        assert prep.bound[i] <= estimate.step_s
        errors.append(estimate.step_s / step_s - 1)
        savings.append(1 - step_s / apart_s)
        added.append(errors[-1] - (apart_estimate.step_s / apart_s - 1))  # the pairs' part of the error
    assert len(errors) >= 40
    assert statistics.median(map(abs, errors)) < 0.01 and max(map(abs, errors)) < 0.025
    assert max(map(abs, added)) < 0.015
    assert min(savings) > 0  # hiding the all-to-alls pays on two nodes


def test_the_search_prints_a_paired_plan_as_combined_1f1b_and_its_command(tmp_path, capsys):
    path = tmp_path / "moe.yaml"
    path.write_text(json.dumps(MOE_SPEC))
    args = ["search", "--model", str(path), "--gpus", "16", "--global-batch", "64", "--ep", "16", "--pp", "1",
            "--tp", "1", "--cp", "1", "--top", "3", "--simulate", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "combined 1f1b" in out and " --ep-comm-overlap" in out


def test_at_deepseek_v3s_degrees_the_search_picks_the_rest_of_its_plan():
    """DeepSeek-V3's degrees given (dp 128, pp 16, ep 64 on 2,048 H800s; fp8 with DeepEP's fp8 dispatch), the
    fast tier ranks first what DeepSeek-AI ran (report section 3.2; the ``deepseek-v3-2048`` plan, which the
    simulation gives 17.7 s, 2026-12-02): DualPipe-V with each pair's all-to-alls beside the other pass's compute,
    ZeRO-1 (ZeRO-2 ties it: over 120 microbatches its gradients add up whole as ZeRO-1's, so it holds no
    less), the norms, MLA's up-projections and the SwiGLU recomputed, pp outermost, 120 microbatches of one sequence."""
    from parsim.files import read_yaml
    from parsim.search.search import SearchRequest, run_search
    from parsim.workload.plan import builtin_plans

    degrees = (("dp", (128,)), ("tp", (1,)), ("pp", (16,)), ("cp", (1,)), ("ep", (64,)))
    request = SearchRequest(load_model("deepseek-v3"), "deepseek-v3", load_cluster("hgx-h800"), (2048,), 15360,
                            "fp8", simulate=0, degrees=degrees, dispatcher="deepep", dispatch_fp8=True)
    best = run_search(request).ranked[0]
    found = best.candidate.mapping(best.space)
    published = read_yaml(builtin_plans()["deepseek-v3-2048"])
    for key in ("batch", "schedule", "moe", "activation_recompute"):
        assert found[key] == published[key], key
    assert {k: found["parallel"][k] for k in published["parallel"]} == published["parallel"]
    assert found["data_parallel"]["zero"] == published["data_parallel"]["zero"] == 1
    assert 17.0 < best.estimate.step_s < 18.5
