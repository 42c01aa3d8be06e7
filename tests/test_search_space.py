"""The search space: every enumerated plan is one the parser accepts, every rejected one is refused."""

from __future__ import annotations

import itertools

import pytest

from parsim.errors import ParsimError
from parsim.search.space import (Candidate, Rejections, SearchSpace, divisors, enumerate_settings, enumerate_space,
                                 schedule_options, sync_options)
from parsim.workload.model import load_model
from parsim.workload.plan import parse_plan


def accepted(mapping: dict) -> bool:
    try:
        parse_plan(mapping).pipeline  # noqa: B018 (the schedule must build too)
    except ParsimError:
        return False
    return True


@pytest.mark.parametrize("model, gpus, batch", [("tiny-gpt", 8, 8), ("tiny-gpt", 16, 4), ("course-mlp", 8, 128)])
def test_every_enumerated_plan_parses_and_every_rejected_layout_or_pipeline_is_refused(model, gpus, batch):
    space = SearchSpace(load_model(model), gpus, batch, dtype="fp32")  # the model inline: no file read per plan
    rejections = Rejections()
    settings = {s: variants for s, variants in enumerate_settings(space, rejections)}
    assert settings
    for setting, variants in settings.items():
        for variant in variants[:: max(1, len(variants) // 7)] + variants[-1:]:
            assert accepted(Candidate(setting, variant).mapping(space))
    # The raw grid: every factorization, every microbatch split and every schedule option.
    keys = {(s.dp, s.tp, s.pp, s.cp, s.microbatch_size, s.schedule, s.virtual_stages) for s in settings}
    refused = 0
    for tp, cp, pp in itertools.product(divisors(gpus), repeat=3):
        if gpus % (tp * cp * pp):
            continue
        dp = gpus // (tp * cp * pp)
        for mbs in divisors(batch):
            if batch % (dp * mbs):
                continue
            nmb = batch // (dp * mbs)
            for schedule, v in schedule_options(pp, 10**6):
                found = (dp, tp, pp, cp, mbs, schedule, v) in keys
                data = {"model": space.model_spec, "parallel": {"dp": dp, "tp": tp, "pp": pp, "cp": cp},
                        "batch": {"microbatch_size": mbs, "num_microbatches": nmb},
                        "schedule": schedule, "virtual_stages": v, "dtype": "fp32"}
                if found:
                    assert accepted(data)
                elif pp * v <= space.model.num_layers and (v == 1 or space.model.num_layers % (pp * v) == 0):
                    assert not accepted(data), data  # not an interleaving the space leaves out on purpose
                    refused += 1
    assert refused > 0
    assert sum(rejections.layouts.values()) + sum(rejections.pipelines.values()) > 0


def test_equivalent_plans_are_generated_once():
    space = SearchSpace(load_model("tiny-gpt"), 8, 8, model_spec="tiny-gpt")
    plans = list(enumerate_space(space))
    assert len(plans) == len(set(plans))
    for c in plans:
        s, v = c
        if s.pp == 1:
            assert s.schedule == "1f1b"
        if s.tp == 1:
            assert not v.sequence_parallel
        if s.dp * s.cp == 1:
            assert (v.grad_sync, v.zero) == ("bucketed", 0)
        assert v.recompute != "selective"  # a flash-attention core saves and costs nothing by it


def test_hsdp_shards_inside_a_node_holding_whole_expert_parallel_groups():
    dense = SearchSpace(load_model("tiny-gpt"), 16, 16)
    assert ("fsdp", 3, 4) in sync_options(dense, dp=8, tp=2, cp=1)  # 4 data-parallel ranks per 8-GPU node
    moe = SearchSpace(load_model("mixtral-8x22b"), 64, 64)
    assert ("fsdp", 3, 8) in sync_options(moe, dp=64, tp=1, cp=1, ep=8)  # experts: HSDP over 1 rank each
    assert ("fsdp", 3, 8) in sync_options(moe, dp=64, tp=1, cp=1, ep=4)  # experts sharded over 2 ranks
    # a node's 8 ranks cannot hold whole expert-parallel groups of 16 (torchtitan borrows ep from dp_shard)
    assert [o for o in sync_options(moe, dp=64, tp=1, cp=1, ep=16) if o[0] == "fsdp"] == [("fsdp", 3, None)]
