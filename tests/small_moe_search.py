"""A small MoE's search space on 16 H100s, and every plan of it priced by both tiers: what the search's MoE
options (``--dispatch-fp8``, ``--expert-load``) are checked on."""

from __future__ import annotations

from parsim.hardware.cluster import load_cluster
from parsim.search.fast import Estimate, FastModel
from parsim.search.space import Candidate, SearchSpace, enumerate_settings
from parsim.sim.step import predict_step
from parsim.workload.model import load_model
from parsim.workload.plan import Plan

MOE_SPEC = {"kind": "transformer", "name": "moe", "num_layers": 4, "hidden": 1024, "num_heads": 8,
            "num_kv_heads": 4, "ffn_hidden": 2048, "seq_len": 2048, "vocab_size": 1000, "num_experts": 16,
            "experts_per_token": 4, "expert_ffn_hidden": 1024}
DEGREES = (("tp", (1,)), ("cp", (1,)), ("pp", (1, 2)), ("ep", (8, 16)))


def both_tiers(**space_options) -> tuple[SearchSpace, dict[Candidate, tuple[Estimate, Plan, float]]]:
    """Every non-FSDP plan without recomputation of the small MoE (``space_options`` for its SearchSpace, over
    16 GPUs and 32 sequences), by candidate: the fast tier's estimate, the plan and its simulated step."""
    space = SearchSpace(load_model(MOE_SPEC), 16, 32, degrees=DEGREES, **space_options)
    cluster = load_cluster("dgx-h100")
    fast = FastModel(space, cluster)
    prepared = [fast.prepare(s, variants) for s, variants in enumerate_settings(space)]
    jobs = [(p, i) for p in prepared for i in range(len(p.variants))
            if not p.variants[i].fsdp and p.variants[i].recompute == "none"]
    out = {}
    for (prep, i), estimate in zip(jobs, fast.estimate(jobs)):
        candidate = Candidate(prep.setting, prep.variants[i])
        plan = candidate.plan(space)
        out[candidate] = (estimate, plan, predict_step(plan, cluster).step_s)
    return space, out
