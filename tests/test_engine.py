"""The step engine: plans that used to hang, stalls reported by name, progress, reproducible output."""

from __future__ import annotations

import gc
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ideal_cluster import ideal_spec

from parsim.cli.common import OpsProgress
from parsim.cli.main import main
from parsim.errors import ParsimError
from parsim.hardware.cluster import load_cluster
from parsim.sim.compute import ComputeModel
from parsim.sim.program import Op, Program
from parsim.sim.step import predict_step
from parsim.sim.stepsim import SCALAR_WORK, TIME_ARGS, StepSimulator, _time_args
from parsim.workload.plan import resolve_plan


def test_a_plan_whose_last_bytes_fell_below_the_clock_resolution_finishes(capsys):
    # Issue 6: at ~32 s of simulated time a flow kept 1e-4 B at 50 GB/s and the old network woke forever.
    assert main(["simulate", "--model", "llama3-405b", "--pp", "9", "--dp", "8", "--tp", "8",
                 "--num-microbatches", "16", "--dtype", "fp32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_s"] > 32 and out["world_size"] == 576


def test_progress_reports_every_op_finished():
    calls = []
    plan = resolve_plan("tiny-pp2")
    prediction = predict_step(plan, load_cluster("dgx-h100"), progress=lambda done, total: calls.append((done, total)))
    total = calls[-1][1]
    assert calls[-1] == (total, total) and total >= len(prediction.trace.events)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_is_drawn_in_place_on_a_terminal_and_erased():
    terminal = _Terminal()
    progress = OpsProgress("simulating x", terminal)
    progress(500, 1000)
    progress(1000, 1000)
    progress.close()
    text = terminal.getvalue()
    assert "\r\033[Ksimulating x: 500 / 1,000 ops (50%)" in text and text.endswith("\r\033[K")


def test_progress_is_silent_when_stderr_is_not_a_terminal():
    pipe = io.StringIO()
    progress = OpsProgress("x", pipe)
    progress(1, 2)
    progress.close()
    assert pipe.getvalue() == ""


def test_json_output_is_byte_identical_across_processes():
    # Different hash seeds change set and dict orders that must not leak into the result.
    command = [sys.executable, "-m", "parsim", "simulate", "llama3-70b-1024", "--dp", "4", "--json"]
    outputs = [subprocess.run(command, capture_output=True, env=os.environ | {"PYTHONHASHSEED": seed},
                              check=True).stdout for seed in ("1", "2")]
    assert outputs[0] == outputs[1] and json.loads(outputs[0])["step_s"] > 0


def test_a_transfer_over_a_link_without_bandwidth_is_reported_by_name():
    spec = ideal_spec()
    topo = spec.build(1)
    topo.capacity_Bps[:] = 0.0  # no file can say this (the loader refuses it): a stall must still end
    program = Program(world_size=2)
    send = program.add(0, Op("send act stage=0 mb=0 peer=1", "send", "p2p", ranks=(0, 1), nbytes=1e6, peer=1))
    program.add(1, Op("recv act stage=0 mb=0 peer=0", "recv", "compute", nbytes=1e6, peer=0, match=send))
    sim = StepSimulator(topo, ComputeModel(1e12, 1e12, 2))
    with pytest.raises(ParsimError, match=r"stalled: 2 of 2 ops never finished; the first is 'send act"):
        sim.run(program)


def test_a_cluster_file_with_nan_bandwidth_is_refused_in_one_line(tmp_path, capsys):
    text = Path(load_cluster("dgx-h100").source).read_text()
    bad = tmp_path / "nan.yaml"
    bad.write_text(text.replace("bw_GBps_per_direction: 450", "bw_GBps_per_direction: .nan"))
    assert "bw_GBps_per_direction: .nan" in bad.read_text()
    assert main(["collective", "--cluster", str(bad), "--size", "1MiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "finite number" in err[0]


def test_contention_between_replicas_still_slows_a_step():
    # Starved NICs: the pipeline sends and the gradient all-reduces of one stage share them.
    starved = ideal_spec(**{"scale_out.nic_bw_Gbps": 1.0})
    plan = resolve_plan("llama3-70b-1024", overrides={"model": "tiny-gpt", "parallel": {"dp": 2, "tp": 2, "pp": 4},
                                                      "batch": {"num_microbatches": 8}})
    fast = predict_step(plan, ideal_spec())
    slow = predict_step(plan, starved)
    assert slow.step_s > fast.step_s
    assert np.isfinite(slow.step_s)


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    # 1.2 MB of JSON (every group of 16,384 ranks): far more than a pipe holds once `head` has gone.
    shown = subprocess.run(f"{sys.executable} -m parsim plan show llama3-405b-16k --json | head -1; "
                           f"exit ${{PIPESTATUS[0]}}", shell=True, executable="/bin/bash", capture_output=True,
                           text=True)
    assert shown.returncode == 0 and shown.stdout.strip() == "{" and "Traceback" not in shown.stderr


@pytest.mark.parametrize("plan_name, overrides", [
    ("llama3-70b-1024", {"parallel": {"dp": 2, "tp": 8, "pp": 2}}),  # all-reduces beside the weight gradients
    ("llama3-70b-1024", {"parallel": {"dp": 2, "tp": 8, "pp": 2}, "sequence_parallel": True}),  # and gathers
    ("llama3-70b-1024", {"parallel": {"dp": 2, "tp": 8, "pp": 2}, "sequence_parallel": True,
                         "tp_comm_overlap": True}),  # Transformer Engine's bulk overlaps
])
def test_absorbed_collectives_beside_the_compute_time_the_step_as_the_events_would(monkeypatch, plan_name,
                                                                                  overrides):
    """The engine takes an uncontended collective beside a compute op out of the schedule and holds the join
    after it until the collective would have ended (``_absorb_beside``): every op starts and ends as when it runs
    as events."""
    from parsim.lowering.lower import lower
    from parsim.sim import stepsim

    plan = resolve_plan(plan_name, overrides=overrides)
    cluster = load_cluster("dgx-h100")
    program = lower(plan)
    assert any(op.beside_of >= 0 for op in program.ops)

    def run():
        topo = cluster.build(max(1, plan.world // cluster.gpus_per_node))
        compute = ComputeModel.for_cluster(cluster, plan.dtype, plan.dtype_bytes, 8, plan.attention_seq)
        return {(e.name, e.rank, e.stream): (e.start_s, e.dur_s)
                for e in StepSimulator(topo, compute).run(program).events}

    taken = []
    absorb = stepsim._Run._absorb_beside

    def counted(self, prereqs, successor):
        absorb(self, prereqs, successor)
        taken.append(len(self.absorbed))

    monkeypatch.setattr(stepsim._Run, "_absorb_beside", counted)
    absorbed = run()
    assert taken[0] > 0
    monkeypatch.setattr(stepsim._Run, "_absorb_beside", lambda self, prereqs, successor: None)
    as_events = run()
    assert absorbed.keys() == as_events.keys()
    assert all(absorbed[k] == pytest.approx(as_events[k], abs=1e-12) for k in absorbed)


@pytest.mark.parametrize("plan_name, overrides, cluster, waits", [
    # tensor-parallel collectives nested in the passes and beside them (waits: gaps in the spans)
    ("llama3-70b-1024", {"parallel": {"dp": 2, "tp": 8, "pp": 2}, "sequence_parallel": True,
                         "tp_comm_overlap": True}, "dgx-h100", True),
    ("tiny-pp2", {"parallel": {"dp": 2, "cp": 2}}, "dgx-h100", False),  # context-parallel exchanges
    ("tiny-pp2", {"parallel": {"dp": 4}, "data_parallel": {"grad_sync": "fsdp"}}, "cpu-host", True),  # FSDP in line
])
def test_a_trace_merged_as_it_is_written_is_the_trace_merged_after(plan_name, overrides, cluster, waits):
    """``StepSimulator.run(merged=True)``, which joins each action's compute pieces as it writes its events, gives
    exactly the events of :func:`merge_spans` over the trace written piece by piece."""
    from cpu_host import cpu_host

    from parsim.hardware.cluster import parse_cluster
    from parsim.lowering.lower import lower
    from parsim.report.step_report import merge_spans

    plan = resolve_plan(plan_name, overrides=overrides)
    spec = parse_cluster(cpu_host(), "host.yaml") if cluster == "cpu-host" else load_cluster(cluster)
    program = lower(plan, fsdp_in_line=spec.describes_cpu_host)
    sim = StepSimulator(spec.build(max(1, plan.world // spec.gpus_per_node)),
                        ComputeModel.for_cluster(spec, plan.dtype, plan.dtype_bytes, min(plan.world, 8),
                                                 plan.attention_seq))
    after = merge_spans(sim.run(program)).events
    merged = sim.run(program, merged=True).events
    assert len(merged) < len(program.ops) and any("gaps" in e.args for e in merged) == waits
    assert merged == after


def test_compute_times_are_memoized_by_every_field_the_compute_model_reads():
    """An op's compute time takes each of ComputeModel.time's arguments from the op's field of that name (the
    stream split apart from the caller); the memo keys on all of them: the shared matmuls and SM-bound kernels by
    identity, every other one by value (SCALAR_WORK)."""
    compute = ComputeModel.for_cluster(load_cluster("dgx-h100"), "bf16", 2)
    op = Op("x", "compute", "compute", matmuls=((4096, 4096, 4096),), hbm_bytes=5e8, kernels=3, sm_reserved=24,
            fsdp_passes=(1, 0))
    assert compute.time(*_time_args(op, False)) == compute.time(op.matmuls, hbm_bytes=5e8, kernels=3,
                                                                sm_reserved=24, fsdp_passes=(1, 0))
    assert set(SCALAR_WORK) | {"matmuls", "sm_bound", "stream_apart"} == set(TIME_ARGS)


def test_only_the_link_sets_connected_to_the_representatives_are_kept():
    """Set 1 shares link 3 with the representative, set 2 shares link 7 with set 1 only, set 3 touches neither:
    the first three contend (through each other), the last cannot."""
    from parsim.sim.stepsim import _contending

    links = [np.array([0, 3]), np.array([3, 7]), np.array([7, 9]), np.array([5]), np.array([], dtype=np.int64)]
    assert _contending(links, 10) == [0, 1, 2]
    assert _contending([np.array([], dtype=np.int64), np.array([1])], 2) == [0]


def test_a_step_leaves_little_for_the_cyclic_garbage_collector():
    """The run's callbacks and the lowering's memos refer back to them: unless they let go, a step's whole
    simulation is cyclic garbage that only a collection frees (61,322 objects for this plan's 9,672 events
    before they did; a second's collection at the 1T plan's scale)."""
    plan, cluster = resolve_plan("llama3-70b-1024"), load_cluster("dgx-h100")
    predict_step(plan, cluster)  # the caches every step shares
    gc.collect()
    gc.disable()
    try:
        prediction = predict_step(plan, cluster)
        garbage = gc.collect()
    finally:
        gc.enable()
    assert garbage < len(prediction.trace.events) / 2
