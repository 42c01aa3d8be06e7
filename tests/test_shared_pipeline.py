"""The comm stretch (parsim.calibrate.shared_pipeline): fitted so that the generic pipeline's simulated steps are as
many times apart, two replicas on 2 cores against one with a core per rank, as the executor measured."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cpu_host import cpu_host
from parsim.calibrate.shared_pipeline import COMM_STRETCH_RANGE, GenericSteps, fit_comm_stretch, generic_pipeline
from parsim.errors import ParsimError
from parsim.hardware.cluster import SharedCoreCosts, parse_cluster
from parsim.sim.compute import ComputeModel
from parsim.sim.step import predict_step
from test_host_costs import HOST_KEYS, SHARED

SHARED_FIGURES = {**SHARED, "p2p_issue_us": 900.0, "matmul_stretch": 2.1, "eager_stretch": 2.1}


def _host(**shared) -> object:
    return parse_cluster(cpu_host(**HOST_KEYS, cpu_cores=2, shared_cores={**SHARED_FIGURES, **shared}), "host.yaml")


def _linear(plan, cluster) -> float:
    """A stand-in simulator: 10 ms a step on 2 ranks, 20 ms times the comm stretch on 4."""
    return 10e-3 if plan.world == 2 else 20e-3 * (cluster.shared_cores.comm_stretch or 1.0)


def test_the_generic_pipeline_is_two_stages_of_the_loop_s_mlp_then_two_replicas_of_it():
    alone, shared = generic_pipeline(1), generic_pipeline(2)
    assert (alone.world, alone.pp, alone.dp, shared.world, shared.dp) == (2, 2, 1, 4, 2)
    assert (alone.schedule, alone.num_microbatches, alone.microbatch_size) == ("1f1b", 4, 64)
    assert shared.microbatch_size == 64 and alone.model.width == 768 and alone.model.num_layers == 4


def test_the_fit_finds_the_factor_whose_simulated_ratio_is_the_measured_one():
    """Measured 25 ms against 100 ms with a core each: a ratio of 2.5 is the stand-in's at 1.25."""
    assert fit_comm_stretch(_host(), 2.5, _linear) == pytest.approx(1.25, abs=1e-3)


@pytest.mark.parametrize("measured_ratio, fitted", [(1.5, COMM_STRETCH_RANGE[0]), (9.0, COMM_STRETCH_RANGE[1])])
def test_the_fit_keeps_to_its_range_where_the_ratio_never_crosses(measured_ratio, fitted):
    assert fit_comm_stretch(_host(), measured_ratio, _linear) == fitted


def test_with_the_step_simulator_the_fitted_factor_brackets_the_measured_ratio():
    """The simulated ratio grows by steps (the turns on a core reorder), so the fit lands where it crosses."""
    host = _host()
    alone = predict_step(generic_pipeline(1), host).step_s

    def ratio(factor: float) -> float:
        spec = replace(host, shared_cores=replace(host.shared_cores, comm_stretch=factor))
        return predict_step(generic_pipeline(2), spec).step_s / alone

    measured = 1.15 * ratio(1.0)
    fitted = fit_comm_stretch(host, measured)
    assert COMM_STRETCH_RANGE[0] < fitted < COMM_STRETCH_RANGE[1]
    assert ratio(fitted - 1e-3) < measured <= ratio(fitted + 1e-3)


def test_the_fit_refuses_a_host_without_shared_core_figures_and_steps_that_are_not_positive():
    host = _host()
    with pytest.raises(ParsimError, match="shared_cores were measured"):
        fit_comm_stretch(replace(host, shared_cores=None), 2.0)
    with pytest.raises(ParsimError, match="must be positive"):
        fit_comm_stretch(host, 0.0)
    with pytest.raises(ParsimError, match="must be positive"):
        GenericSteps(((40e-3, 0.0),))
    with pytest.raises(ParsimError, match="must be positive"):
        GenericSteps(())


def test_the_measured_ratio_is_the_rounds_median_not_the_medians_ratio():
    """Each round's two runs are seconds apart; the host's speed moves between rounds (2.0, 2.4 and 3.0 here)."""
    steps = GenericSteps(((40e-3, 80e-3), (50e-3, 120e-3), (30e-3, 90e-3)))
    assert steps.ratios == pytest.approx([2.0, 2.4, 3.0])
    assert (steps.ratio, steps.core_each_s, steps.two_per_core_s) == pytest.approx((2.4, 40e-3, 90e-3))
    assert steps.text() == ("40.0 ms a step with a core per rank, 90.0 ms as two replicas on 2 cores (ratios "
                            "2.00-3.00 over 3 rounds, median 2.40)")
    assert GenericSteps(((40e-3, 100e-3),)).text().endswith("(ratio 2.50)")


def test_the_comm_stretch_lengthens_shared_core_compute_only_where_ranks_share_a_core():
    shared = SharedCoreCosts(1e-3, 1e-4, 1e-4, matmul_stretch=2.2, eager_stretch=2.0, comm_stretch=1.25)
    model = ComputeModel(peak_flops=70e9, hbm_bw_Bps=20e9, dtype_bytes=4, time_share=2.0, shared_cores=shared)
    assert model.core_stretch("matmul_stretch") == pytest.approx(2.2 * 1.25)
    assert model.core_stretch("eager_stretch") == pytest.approx(2.0 * 1.25)
    assert model.with_core_each().core_stretch("matmul_stretch") == 1.0


def test_a_cluster_file_keeps_the_comm_stretch_and_refuses_one_below_1():
    host = _host(comm_stretch=1.3)
    assert host.shared_cores.comm_stretch == 1.3
    assert host.shared_cores.to_mapping()["comm_stretch"] == 1.3
    with pytest.raises(ParsimError, match="comm_stretch"):
        _host(comm_stretch=0.5)
