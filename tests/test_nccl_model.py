"""NCCL's own cost model (parsim/sim/collectives/nccl.py) and how collectives use it."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import simpy
from ideal_cluster import ideal_spec

from parsim.cli.main import main
from parsim.errors import ConfigError
from parsim.files import read_yaml
from parsim.hardware.cluster import load_cluster, parse_cluster
from parsim.hardware.network import Network
from parsim.sim.collectives import build_phases, predict, simulate_phases
from parsim.sim.collectives.nccl import model_for

GIB = 2**30


def model(cluster: str, nodes: int, gpus_per_node: int | None = None):
    topo = load_cluster(cluster).build(nodes)
    per = gpus_per_node or topo.gpus_per_node
    group = np.concatenate([np.arange(per) + node * topo.gpus_per_node for node in range(nodes)])
    return topo, group, model_for(topo, group)


def busbw(p) -> float:
    return p.result().busbw_Bps / 1e9


@pytest.mark.parametrize("cluster, nodes, ring, comm_channels", [
    ("dgx-a100", 1, (12, 20.0, 20.0), 24),  # 12 NVLinks x 20 GB/s = 6 x 40, duplicated at half speed
    ("dgx-h100", 1, (12, 30.0, 30.0), 24),  # 18 x 20.6 = 370.8: 6 x 60, duplicated
    ("dgx-h100", 4, (8, 45.0, 45.0), 16),   # one channel per 400 Gb/s NIC; 8 x 48 would exceed NVLink
    ("dgx-a100", 4, (8, 24.0, 24.0), 16),   # PCIe Gen4 x16 (24 GB/s) between GPU and NIC caps a channel
])
def test_the_search_finds_the_channels_nccl_reports(cluster, nodes, ring, comm_channels):
    _, _, m = model(cluster, nodes)
    g = m.graphs["Ring"]
    assert (g.channels, g.bw_intra, g.bw_inter) == ring
    assert m.comm_channels == comm_channels


def test_nvls_has_one_channel_per_gpu_at_the_speed_its_links_allow():
    _, _, m = model("dgx-h100", 1)
    nvls = m.graphs["NVLS"]
    assert (nvls.channels, nvls.bw_intra) == (8, 40.0)  # 40 x (8 + 1) <= 370.8 GB/s of NVLink per GPU


@pytest.mark.parametrize("cluster, nodes, op, algorithm, expected", [
    ("dgx-h100", 1, "all_reduce", "auto", 8 * 40 * 0.85 * 7 / 8 * 2),  # NVLS: channels x speed x efficiency
    ("dgx-h100", 1, "all_reduce", "ring", 12 * 30.0),
    ("dgx-h100", 1, "all_gather", "auto", 12 * 30.0),
    ("dgx-a100", 1, "all_reduce", "auto", 12 * 20.0),
    ("dgx-h100", 4, "all_reduce", "auto", 8 * 45.5),  # NVLSTree, capped per channel across > 2 nodes
])
def test_large_messages_reach_nccls_bus_bandwidth(cluster, nodes, op, algorithm, expected):
    topo = load_cluster(cluster).build(nodes)
    p = predict(topo, op, 8 * GIB, algorithm=algorithm)
    assert busbw(p) == pytest.approx(expected, rel=0.02)


def test_the_tuner_picks_ll_for_small_messages_and_nvls_for_large_ones():
    topo = load_cluster("dgx-h100").build(1)
    small, large = predict(topo, "all_reduce", 4096), predict(topo, "all_reduce", GIB)
    assert (small.algorithm, small.protocol) == ("ring", "LL")
    assert (large.algorithm, large.protocol) == ("in_switch", "Simple")
    assert large.nccl.chosen.name == "NVLS/Simple"
    assert min(large.candidates.values()) == pytest.approx(large.nccl.chosen.time_us * 1e-6)


@pytest.mark.parametrize("cluster, nodes, op, size", [
    ("dgx-h100", 1, "all_reduce", 64 << 20), ("dgx-a100", 1, "all_reduce", 4 << 20),
    ("dgx-h100", 2, "all_reduce", 256 << 20), ("dgx-a100", 2, "all_gather", GIB),
    ("dgx-h100", 4, "reduce_scatter", 32 << 20), ("dgx-a100", 1, "broadcast", 1 << 20),
])
def test_an_idle_network_reproduces_nccls_time_plus_the_pipeline_fill(cluster, nodes, op, size):
    topo = load_cluster(cluster).build(nodes)
    p = predict(topo, op, size)
    assert p.time_s == pytest.approx((p.nccl.time_us + p.nccl.fill_us) * 1e-6, rel=1e-3)
    assert p.nccl.predicted_us == p.nccl.time_us + p.nccl.fill_us


def test_small_messages_run_on_fewer_channels():
    _, group, m = model("dgx-a100", 1)
    small, large = m.choose("all_reduce", 64 << 10), m.choose("all_reduce", 64 << 20)
    assert small.channels < small.max_channels and large.channels == large.max_channels
    assert small.time_us > small.chosen.time_us  # slower than the tuner's own estimate


def test_fewer_channels_keep_a_cap_on_the_whole():
    """LL's ring bandwidth is capped on the whole (tuning.cc ``llMaxBw``), far below what every channel could
    move: a 1 MiB all-gather on 64 H100s runs on 4 of 16 channels at the cap, not at a quarter of it (which
    had made it 2.2x slower than at 2 MiB)."""
    _, _, m = model("dgx-h100", 8)
    c = m.choose("all_gather", 1 << 20)
    assert (c.chosen.algo, c.chosen.proto, c.channels, c.max_channels) == ("Ring", "LL", 4, 16)
    assert c.effective_bw_GBps == pytest.approx(c.bw_GBps)
    assert c.time_us == pytest.approx(c.chosen.time_us)


def test_a_kernel_on_fewer_channels_moves_their_share_of_the_searched_channels():
    """The tuner counts the search's 12 ring channels (30 GB/s each, NCCL's units) on an H100 node; the
    communicator splits them into 24. A 64 KiB all-reduce runs on 2 of those 24: one searched channel's worth,
    30 GB/s x 1/2 for LL's flags = 15 GB/s bus, x 8/14 for the ring's steps; with every channel, LL's cap of
    141 GB/s (not 12 x 15 = 180) x 8/14."""
    _, _, m = model("dgx-h100", 1)
    c = m.choose("all_reduce", 64 << 10)
    assert (c.chosen.algo, c.chosen.proto, c.channels, c.max_channels) == ("Ring", "LL", 2, 24)
    assert c.effective_bw_GBps == pytest.approx(15 * 8 / 14)
    assert c.bw_GBps == pytest.approx(141 * 8 / 14)


@pytest.mark.parametrize("cluster, nodes, op", [("dgx-h100", 8, "all_gather"), ("dgx-h100", 4, "broadcast"),
                                                ("dgx-a100", 1, "all_reduce"), ("dgx-h100", 16, "all_reduce")])
def test_a_larger_message_never_takes_much_less_time(cluster, nodes, op):
    """Across sizes from 1 KiB to 1 GiB in steps of sqrt(2), a message is never more than 30% faster than the
    one before it (a 1 MiB all-gather on 64 H100s had taken 284 us, 2 MiB 155 us). Dropping channels where a
    message is small, as enqueue.cc does after the tuner picked on all of them, still makes the time dip where a
    channel count or protocol steps up: an all-reduce on an A100 node takes 31.2 us at 45 KiB on one of 24
    channels, 26.5 at 64 KiB on two; a broadcast on 32 H100s 25.8 us at 181 KiB (Ring/LL, few channels), 18.9
    at 256 KiB (LL128 on all)."""
    topo = load_cluster(cluster).build(nodes)
    times = [predict(topo, op, int(2 ** (10 + k / 2))).time_s for k in range(41)]
    assert all(later > 0.7 * earlier for earlier, later in zip(times, times[1:]))


def test_a_forced_protocol_is_used_and_is_slower_than_the_tuners_pick():
    topo = load_cluster("dgx-a100").build(1)
    auto, ll = predict(topo, "all_reduce", GIB), predict(topo, "all_reduce", GIB, protocol="LL")
    assert ll.protocol == "LL" and ll.time_s > 1.5 * auto.time_s


def test_algorithms_nccl_does_not_have_keep_the_flow_model():
    topo = load_cluster("dgx-h100").build(2)
    p = predict(topo, "all_reduce", GIB, algorithm="hierarchical")
    assert p.nccl is None and p.protocol == ""


def test_clusters_without_an_nccl_section_keep_the_flow_model():
    topo = ideal_spec().build(2)
    p = predict(topo, "all_reduce", GIB)
    assert p.nccl is None and p.protocol == "" and p.algorithm in ("ring", "tree", "in_switch")


def test_collectives_that_share_links_each_carry_nccls_wire_bytes():
    """Two identical NCCL all-reduces at once on the same GPUs take twice as long to move their bytes."""
    topo = load_cluster("dgx-a100").build(1)
    group = np.arange(8)

    def run(copies: int) -> float:
        env = simpy.Environment()
        net = Network(env, topo.capacity_Bps)
        for _ in range(copies):
            phases = build_phases(topo, "all_reduce", "ring", group, GIB, protocol="Simple")
            env.process(simulate_phases(env, net, topo, phases, topo.spec.reduction_bw_Bps))
        env.run()
        return env.now

    choice = predict(topo, "all_reduce", GIB, protocol="Simple").nccl
    latency = (choice.latency_us + choice.fill_us) * 1e-6  # the fill is time, not bytes: it does not scale
    assert run(2) - latency == pytest.approx(2 * (run(1) - latency), rel=1e-3)


def test_pat_serves_all_gather_with_one_gpu_per_node():
    topo, group, m = model("dgx-h100", 8, gpus_per_node=1)
    table, disabled = m.table("all_gather")
    assert ("PAT", "Simple") in table and "PAT" not in disabled
    _, _, full = model("dgx-h100", 8)
    assert "PAT" in full.table("all_gather")[1]  # eight GPUs per node: no PAT


def _h100_data() -> dict:
    return copy.deepcopy(read_yaml(load_cluster("dgx-h100").source))


def test_collnet_only_where_the_cluster_file_declares_it():
    _, _, plain = model("dgx-h100", 4)
    assert "CollNetDirect" in plain.table("all_reduce")[1]
    data = _h100_data()
    data["nccl"]["collnet"] = True
    topo = parse_cluster(data, "h100-sharp.yaml").build(4)
    m = model_for(topo, np.arange(topo.num_gpus))
    assert ("CollNetDirect", "Simple") in m.table("all_reduce")[0]
    p = predict(topo, "all_reduce", GIB, algorithm="collnet")
    assert p.nccl.chosen.algo.startswith("CollNet") and p.time_s > 0


@pytest.mark.parametrize("key, value, message", [
    ("cpu_vendor", "via", "nccl.cpu_vendor"),
    ("compute_capability", "hopper", "nccl.compute_capability"),
    ("nvlinks", 18, "nccl.nvlinks"),
    ("collnet", "yes", "nccl.collnet"),
])
def test_a_bad_nccl_section_names_the_key(key, value, message):
    data = _h100_data()
    data["nccl"][key] = value
    with pytest.raises(ConfigError, match=message):
        parse_cluster(data, "bad.yaml")


def test_explain_shows_nccls_tuning_table_and_choice(capsys):
    assert main(["collective", "all-reduce", "--cluster", "dgx-a100", "--gpus", "8", "--size", "16MiB",
                 "--explain"]) == 0
    out = capsys.readouterr().out
    assert "as NCCL's tuner picks them: Ring / LL128" in out
    assert "Ring/Simple" in out and "<- least time, chosen" in out and "12 x 20 GB/s" in out
    assert "channels" in out


def test_the_cli_forces_a_protocol(capsys):
    assert main(["collective", "all-reduce", "--cluster", "dgx-h100", "--gpus", "8", "--size", "1GiB",
                 "--algorithm", "ring", "--protocol", "LL128"]) == 0
    assert "protocol LL128" in capsys.readouterr().out


# -- the kernel's pipeline (enqueue.cc calcCollChunking, device/all_reduce.h) -----------------------------------

def _choice(cluster: str, nodes: int, op: str, size: int, algos=None, proto=None):
    return model(cluster, nodes)[2].choose(op, size, algos, proto)


@pytest.mark.parametrize("loops", [1, 2, 3, 5])
def test_a_ring_all_reduce_of_k_full_loops_takes_k_loop_times_and_no_fill(loops):
    # dgx-a100, one node: 24 kernel channels, Simple chunk = 4 MiB / NCCL_STEPS x ALLREDUCE_CHUNKSTEPS = 2 MiB,
    # a loop = 8 ranks x 2 MiB per channel.
    size = 24 * loops * 8 * (2 << 20)
    c = _choice("dgx-a100", 1, "all_reduce", size, ("Ring",), "Simple")
    pipe = c.pipeline
    assert (pipe.channels, pipe.chunk, pipe.chunks_per_loop, pipe.loops) == (24, 2 << 20, 8, loops)
    assert pipe.handoffs == 0 and c.fill_us == 0.0
    assert pipe.loop_us == pytest.approx(8 * (2 << 20) / (1000 * c.effective_bw_GBps / 24))
    assert c.predicted_us == pytest.approx(c.latency_us + loops * pipe.loop_us)


@pytest.mark.parametrize("nodes, depth", [(2, 1), (4, 2), (8, 3)])
@pytest.mark.parametrize("loops", [8, 16, 40])
def test_nvls_tree_pays_one_loop_per_tree_level_and_one_for_the_nvls_stages(nodes, depth, loops):
    # dgx-h100: 16 NVLS channels (NVLS_NCHANNELS_SM90), 8 heads; chunks 128 KiB on 2 nodes, 64 KiB from 4 on.
    chunk = 128 << 10 if nodes == 2 else 64 << 10
    size = 16 * loops * 8 * chunk
    c = _choice("dgx-h100", nodes, "all_reduce", size, ("NVLSTree",))
    pipe = c.pipeline
    assert (pipe.channels, pipe.chunk, pipe.chunks_per_loop, pipe.loops) == (16, chunk, 8, loops)
    assert (pipe.handoffs, pipe.flows) == (2 + 2 * depth, 2)
    loop_us = 8 * chunk / (1000 * c.effective_bw_GBps / 16)
    assert c.predicted_us == pytest.approx(c.latency_us + (loops + 1 + depth) * loop_us)


def test_nvls_on_one_node_pays_one_loop_and_shrinks_chunks_for_smaller_shares():
    big = _choice("dgx-h100", 1, "all_reduce", 4 * GIB, ("NVLS",))
    mid = _choice("dgx-h100", 1, "all_reduce", 128 << 20, ("NVLS",))
    small = _choice("dgx-h100", 1, "all_reduce", 16 << 20, ("NVLS",))
    # 8 MiB per channel < 64 x 8 heads x 128 KiB: 64 KiB; 1 MiB < 8 x 8 x 64 KiB: 32 KiB (enqueue.cc)
    assert [c.pipeline.chunk for c in (big, mid, small)] == [128 << 10, 64 << 10, 32 << 10]
    for c in (big, mid, small):
        assert c.fill_us == pytest.approx(c.pipeline.loop_us)  # 2 hand-offs / 2 flows


def test_a_simple_broadcast_chain_pays_one_chunk_per_extra_rank_and_ll_none():
    c = _choice("dgx-a100", 1, "broadcast", 64 << 20, proto="Simple")
    pipe = c.pipeline
    assert (pipe.chunk, pipe.chunks_per_loop, pipe.handoffs, pipe.flows) == (512 << 10, 1, 8 - 2, 1)
    assert c.fill_us == pytest.approx(6 * (512 << 10) / (1000 * c.effective_bw_GBps / pipe.channels))
    assert _choice("dgx-a100", 1, "broadcast", 64 << 20, proto="LL").fill_us == 0.0


def test_tiny_messages_keep_nccls_latency():
    # two H100 nodes, 8 bytes: published 24.7 us (nccl-tests#309); NCCL picks Tree/LL, which has no fill
    topo = load_cluster("dgx-h100").build(2)
    p = predict(topo, "all_reduce", 8)
    assert p.nccl.chosen.name == "Tree/LL" and p.nccl.fill_us == 0.0
    assert p.time_s * 1e6 == pytest.approx(25.2, abs=0.1)


def test_the_tuner_still_picks_by_nccls_own_estimate():
    # The fill is parsim's, not the tuner's: NCCL picks NVLSTree at 16 MiB on two nodes although it pays more fill.
    c = _choice("dgx-h100", 2, "all_reduce", 16 << 20)
    assert c.chosen.name == "NVLSTree/Simple" and c.fill_us > 0
    assert c.candidates[0].name == c.chosen.name


def test_the_fill_is_latency_in_the_phases_the_step_simulator_runs():
    topo = load_cluster("dgx-h100").build(2)
    group = np.arange(16)
    c = predict(topo, "all_reduce", 128 << 20).nccl
    phases = build_phases(topo, "all_reduce", "nvls_tree", group, 128 << 20)
    assert sum(p.latency_s for p in phases) == pytest.approx((c.latency_us + c.fill_us) * 1e-6)


def test_explain_shows_the_pipeline_step_by_step(capsys):
    assert main(["collective", "all-reduce", "--cluster", "dgx-h100", "--gpus", "16", "--size", "16MiB",
                 "--explain"]) == 0
    out = capsys.readouterr().out
    assert "16 channels (NCCL_NVLS_NCHANNELS): 16,777,216 B / 16 = 1,048,576 B per channel" in out
    assert "1,048,576 B < 4 x 8 heads x 131,072 B: chunk 65,536 B" in out
    assert "2 loop(s)" in out and "4 hand-offs" in out
    assert "fill + drain = 4 x 34.1 us / 2 = 68.1 us" in out
    assert "134.9 us + 68.1 us = 203.1 us" in out
    assert main(["collective", "all-reduce", "--cluster", "dgx-a100", "--gpus", "8", "--size", "128MiB",
                 "--explain"]) == 0
    assert "no fill to pay: every rank sends its own chunk" in capsys.readouterr().out


@pytest.mark.parametrize("op, moved", [("all_to_all", 7 / 8), ("send_recv", 1.0)])
def test_point_to_point_inside_a_node_moves_at_nccls_nvlink_speed(op, moved):
    """NCCL runs all-to-all and send/recv as grouped sends with no tuning model: inside an H100 node they move at
    NCCL's NVLink speed, 18 links x 20.6 GB/s = 370.8 GB/s (topo.h), not the 450 GB/s peak."""
    topo = load_cluster("dgx-h100").build(1)
    group = np.arange(8 if op == "all_to_all" else 2)
    p = predict(topo, op, GIB, group)
    assert p.result().busbw_Bps / 1e9 == pytest.approx(370.8, rel=0.01)
    assert p.time_s == pytest.approx(moved * GIB / 370.8e9, rel=0.01)


def test_point_to_point_across_nodes_keeps_the_nics_speed():
    """Across 4 nodes an all-to-all is bound by the NICs (NCCL's speed for a NIC is its line rate): each GPU
    sends 24 of its 32 chunks to GPUs of other nodes, through its own 50 GB/s NIC."""
    topo = load_cluster("dgx-h100").build(4)
    p = predict(topo, "all_to_all", GIB, np.arange(32))
    assert p.time_s == pytest.approx(GIB * 24 / 32 / 50e9, rel=0.02)


def test_explain_derives_the_point_to_point_speed(capsys):
    assert main(["collective", "all-to-all", "--cluster", "dgx-h100", "--gpus", "8", "--size", "1GiB",
                 "--explain"]) == 0
    out = capsys.readouterr().out
    assert "18 NVLinks x 20.6 GB/s" in out and "= 370.8 GB/s, 0.824 of the 450 GB/s peak" in out


def test_every_tuning_cell_shows_how_its_latency_and_bandwidth_add_up():
    """--explain derives each cell from tuning.cc's constants: base + steps x latency per hop, and the channels'
    GB/s through each factor to the message's rate (on 8 H100s: Ring/Simple 8.4 + 14 x 3.4 = 56 us at
    12 x 30 x 8/14 = 205.7 GB/s; NVLS 8 x 40 x 0.85 x 7/8 x 2 x 8/14 = 272 GB/s)."""
    table, _ = model("dgx-h100", 1)[2].table("all_reduce")
    ring, nvls = table[("Ring", "Simple")], table[("NVLS", "Simple")]
    assert ring.latency_text == "base 8.4 + 14 steps x nvlink hop 3.4 us" and ring.latency_us == pytest.approx(56.0)
    assert ring.bw_text == "12 ch x 30 GB/s x 8/14 steps (the message's own rate) = 205.7 GB/s"
    assert nvls.latency_text == "nvlink hop 25 us" and nvls.bw_GBps == pytest.approx(8 * 40 * 0.85 * 7 / 8 * 2 * 8 / 14)
    assert nvls.bw_text.endswith("= 272 GB/s")
    across, _ = model("dgx-h100", 8)[2].table("all_reduce")
    assert across[("Ring", "LL")].latency_text == (
        "base 6.6 + 112 steps x nvlink hop raised to the intel CPU's 1 + 14 steps x network hop 2.7 us")
    assert main(["collective", "all-reduce", "--gpus", "8", "--size", "1GiB", "--explain"]) == 0
