"""Tensor-parallel communication overlap (Megatron-LM's --tp-comm-overlap, and its asynchronous backward
without it): the pieces a block lowers to, their exposed time in the simulator against closed forms, the SM
margin, and the plan rules."""

from __future__ import annotations

import dataclasses

import pytest
from ideal_cluster import ideal_spec

from parsim.errors import ParsimError
from parsim.hardware.cluster import load_cluster
from parsim.lowering.lower import Lowering, fold_joins, lower
from parsim.lowering.pieces import CommPiece, ComputePiece
from parsim.lowering.tp_overlap import BULK_SMS, DGRAD_BULK_SMS, PIPELINE_SMS, PIPELINE_SPLITS
from parsim.search.costs import CommCosts
from parsim.sim.program import NCCL_CHANNELS
from parsim.sim.compute import ComputeModel
from parsim.sim.step import predict_step
from parsim.workload.model import load_model
from parsim.workload.plan import Plan, load_plan

H, T, SEQ = 1024, 4, 512
GPT = load_model({"kind": "transformer", "name": "gpt", "num_layers": 2, "hidden": H, "num_heads": 16,
                  "ffn_hidden": 4 * H, "ffn_type": "gelu", "seq_len": SEQ, "vocab_size": 1000})


def plan(overlap: bool = True, **kw) -> Plan:
    return Plan(model=GPT, tp=T, num_microbatches=2, tp_comm_overlap=overlap,
                **{"sequence_parallel": True, "dtype": "bf16"} | kw)


def layer_pieces(p: Plan, kind: str, name: str = "layer"):
    lowering = Lowering(p)
    index, cost = next((i, c) for i, c in enumerate(p.stage_costs(0)) if c.name.startswith(name))
    return lowering.layer_pass(0, index, cost, kind)


def test_forward_hides_the_gather_in_a_ring_and_the_scatter_in_four_splits():
    pieces = layer_pieces(plan(), "F")
    gather, chunks, join, last = pieces[:4]
    assert type(gather) is CommPiece and gather.collective == "all_gather" and gather.beside
    # q, k and v run as one GEMM, in T chunks of the rows: T - 1 beside the ring, the last after it
    assert chunks.matmuls == ((SEQ // T, 3 * H // T, H),) * (T - 1) and join.joins == "tp"
    assert last.matmuls == ((SEQ // T, 3 * H // T, H),)
    first, hidden, rest, join, tail = pieces[5:10]  # pieces[4]: the attention core and the memory-bound kernels
    assert first.matmuls == ((SEQ // PIPELINE_SPLITS, H, H // T),) and first.sm_reserved == PIPELINE_SMS["attention"]
    assert rest.matmuls == first.matmuls * (PIPELINE_SPLITS - 1) and join.joins == "tp"
    assert hidden.beside and not tail.beside and hidden.collective == tail.collective == "reduce_scatter"
    assert hidden.nbytes == pytest.approx(3 * tail.nbytes)
    assert hidden.nbytes + tail.nbytes == pytest.approx(SEQ * H * 2)


def test_backward_gathers_in_a_ring_and_scatters_beside_the_weight_gradients():
    pieces = layer_pieces(plan(), "B")
    mlp = pieces[:len(pieces) // 2]  # the backward runs the MLP first
    gather, scatter = mlp[0], mlp[-3]
    assert gather.beside and gather.collective == "all_gather" and mlp[1].matmuls[0] == (SEQ // T, 4 * H // T, H)
    assert scatter.beside and scatter.collective == "reduce_scatter"
    wgrad = mlp[-2]
    assert wgrad.matmuls == ((H, 4 * H // T, SEQ),) and wgrad.beside_sms == BULK_SMS["mlp"] and mlp[-1].joins == "tp"


def test_a_split_backward_scatters_in_line_without_weight_gradients_to_hide_behind():
    pieces = layer_pieces(plan(schedule="zero-bubble", pp=1), "I")
    scatters = [pc for pc in pieces if type(pc) is CommPiece and pc.collective == "reduce_scatter"]
    assert scatters and not any(pc.beside for pc in scatters)
    assert any(pc.beside for pc in pieces if type(pc) is CommPiece)  # the gathers still ride the ring


def collectives(pieces) -> list[tuple[str, bool]]:
    return [(pc.collective, pc.beside) for pc in pieces if type(pc) is CommPiece]


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_asynchronous_backward_runs_the_input_gradient_beside_the_weight_gradients(sequence_parallel):
    """Megatron-LM's column-parallel backward: (SP) the input gathered again beside the input-gradient GEMMs,
    then the input gradient's reduce-scatter (or all-reduce) beside the weight-gradient GEMMs, each NCCL
    kernel holding its channels' SMs while it runs."""
    p = plan(False, sequence_parallel=sequence_parallel)
    assert p.tp_async_backward  # tensor_parallel megatron's default
    mlp = layer_pieces(p, "B")[:len(layer_pieces(p, "B")) // 2]  # the backward runs the MLP first
    if sequence_parallel:
        assert collectives(mlp) == [("all_gather", False), ("all_gather", True), ("reduce_scatter", True)]
        regather, dgrad, join = mlp[-6:-3]
        assert regather.method == "async" and regather.nbytes == SEQ * H * 2 and join.joins == "tp"
        assert dgrad.matmuls == ((SEQ, H, 4 * H // T),) and dgrad.beside_sms == NCCL_CHANNELS
    else:
        assert collectives(mlp) == [("all_reduce", True)]
    scatter, wgrad, join = mlp[-3:]
    assert scatter.method == "async" and join.joins == "tp"
    assert wgrad.matmuls == ((H, 4 * H // T, SEQ),) and wgrad.beside_sms == NCCL_CHANNELS
    assert collectives(layer_pieces(p, "B", "head"))[-1] == ("reduce_scatter" if sequence_parallel
                                                             else "all_reduce", True)


def test_without_a_gather_beside_them_the_input_gradients_run_in_the_rest_of_the_block():
    """Nothing runs beside a non-SP block's input-gradient GEMMs: they are the last matmuls of the op before the
    all-reduce (one op fewer per block and microbatch), in the same order as Megatron-LM runs them."""
    mlp = layer_pieces(plan(False, sequence_parallel=False), "B")[:4]
    rest, reduce, wgrad, join = mlp
    assert rest.matmuls[-1] == (SEQ, H, 4 * H // T) and rest.beside_sms is None
    assert reduce.collective == "all_reduce" and reduce.beside and wgrad.beside_sms == NCCL_CHANNELS
    assert join.joins == "tp" and not join.matmuls


@pytest.mark.parametrize("sequence_parallel, overlap", [(True, True), (False, False)])
def test_a_join_folded_into_the_compute_after_it_times_the_step_alike(monkeypatch, sequence_parallel, overlap):
    """``fold_joins`` only removes ops: the step, every rank's phases and each collective's times are those of
    the lowering that keeps every join as an op of its own."""
    p = plan(overlap, sequence_parallel=sequence_parallel, pp=2)
    cluster = ideal_spec(**{"intra_node.bw_GBps_per_direction": 25})
    folded, folded_ops = predict_step(p, cluster), len(lower(p).ops)
    monkeypatch.setattr("parsim.lowering.lower.fold_joins", lambda pieces: pieces)
    kept = predict_step(p, cluster)
    assert folded_ops < len(lower(p).ops)
    assert folded.step_s == pytest.approx(kept.step_s, rel=1e-12)
    for a, b in zip(folded.ranks, kept.ranks):
        assert a.seconds == pytest.approx(b.seconds, rel=1e-9, abs=1e-15)
    times = [[(e.name, e.start_s, e.dur_s) for e in t.trace.events if e.kind == "collective"] for t in (folded, kept)]
    assert len(times[0]) == len(times[1]) > 0
    for (name, start, dur), (name_kept, start_kept, dur_kept) in zip(*times):
        assert name == name_kept and start == pytest.approx(start_kept, rel=1e-12) and dur == pytest.approx(dur_kept)


def test_fold_joins_keeps_a_join_before_a_collective_or_at_a_layer_end():
    compute = ComputePiece(((8, 8, 8),), 0.0, 1, "backward", 0)
    gather = CommPiece("all_gather tp mb=", "", "all_gather", (0, 1), (), 64.0)
    join = compute.join("tp")
    assert fold_joins([compute, join, compute]) == [compute, dataclasses.replace(compute, joins="tp")]
    assert fold_joins([compute, join, gather, compute]) == [compute, join, gather, compute]
    assert fold_joins([compute, join]) == [compute, join]


def test_the_head_split_around_its_collectives_keeps_its_bf16_gemms_in_an_fp8_plan():
    head = [pc for pc in layer_pieces(plan(False, dtype="fp8"), "B", "head") if type(pc) is ComputePiece]
    assert all(pc.high_precision for pc in head if pc.matmuls) and sum(len(pc.matmuls) for pc in head) == 2


def test_without_the_asynchronous_backward_every_collective_runs_in_line():
    """Megatron-LM before its 2021-09 release (the SC21 runs): the input gradient's all-reduce in line."""
    pieces = layer_pieces(plan(False, tp_async_backward=False), "B")
    assert collectives(pieces) == [("all_gather", False), ("all_gather", False), ("reduce_scatter", False)] * 2
    assert collectives(layer_pieces(plan(False, sequence_parallel=False, tp_async_backward=False), "B")) == \
        [("all_reduce", False)] * 2


@pytest.mark.parametrize("overlap", [True, False])
def test_a_split_backward_gathers_no_input_again(overlap):
    """The weight-gradient pass keeps the input the input-gradient pass gathered; that pass has no weight
    gradients to hide its reduce-scatter behind."""
    p = plan(overlap, schedule="zero-bubble")
    input_pass = collectives(layer_pieces(p, "I"))
    assert [c for c, _ in input_pass] == ["all_gather", "reduce_scatter"] * 2
    assert not any(beside for c, beside in input_pass if c == "reduce_scatter")
    assert collectives(layer_pieces(p, "W")) == []


def test_tensor_parallel_overlap_gathers_the_input_again_beside_the_input_gradients():
    """Transformer Engine's qkv_dgrad / fc1_dgrad bulk overlap: the all-gather on a few SMs of the GEMM's."""
    mlp = layer_pieces(plan(), "B")[:len(layer_pieces(plan(), "B")) // 2]
    regather, dgrad, join = mlp[-6:-3]
    assert regather.collective == "all_gather" and regather.beside and regather.method == "bulk"
    assert dgrad.matmuls == ((SEQ, H, 4 * H // T),) and dgrad.beside_sms == DGRAD_BULK_SMS["mlp"]
    assert join.joins == "tp"


def exposed(p: Plan, compute: ComputeModel, comm: CommCosts, kind: str, name: str = "layer") -> float:
    """Closed form of the tensor-parallel time the compute stream waits for in one layer's ``kind`` pass:
    ring ``max(C - G (T-1)/T, 0)``, pipeline ``max(3C/4 - 3G'/4, 0) + C/4``, bulk and asynchronous
    ``max(C - G', 0)``."""
    pieces = layer_pieces(p, kind, name)

    def c(pc: CommPiece) -> float:
        return comm.time("collective", pc.collective, pc.ranks, pc.nbytes)

    def g(pc: ComputePiece, beside: CommPiece) -> float:
        alone = compute.time(pc.matmuls, kernels=pc.kernels, sm_reserved=pc.sm_reserved)
        if pc.beside_sms is None:
            return alone
        sms = comm.sim.held_sms(pc.beside_sms, beside.collective, beside.ranks, beside.nbytes)
        reserved = compute.time(pc.matmuls, kernels=pc.kernels, sm_reserved=sms)
        held = c(beside)  # the kernel holds them while the collective runs, then the GEMM has every SM
        return reserved if held >= reserved else held + alone * (1 - held / reserved)

    total = 0.0
    for i, pc in enumerate(pieces):
        if type(pc) is not CommPiece:
            continue
        if not pc.beside:
            total += c(pc)
        else:  # beside: the compute pieces up to the join hide it
            join = next(j for j in range(i + 1, len(pieces)) if getattr(pieces[j], "joins", ""))
            total += max(c(pc) - sum(g(x, pc) for x in pieces[i + 1:join]), 0.0)
    return total


@pytest.mark.parametrize("nic", [200, 25])  # fast links: the GEMMs hide most; slow ones: comm-bound
@pytest.mark.parametrize("overlap, asynchronous", [(True, True), (False, True), (False, False)])
def test_exposed_tensor_parallel_time_is_the_closed_form(nic, overlap, asynchronous):
    cluster = ideal_spec(**{"intra_node.bw_GBps_per_direction": nic})
    p = plan(overlap, tp_async_backward=asynchronous)
    compute = ComputeModel.for_cluster(cluster, p.dtype, p.dtype_bytes, T)
    comm = CommCosts(cluster, T, compute)
    prediction = predict_step(p, cluster)
    layers = sum(1 for c in p.stage_costs(0) if c.name.startswith("layer"))
    per_microbatch = sum(exposed(p, compute, comm, kind, name) * (layers if name == "layer" else 1)
                         for name in ("embedding", "layer", "head") for kind in "FB")
    norms = sum(param.numel_per_rank(T) for cost in p.stage_costs(0) for param in cost.params
                if param.name.startswith("norm."))  # their gradients are summed over tp once per step
    norm_sync = comm.time("collective", "all_reduce", Lowering(p).group(0, "tp")[0], norms * p.grad_bytes)
    expected = p.num_microbatches * per_microbatch + norm_sync
    assert prediction.ranks[0].seconds["tp"] == pytest.approx(expected, rel=1e-9)
    in_line = predict_step(plan(overlap=False, tp_async_backward=False), cluster).ranks[0].seconds["tp"]
    assert prediction.ranks[0].seconds["tp"] <= in_line
    assert (prediction.ranks[0].seconds["tp"] < in_line) == (overlap or asynchronous)


def test_a_communication_kernel_takes_its_sms_from_the_gemm():
    """A compute-bound GEMM's time is its count of waves of 128 x 128 tiles over the SMs it runs on."""
    h100 = load_cluster("dgx-h100")
    compute = ComputeModel.for_cluster(h100, "bf16", 2)
    sms, m = h100.gpu.sm_count, 8192
    tiles = (m // 128) ** 2
    ratio = compute.matmul_time(m, m, m, sm_reserved=24) / compute.matmul_time(m, m, m)
    assert ratio == pytest.approx(-(-tiles // (sms - 24)) / -(-tiles // sms), rel=1e-12)


def test_a_gemm_beside_a_collective_has_every_sm_once_the_collective_ends():
    """10 ms of GEMM on every SM, 12.5 ms on those a kernel leaves: beside a 4 ms collective it runs 4 ms at
    0.8 of its speed, then the remaining 6.8 ms of work on all SMs; beside one that outlasts it, all on fewer."""
    assert ComputeModel.beside_collective_time(10e-3, 12.5e-3, 4e-3) == pytest.approx(4e-3 + 10e-3 * (1 - 4 / 12.5))
    assert ComputeModel.beside_collective_time(10e-3, 12.5e-3, 20e-3) == 12.5e-3
    assert ComputeModel.beside_collective_time(10e-3, 10e-3, 4e-3) == pytest.approx(10e-3)  # no SMs taken


def test_an_nccl_kernel_holds_one_sm_per_channel():
    """NCCL's tuner's channels for a DGX A100 ring (24, as its --explain prints), and none on a CPU host."""
    from parsim.sim.stepsim import StepSimulator

    a100 = load_cluster("dgx-a100")
    compute = ComputeModel.for_cluster(a100, "bf16", 2)
    sim = StepSimulator(a100.build(1), compute)
    assert sim.kernel_sms("all_reduce", tuple(range(8)), 48 * 2**20) == 24
    host = dataclasses.replace(ideal_spec(**{"intra_node.fabric": "pcie", "intra_node.in_switch_reduction": False}),
                               cpu_cores=4, nccl=None)
    assert StepSimulator(host.build(1), compute).kernel_sms("all_reduce", (0, 1), 2**20) == 0


def test_plan_rules_and_yaml():
    with pytest.raises(ParsimError, match="needs tensor_parallel megatron with tp > 1 and sequence_parallel"):
        Plan(model=GPT, tp=T, tp_comm_overlap=True)
    with pytest.raises(ParsimError, match="tp 1"):
        Plan(model=GPT, tp=1, sequence_parallel=True, tp_comm_overlap=True)
    p = load_plan({"model": "llama3-8b", "parallel": {"tp": 8}, "sequence_parallel": True, "tp_comm_overlap": True})
    assert p.tp_comm_overlap and load_plan(p.to_dict()).tp_comm_overlap
    off = load_plan({"model": "llama3-8b", "parallel": {"tp": 8}, "tp_async_backward": False})
    assert p.tp_async_backward and not off.tp_async_backward and not load_plan(off.to_dict()).tp_async_backward
    assert not load_plan({"model": "course-mlp", "parallel": {"tp": 2}}).tp_async_backward  # the lecture's style
    with pytest.raises(ParsimError, match="tp_async_backward .* needs tensor_parallel megatron"):
        load_plan({"model": "course-mlp", "parallel": {"tp": 2}, "tp_async_backward": True})


def test_a_tensor_parallel_group_across_nodes_cannot_overlap():
    """Userbuffers run over NVLink inside a node: simulate refuses the plan, search never proposes it."""
    from parsim.search.space import SearchSpace, enumerate_settings

    spec = ideal_spec()  # 8 GPUs per node
    wide = Plan(model=GPT, tp=16, sequence_parallel=True, tp_comm_overlap=True)
    with pytest.raises(ParsimError, match="tp_comm_overlap needs each tensor-parallel group inside one node"):
        predict_step(wide, spec)
    assert predict_step(Plan(model=GPT, tp=8, sequence_parallel=True, tp_comm_overlap=True), spec).step_s > 0
    space = SearchSpace(GPT, 16, 2, gpus_per_node=8)
    overlapped = {s.tp for s, variants in enumerate_settings(space) for v in variants if v.tp_overlap}
    assert overlapped == {2, 4, 8}


def test_gpus_joined_by_pcie_cannot_overlap_but_a_cpu_host_can():
    """Userbuffers need NVLink: a PCIe GPU node refuses the overlap; a CPU host runs the executor's."""
    from parsim.search.space import SearchSpace, enumerate_settings

    tp4 = Plan(model=GPT, tp=T, sequence_parallel=True, tp_comm_overlap=True)
    pcie = load_cluster("pcie-4x-rtx6000ada")
    assert not pcie.overlaps_tp_comm
    with pytest.raises(ParsimError, match="joins its GPUs by PCIe"):
        predict_step(tp4, pcie)
    host = dataclasses.replace(ideal_spec(**{"intra_node.fabric": "pcie", "intra_node.in_switch_reduction": False}),
                               cpu_cores=4)
    assert host.overlaps_tp_comm and predict_step(tp4, host).step_s > 0
    space = SearchSpace(GPT, 4, 2, gpus_per_node=4, tp_overlap=False)
    assert not any(v.tp_overlap for _, variants in enumerate_settings(space) for v in variants)


@pytest.mark.parametrize("overlap", [True, False])
def test_explain_compute_prices_each_collective_and_what_the_pass_exposes(overlap):
    """``parsim explain compute``'s collectives section: each priced alone, each pass exposing the closed form
    (all of every collective in line; with the overlap, what the GEMMs beside it leave)."""
    from parsim.cli.explain_compute import _collectives

    cluster = ideal_spec(**{"intra_node.bw_GBps_per_direction": 25})
    p = plan(overlap, tp_async_backward=overlap)
    compute = ComputeModel.for_cluster(cluster, p.dtype, p.dtype_bytes)
    comm = CommCosts(cluster, T, compute)
    rows, passes = _collectives(p, cluster, compute, "layer.0")
    for summary in passes:
        assert summary["exposed_s"] == pytest.approx(exposed(p, compute, comm, summary["pass"]), rel=1e-9)
        assert summary["time_s"] == pytest.approx(summary["compute_s"] + summary["exposed_s"])
        mine = [r for r in rows if r["pass"] == summary["pass"]]
        assert sum(r["exposed_s"] for r in mine) == pytest.approx(summary["exposed_s"])
        assert ("in_line_s" in summary) == overlap  # (on slow links the split collectives' latency can lose)
    assert all(r["method"] == "in line" and r["exposed_s"] == r["alone_s"] for r in rows) != overlap


@pytest.mark.parametrize("asynchronous", [True, False])
def test_explain_compute_says_why_the_backward_compute_grew_beside_asynchronous_collectives(asynchronous):
    from parsim.cli.explain_compute import _collectives, _collectives_report

    cluster = load_cluster("dgx-h100")
    p = plan(False, sequence_parallel=False, tp_async_backward=asynchronous)
    rows, passes = _collectives(p, cluster, ComputeModel.for_cluster(cluster, p.dtype, p.dtype_bytes), "layer.0")
    report = _collectives_report(p, "layer.0", rows, passes)
    assert ("its NCCL kernel leaves (one per channel)" in report) == asynchronous
    assert ("async" in {r["method"] for r in rows}) == asynchronous


@pytest.mark.parametrize("flags, row", [
    ([], "megatron, backward collectives beside the GEMMs"),
    (["--no-tp-async-backward"], "megatron\n"),
    (["--sequence-parallel", "--tp-comm-overlap"],
     "megatron with sequence parallelism, communication overlapped with GEMMs"),
])
def test_plan_show_says_where_the_tensor_parallel_collectives_run(capsys, flags, row):
    from parsim.cli.main import main

    assert main(["plan", "show", "tiny-tp2", *flags]) == 0
    assert f"tensor parallel   {row}" in capsys.readouterr().out
