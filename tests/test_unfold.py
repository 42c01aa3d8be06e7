"""Every rank its own program (parsim.lowering.unfold): the same step as the representatives' where ranks run alike."""

from __future__ import annotations

import pytest
from ideal_cluster import ideal_spec

from parsim.hardware.cluster import load_cluster
from parsim.lowering.lower import lower
from parsim.lowering.unfold import unfold
from parsim.report.step_report import breakdown, merge_spans, step_time
from parsim.sim.compute import ComputeModel
from parsim.sim.stepsim import StepSimulator
from parsim.workload.plan import resolve_plan


def _simulate(plan, cluster, program):
    topo = cluster.build(max(1, plan.world // cluster.gpus_per_node))
    compute = ComputeModel.for_cluster(cluster, plan.dtype, plan.dtype_bytes,
                                       min(plan.world, cluster.gpus_per_node), plan.attention_seq)
    return merge_spans(StepSimulator(topo, compute).run(program))


@pytest.mark.parametrize("name, overrides, cluster", [
    ("tiny-pp2", {"parallel": {"dp": 2}}, "dgx-a100"),
    ("course-tp", None, "dgx-a100"),
    ("tiny-pp2", {"parallel": {"dp": 2, "tp": 2}, "data_parallel": {"grad_sync": "bucketed"}}, "dgx-h100"),
    ("tiny-pp2", {"parallel": {"dp": 4}, "data_parallel": {"grad_sync": "fsdp"}}, "dgx-h100"),
    ("tiny-pp2", {"parallel": {"dp": 2, "cp": 2}}, "dgx-h100"),
    ("tiny-pp2", {"parallel": {"dp": 2}}, "ideal"),
    ("tiny-pp2", {"parallel": {"dp": 2}, "grad_clip": 1.0}, "dgx-h100"),
    ("tiny-tp2", {"parallel": {"dp": 2, "tp": 2}, "grad_clip": 1.0}, "dgx-h100"),
    ("tiny-pp2", {"parallel": {"dp": 4}, "data_parallel": {"grad_sync": "fsdp"}, "grad_clip": 1.0}, "dgx-h100"),
    ("tiny-pp2", {"parallel": {"dp": 2}, "schedule": "interleaved-1f1b", "virtual_stages": 2}, "dgx-h100"),
    ("tiny-pp2", {"parallel": {"dp": 2}, "schedule": "dualpipe-v"}, "dgx-h100"),
    ("tiny-tp2", {"parallel": {"dp": 2, "tp": 2}, "sequence_parallel": True, "activation_recompute": "full"},
     "dgx-a100"),
    ("mixtral-8x22b", {"parallel": {"dp": 2, "tp": 1, "pp": 2, "ep": 2}}, "dgx-h100"),
])
def test_an_unfolded_program_times_as_its_representatives(name, overrides, cluster):
    """Data-, tensor- and context-parallel replicas, FSDP's shards, experts, clipping's checks, interleaved and
    V schedules: each rank's phases are its representative's, to the last bit, and so is the step."""
    plan = resolve_plan(name, overrides=overrides)
    spec = ideal_spec() if cluster == "ideal" else load_cluster(cluster)
    program = lower(plan)
    unfolded = unfold(program)
    assert unfolded.ranks == list(range(plan.world))
    rep, every = _simulate(plan, spec, program), _simulate(plan, spec, unfolded)
    assert step_time(every) == step_time(rep)
    by_rank = {b.rank: b.seconds for b in breakdown(rep)}
    for b in breakdown(every):
        representative = next(r for r, replicas in program.replicas.items() if b.rank in replicas)
        assert b.seconds == by_rank[representative]


def test_each_replica_sends_to_its_own_peer_and_joins_its_group_s_collective():
    plan = resolve_plan("tiny-pp2", overrides={"parallel": {"dp": 2}})  # rank (dp, pp): 0 (0,0) 1 (0,1) 2 (1,0) 3 (1,1)
    program = unfold(lower(plan))
    ops = program.ops
    sends = [op for op in program.rank_ops(2) if op.kind == "send"]
    assert sends and all(op.ranks == (2, 3) and op.peer == 3 and op.name.endswith("peer=3") for op in sends)
    receives = [op for op in program.rank_ops(3) if op.kind == "recv"]
    assert receives and all(op.peer == 2 and ops[op.match].rank == 2 for op in receives)
    assert not any(op.mirrors for op in ops)
    reduces = [op for op in program.rank_ops(2) if op.kind == "collective" and op.group == "dp"]
    assert reduces and all(sorted(op.ranks) == [0, 2] for op in reduces)
    assert all(len(op.joins) == 1 and ops[op.joins[0]].rank == 0 and ops[op.joins[0]].name == op.name
               for op in reduces)
    assert program.replicas == {rank: (rank,) for rank in range(4)}
