"""The flow-level network: max-min fair sharing, and collectives that contend."""

from __future__ import annotations

import numpy as np
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st
from ideal_cluster import ideal_spec

from parsim.hardware.network import Network, chain_routes, max_min_rates, unique_links
from parsim.sim.collectives import build_phases, predict, simulate_phases


def test_flows_on_one_link_split_it_evenly():
    rates = max_min_rates(np.array([[0], [0], [0], [0]]), np.array([100.0]))
    assert rates.tolist() == [25.0] * 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 299), max_size=80), st.sampled_from([300, 100_000]))
def test_unique_links_is_numpy_unique_with_its_inverse(ids, bound):
    # a table for many ids against few possible (bound 300), numpy's sort for few against many (100,000)
    ids = np.array(ids, dtype=np.int64)
    used, inverse = unique_links(ids, bound, inverse=True)
    expected, expected_inverse = np.unique(ids, return_inverse=True)
    assert used.tolist() == expected.tolist() and inverse.tolist() == expected_inverse.tolist()
    assert unique_links(ids, bound).tolist() == expected.tolist()


def test_max_min_gives_leftover_to_flows_not_bottlenecked_there():
    # Flow 0 crosses links 0 and 1; flow 1 only link 1; link 0 is slow.
    rates = max_min_rates(np.array([[0, 1], [1, -1]]), np.array([10.0, 100.0]))
    assert rates.tolist() == [10.0, 90.0]


def test_a_flow_finishing_frees_bandwidth_for_the_others():
    env = simpy.Environment()
    net = Network(env, np.array([100.0]))
    done = {}

    def send(name, nbytes):
        yield net.transfer(np.array([[0]]), nbytes)
        done[name] = env.now

    env.process(send("small", 100.0))
    env.process(send("large", 300.0))
    env.run()
    # Both at 50 B/s until the small one ends at t=2; the large one then has 200 B left at 100 B/s.
    assert done["small"] == pytest.approx(2.0)
    assert done["large"] == pytest.approx(4.0)


def test_two_all_reduces_on_the_same_nics_slow_each_other_down():
    spec = ideal_spec()
    topo = spec.build(2)
    size = 64 * 2**20
    # Two groups that each span both nodes, on the same GPUs' NICs (GPUs 0-3 of each node vs 4-7 share no NIC
    # in an 8-NIC node), so use the same local GPUs in both: ranks {0,8} and {1,9} go through NICs 0 and 1.
    group_a, group_b = np.array([0, 8]), np.array([0, 8])
    alone = predict(topo, "all_reduce", size, group_a, "ring").time_s

    env = simpy.Environment()
    net = Network(env, topo.capacity_Bps)
    for group in (group_a, group_b):
        env.process(simulate_phases(env, net, topo, build_phases(topo, "all_reduce", "ring", group, size),
                                    spec.reduction_bw_Bps))
    env.run()
    assert env.now > 1.5 * alone


def test_all_reduces_on_disjoint_links_do_not_interfere():
    spec = ideal_spec()
    topo = spec.build(2)
    size = 16 * 2**20
    alone = predict(topo, "all_reduce", size, np.array([0, 1, 2, 3]), "ring").time_s
    env = simpy.Environment()
    net = Network(env, topo.capacity_Bps)
    for group in (np.array([0, 1, 2, 3]), np.array([8, 9, 10, 11])):
        env.process(simulate_phases(env, net, topo, build_phases(topo, "all_reduce", "ring", group, size),
                                    spec.reduction_bw_Bps))
    env.run()
    assert env.now == pytest.approx(alone, rel=1e-9)


OPS_ALGS = [("all_reduce", "ring"), ("all_reduce", "tree"), ("all_reduce", "hierarchical"),
            ("all_gather", "ring"), ("reduce_scatter", "recursive"), ("broadcast", "hierarchical"),
            ("all_to_all", "direct")]


@settings(max_examples=40, deadline=None)
@given(
    op_alg=st.sampled_from(OPS_ALGS),
    nodes=st.sampled_from([2, 4]),
    size=st.integers(min_value=1024, max_value=2**30),
    which=st.sampled_from(["intra_node.bw_GBps_per_direction", "scale_out.nic_bw_Gbps"]),
    factor=st.floats(min_value=1.0, max_value=8.0),
)
def test_more_bandwidth_never_makes_a_collective_slower(op_alg, nodes, size, which, factor):
    op, alg = op_alg
    base = ideal_spec()
    section, key = which.split(".")
    value = {"intra_node": 100, "scale_out": 200}[section] * factor
    faster = ideal_spec(**{which: value})
    before = predict(base.build(nodes), op, size, algorithm=alg).time_s
    after = predict(faster.build(nodes), op, size, algorithm=alg).time_s
    assert after <= before * (1 + 1e-12)


@settings(max_examples=200, deadline=None)
@given(
    start=st.one_of(st.just(32.0), st.floats(min_value=0.0, max_value=1e7)),  # up to months of simulated time
    small=st.floats(min_value=1e-6, max_value=1e12),
    extra=st.one_of(st.floats(min_value=1e-9, max_value=1e-3), st.floats(min_value=0.0, max_value=1e12)),
    capacity=st.floats(min_value=1e3, max_value=1e12),
)
def test_transfers_finish_at_any_simulated_time_whatever_the_rounding(start, small, extra, capacity):
    # Two flows share one link: the small one ends at 2*small/C, the other gets the link and ends at
    # (small+large)/C. A remainder far below the clock's resolution at ``start`` must still end the flow.
    env = simpy.Environment()
    net = Network(env, np.array([capacity]))
    done = {}

    def send(name, nbytes, key):
        yield env.timeout(start)
        yield net.transfer(np.array([[0]]), nbytes, key=key)
        done[name] = env.now

    large = small + extra
    env.process(send("small", small, 1))
    env.process(send("large", large, 2))
    env.run()
    assert done["small"] == pytest.approx(start + 2 * small / capacity, rel=1e-9, abs=1e-9)
    assert done["large"] == pytest.approx(start + (small + large) / capacity, rel=1e-9, abs=1e-9)


def test_a_transfer_repeated_alone_is_solved_once_and_contention_is_remembered():
    env = simpy.Environment()
    net = Network(env, np.array([100.0, 100.0]))
    ends = []

    def repeat(key, routes, times):
        for _ in range(times):
            yield net.transfer(routes, 100.0, key=key)
            ends.append((key, env.now))

    env.process(repeat(1, np.array([[0]]), 5))
    env.run()
    assert net.solves == 1 and ends[-1] == (1, pytest.approx(5.0))  # alone: one trajectory, five wake-ups
    # Two transfers that share link 0, started together five times: the first starts alone (one trajectory),
    # the second joins (one solve of their component), the first ends and the second is alone (one more):
    # three solves for the first round, none for the four after it.
    env, ends[:] = simpy.Environment(), []
    net = Network(env, np.array([100.0, 100.0]))
    env.process(repeat(1, np.array([[0]]), 5))
    env.process(repeat(2, np.array([[0, 1]]), 5))
    env.run()
    assert [t for _, t in ends[-2:]] == [pytest.approx(10.0)] * 2  # each round: 100 B each at 50 B/s
    assert net.solves == 3


def test_a_pipelined_chain_is_one_flow_over_all_its_hops():
    # Two chains of two hops each: hop routes (flows x hops) become one row per chain, links first.
    routes = np.array([[0, -1], [1, 2], [3, -1], [4, -1]])
    chains, sizes = chain_routes(routes, np.array([5.0, 5.0, 7.0, 7.0]), 2)
    assert sorted(chains[0][chains[0] >= 0].tolist()) == [0, 1, 2] and sizes.tolist() == [5.0, 7.0]
    assert sorted(chains[1][chains[1] >= 0].tolist()) == [3, 4]


def test_a_chain_takes_only_its_slowest_hops_rate_on_a_shared_link():
    # A chain A->B (link 0, 10 B/s) -> C (link 1, 1 B/s) next to a flow on link 0 alone. As separate hops,
    # A->B would take half of link 0 (5 B/s) and the flow 9 bytes would take 1.8 s; a chain forwards only what
    # its slow hop passes on, 1 B/s, so the flow gets 9 B/s and ends at 1 s. The chain's time is unchanged.
    env = simpy.Environment()
    net = Network(env, np.array([10.0, 1.0]))
    done = {}

    def send(name, routes, nbytes):
        yield net.transfer(routes, nbytes)
        done[name] = env.now

    chain, sizes = chain_routes(np.array([[0], [1]]), np.array([2.0, 2.0]), 2)
    env.process(send("chain", chain, sizes))
    env.process(send("flow", np.array([[0]]), 9.0))
    env.run()
    assert done["flow"] == pytest.approx(1.0) and done["chain"] == pytest.approx(2.0)


def test_a_ring_alone_takes_as_long_with_chained_hops():
    topo = ideal_spec().build(2)
    for op in ("all_gather", "all_reduce"):
        chained = predict(topo, op, 64e6, np.arange(16), algorithm="ring").time_s
        phases = build_phases(topo, op, "ring", np.arange(16), 64e6)
        for phase in phases:
            phase.chain = 1  # every hop its own flow
        env = simpy.Environment()
        env.process(simulate_phases(env, Network(env, topo.capacity_Bps), topo, phases, topo.spec.reduction_bw_Bps))
        env.run()
        assert env.now == pytest.approx(chained, rel=1e-9)


def _fluid_reference(capacity: np.ndarray, batches: list[tuple[float, np.ndarray, np.ndarray]]) -> list[float]:
    """Each batch's end by the fluid model itself: max-min rates of every flow in flight solved again at every
    start and every finish, no shortcut taken."""
    starts = [start for start, _, _ in batches]
    flows = [(i, route, size) for i, (_, routes, sizes) in enumerate(batches) for route, size in zip(routes, sizes)]
    left = np.array([size for _, _, size in flows], dtype=float)
    ends = [start for start in starts]
    now, moving = 0.0, np.zeros(len(flows), dtype=bool)
    while True:
        for k, (i, _, _) in enumerate(flows):
            if not moving[k] and left[k] > 0 and starts[i] <= now:
                moving[k] = True
        future = [s for s in starts if s > now]
        if not moving.any():
            if not future:
                return ends
            now = min(future)
            continue
        active = np.nonzero(moving)[0]
        rates = max_min_rates(np.array([flows[k][1] for k in active]), capacity)
        due = left[active] / rates
        step = min(due.min(), min(future, default=np.inf) - now)
        left[active] = np.maximum(left[active] - rates * step, 0.0)
        now += step
        for k, finished in zip(active, due <= step * (1 + 1e-12)):
            if finished:
                moving[k], left[k] = False, 0.0
                ends[flows[k][0]] = max(ends[flows[k][0]], now)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), links=st.integers(min_value=2, max_value=5))
def test_every_shortcut_keeps_the_fluid_models_times(data, links):
    """Solo trajectories, memoized solutions and rates kept when finished flows freed no bottleneck anyone
    else crosses must end every transfer when re-solving at every event would."""
    capacity = np.array(data.draw(st.lists(st.sampled_from([10.0, 25.0, 40.0, 100.0]), min_size=links,
                                           max_size=links)))
    route = st.lists(st.integers(0, links - 1), min_size=1, max_size=3, unique=True).map(
        lambda hops: hops + [-1] * (3 - len(hops)))
    batch = st.tuples(st.sampled_from([0.0, 0.5, 1.0, 2.5]), st.lists(st.tuples(route, st.sampled_from(
        [10.0, 30.0, 45.0, 100.0])), min_size=1, max_size=4))
    drawn = data.draw(st.lists(batch, min_size=1, max_size=4))
    batches = [(start, np.array([r for r, _ in flows]), np.array([s for _, s in flows])) for start, flows in drawn]
    env = simpy.Environment()
    net = Network(env, capacity)
    ends = [0.0] * len(batches)

    def send(i, start, routes, sizes):
        yield env.timeout(start)
        yield net.transfer(routes, sizes, key=i)
        ends[i] = env.now

    for i, (start, routes, sizes) in enumerate(batches):
        env.process(send(i, start, routes, sizes))
    env.run()
    assert ends == pytest.approx(_fluid_reference(capacity, batches), rel=1e-9)
