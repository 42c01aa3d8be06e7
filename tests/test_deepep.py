"""DeepEP's dispatch and combine (``dispatcher: deepep``): a token once per node across the network, then NVLink
to its experts' GPUs (:mod:`parsim.sim.collectives.deepep`)."""

from __future__ import annotations

import dataclasses
import json
import statistics

import numpy as np
import pytest
from simulated import steps_and_memory

from parsim.cli.main import main
from parsim.errors import ParsimError
from parsim.hardware.cluster import load_cluster
from parsim.lowering.lower import lower
from parsim.sim.collectives.deepep import NVLINK_FRACTION, TokenRouting, copies, phases
from parsim.sim.step import predict_step
from parsim.validation.deepep import compare
from parsim.workload.model import load_model
from parsim.workload.plan import Plan, load_plan

H800 = load_cluster("hgx-h800")


def routed(tokens: int, nodes: int, gpus: int, experts: int, k: int, limit: int, seed: int = 0):
    """Distinct GPUs and nodes a token reaches, on average, routed as DeepSeek-V3's router does: random affinities;
    under a node limit the ``limit`` nodes with the highest sum of their top k/limit experts' affinities
    (report section 2.1.2), then the top ``k`` experts on those nodes."""
    rng = np.random.default_rng(seed)
    scores = rng.random((tokens, experts))
    per_node = experts // nodes
    if limit:
        by_node = np.sort(scores.reshape(tokens, nodes, per_node), axis=-1)[:, :, -(k // limit):].sum(-1)
        chosen = np.argsort(-by_node, axis=1)[:, :limit]
        allowed = np.zeros((tokens, nodes), dtype=bool)
        np.put_along_axis(allowed, chosen, True, axis=1)
        scores = np.where(np.repeat(allowed, per_node, axis=1), scores, -1.0)
    top = np.argsort(-scores, axis=1)[:, :k]
    gpu, node = top // (experts // (nodes * gpus)), top // per_node
    return tuple(float(np.mean([len(set(row)) for row in ids.tolist()])) for ids in (gpu, node))


@pytest.mark.parametrize("nodes,experts,k", [(1, 256, 8), (2, 256, 8), (4, 256, 8), (8, 64, 6)])
def test_copies_match_a_router_without_a_node_limit(nodes, experts, k):
    """Without a limit the k experts are any k of E: the hypergeometric closed forms are exact."""
    gpus, reached = routed(4000, nodes, 8, experts, k, limit=0)
    c = copies(TokenRouting(k, experts), nodes, 8)
    assert c.gpus == pytest.approx(gpus, rel=0.02)
    assert c.nodes == pytest.approx(reached, rel=0.02)
    assert c.network == pytest.approx(c.nodes * (nodes - 1) / nodes)
    assert c.nvlink == pytest.approx(c.gpus * 7 / 8)


def test_copies_under_deepseeks_node_limit():
    """DeepSeek-V3 on 8 nodes, at most 4 per token: the router reaches 3.95 nodes (parsim: 4, every picked node
    gets one of its best experts) and 7.49 GPUs (parsim: 7.36, the 8 experts spread evenly over the 4 nodes)."""
    gpus, reached = routed(4000, 8, 8, 256, 8, limit=4)
    c = copies(TokenRouting(8, 256, max_nodes=4), 8, 8)
    assert c.nodes == 4 and reached == pytest.approx(4, rel=0.02)
    assert c.gpus == pytest.approx(gpus, rel=0.03)
    assert c.network == 3.5  # against 7 copies of the plain all-to-all: 8 x 7/8
    # A limit at or above the nodes there are is no limit
    assert copies(TokenRouting(8, 256, max_nodes=4), 4, 8) == copies(TokenRouting(8, 256), 4, 8)


def test_the_phase_carries_the_copies():
    """Each rank sends D/N of a row per token to each other node's GPU of its index, and R/g to each other GPU of
    its node, those at DeepEP's share of NVLink; a row per token per expert is the plain all-to-all's buffer."""
    topo = H800.build(8)
    routing = TokenRouting(8, 256, max_nodes=4)
    size = 4096 * 8 * 7168.0
    (phase,) = phases(topo, np.arange(64), size, routing)
    c, row = copies(routing, 8, 8), size / 8
    same_node = topo.node_of(phase.src) == topo.node_of(phase.dst)
    assert np.all((phase.src % 8 == phase.dst % 8) | same_node)  # across nodes only between GPUs of one index
    from_rank_0 = phase.src == 0
    assert phase.nbytes[~same_node & from_rank_0].sum() == pytest.approx(row * c.network)
    assert phase.nbytes[same_node & from_rank_0].sum() == pytest.approx(row * c.nvlink / NVLINK_FRACTION)
    (inside,) = phases(topo, np.arange(8), size, routing)  # one node: NVLink only
    assert np.all(topo.node_of(inside.src) == 0) and len(inside.src) == 56
    with pytest.raises(ParsimError, match="do not split evenly"):
        phases(topo, np.arange(24), size, TokenRouting(8, 256))


def test_deepeps_published_bandwidths():
    """A check, not a fit: DeepEP's published H800 figures against parsim's model of its kernels at link speeds
    (docs/nccl-accuracy.md, "DeepEP's dispatch and combine"). parsim reads 11-29% fast: the kernels' own costs
    (the layout and count exchange, the forwarding's chunks) are not modelled."""
    rows = compare()
    assert len(rows) == 8
    errors = [r.error for r in rows]
    assert all(0 < e < 0.35 for e in errors)
    assert statistics.median(errors) < 0.2


MOE = load_model({"kind": "transformer", "name": "moe", "num_layers": 2, "hidden": 2048, "num_heads": 16,
                  "num_kv_heads": 8, "ffn_hidden": 8192, "seq_len": 4096, "vocab_size": 32000,
                  "num_experts": 64, "experts_per_token": 8, "expert_ffn_hidden": 1024, "max_routed_nodes": 2})


def test_a_deepep_plan_lowers_its_all_to_alls_with_the_routing():
    plan = Plan(model=MOE, dp=32, ep=32, dtype="bf16", microbatch_size=1, num_microbatches=2, dispatcher="deepep")
    ops = [op for op in lower(plan).ops if op.kind == "collective"]
    expert = [op for op in ops if op.group == "ep" and op.nbytes > 8 * 64]
    assert expert and all(op.routing == TokenRouting(8, 64, 2) for op in expert)
    counts = [op for op in ops if op.group == "ep" and op.nbytes == 8 * 64]  # the dispatch's counts, an int64 each
    assert len(counts) == len(expert) / 4 and all(op.routing is None for op in counts)
    assert all(op.routing is None for op in ops if op.group != "ep")
    plain = predict_step(dataclasses.replace(plan, dispatcher="alltoall"), load_cluster("dgx-h100"))
    deepep = predict_step(plan, load_cluster("dgx-h100"))
    # 4 nodes, a token on at most 2: 1.5 copies across the network against the all-to-all's 6
    assert deepep.ranks[0].seconds["ep"] < 0.5 * plain.ranks[0].seconds["ep"]
    assert load_plan(plan.to_dict()).dispatcher == "deepep"


@pytest.mark.parametrize("flags,message", [
    (["llama3-8b-fsdp8", "--dispatcher", "deepep"],
     "is a dense model: it has no expert all-to-alls for dispatcher deepep"),
    (["--model", "deepseek-v3", "--dp", "16", "--dtype", "bf16", "--dispatcher", "deepep"],
     "dispatcher deepep runs the expert all-to-alls, and with ep 1 there are none"),
])
def test_deepep_refusals_are_one_line(flags, message, capsys):
    assert main(["simulate", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_executor_refuses_it():
    from executor.train.runner import check_plan

    plan = Plan(model=MOE, dp=32, ep=32, dtype="bf16", microbatch_size=1, num_microbatches=2, dispatcher="deepep")
    with pytest.raises(ParsimError, match="does not execute DeepEP's expert dispatch"):
        check_plan(plan)


def test_plan_show_says_how_tokens_travel(capsys):
    assert main(["plan", "show", "deepseek-v3-2048"]) == 0
    out = capsys.readouterr().out
    assert "top-8 on at most 4 nodes, DeepEP (a copy per node across the network" in out


def test_the_search_prices_deepep_as_the_simulator_does():
    """``parsim search --dispatcher deepep``: every plan of a small MoE (16 experts, top-4, a token on one of the
    two nodes; with a multi-token prediction module) on 16 H100s with expert parallelism runs DeepEP's
    dispatch, and the fast tier prices it as the simulation does (2026-12-02: 258 plans with the paired ones,
    median 0.10%, at worst 1.6%); the plans it prints say so."""
    from parsim.search.fast import FastModel
    from parsim.search.space import Candidate, SearchSpace, enumerate_settings

    model = load_model({"kind": "transformer", "name": "moe", "num_layers": 4, "hidden": 1024, "num_heads": 8,
                        "num_kv_heads": 4, "ffn_hidden": 2048, "seq_len": 2048, "vocab_size": 1000,
                        "num_experts": 16, "experts_per_token": 4, "expert_ffn_hidden": 1024,
                        "max_routed_nodes": 1, "mtp_layers": 1})
    space = SearchSpace(model, 16, 32, dtype="bf16", dispatcher="deepep",
                        degrees=(("tp", (1,)), ("cp", (1,)), ("pp", (1, 2)), ("ep", (8, 16))))
    cluster = load_cluster("dgx-h100")
    fast = FastModel(space, cluster)
    prepared = [fast.prepare(s, variants) for s, variants in enumerate_settings(space)]
    jobs = [(p, i) for p in prepared for i in range(len(p.variants)) if not p.variants[i].fsdp]
    errors = []
    candidates = [Candidate(prep.setting, prep.variants[i]) for prep, i in jobs]
    plans = [candidate.plan(space) for candidate in candidates]
    for candidate, plan, estimate, (step_s, peak) in zip(candidates, plans, fast.estimate(jobs),
                                                         steps_and_memory(plans, cluster)):
        assert plan.dispatcher == "deepep" and candidate.mapping(space)["moe"]["dispatcher"] == "deepep"
        assert estimate.memory_bytes == pytest.approx(peak, rel=1e-12)
        errors.append(estimate.step_s / step_s - 1)
    assert len(errors) > 200
    assert statistics.median(map(abs, errors)) < 0.01 and max(map(abs, errors)) < 0.05


def test_a_dense_search_refuses_deepep(capsys):
    assert main(["search", "--model", "llama3-8b", "--gpus", "8", "--dispatcher", "deepep"]) == 2
    err = capsys.readouterr().err
    assert "--dispatcher deepep: llama3-8b is a dense model" in err and len(err.strip().splitlines()) == 1


def test_parsim_collective_times_and_explains_deepep(capsys):
    """``parsim collective all-to-all --deepep K,E,M``: the same call as DeepEP's EP 64 benchmark row, its copies
    explained step by step, and its bound the copies' bytes at the links' peak."""
    args = ["collective", "all-to-all", "--cluster", "hgx-h800", "--nodes", "8", "--deepep", "8,256,4"]
    size = 4096 * 8 * 7168 * 2  # the combine's: 4,096 tokens of 8 rows of 7,168 bf16 elements
    assert main([*args, "--size", str(size), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    published = next(r for r in compare() if r.ranks == 64 and r.call == "combine")
    assert row["algorithm"] == "deepep" and row["time_s"] == pytest.approx(published.seconds, rel=1e-9)
    assert main([*args, "--size", str(size), "--explain"]) == 0
    out = capsys.readouterr().out
    for text in ("R = m g (1 - C(m e - r, k) / C(m e, k)) = 7.359", "D = m = 4",
                 "D (N - 1) / N = 3.500 copies", "R (g - 1) / g = 6.439 copies",
                 "the plain all-to-all sends k (n - g) / n = 7.000 copies",
                 "lower bound", "each GPU sends 3.5 rows per token across the network at 50 GB/s"):
        assert text in out


@pytest.mark.parametrize("flags, message", [
    (["all-reduce", "--deepep", "8,256"], "an all-to-all, not all-reduce"),
    (["all-to-all", "--deepep", "8,256", "--algorithm", "direct"], "no --algorithm or --protocol with it"),
    (["all-to-all", "--deepep", "8"], "give K,E or K,E,M"),
    (["all-to-all", "--deepep", "9,8"], "K must be from 1 to E"),
])
def test_parsim_collective_refuses_what_deepep_cannot_run(flags, message, capsys):
    assert main(["collective", *flags, "--cluster", "hgx-h800", "--nodes", "2", "--size", "64MiB"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) <= 2  # argparse's usage line, then the error


def test_deepep_refuses_expert_groups_spread_unevenly_over_nodes(capsys):
    """DeepEP pairs each GPU with the GPU of its index on every other node: 12 ranks on 8 + 4 GPUs is refused in
    one line by the simulator, and the search leaves such layouts out rather than stop."""
    from parsim.search.space import Rejections, SearchSpace, _even_on_nodes, _expert_group, enumerate_settings

    model = load_model({"kind": "transformer", "name": "moe12", "num_layers": 2, "hidden": 1024, "num_heads": 8,
                        "ffn_hidden": 2048, "seq_len": 1024, "vocab_size": 1000, "num_experts": 24,
                        "experts_per_token": 4, "expert_ffn_hidden": 512})
    plan = Plan(model=model, dp=24, ep=12, dtype="bf16", microbatch_size=1, num_microbatches=1, dispatcher="deepep")
    with pytest.raises(ParsimError, match=r"as many of the 12 expert-parallel ranks on each node, not 8 \+ 4"):
        predict_step(plan, load_cluster("dgx-h100"))
    rejections = Rejections()
    settings = list(enumerate_settings(SearchSpace(model, 24, 48, dispatcher="deepep"), rejections))
    assert rejections.layouts["ep group spread unevenly over nodes (DeepEP)"] > 0
    layouts = {(s.dp, s.tp, s.pp, s.cp, s.ep) for s, _ in settings}
    assert (24, 1, 1, 1, 12) not in layouts and (24, 1, 1, 1, 24) in layouts
    assert all(_even_on_nodes(_expert_group(s.dp, s.tp, s.pp, s.cp, s.ep, v.order), 8)
               for s, variants in settings for v in variants)


def test_a_misspelt_dispatcher_is_one_line_even_for_a_dense_model(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text("model: tiny-gpt\nmoe: {dispatcher: deep-ep}\n")
    assert main(["plan", "show", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "dispatcher 'deep-ep' is not one of alltoall, deepep" in err and "\n" not in err


def test_the_search_says_deepep_in_its_header_its_commands_and_its_json(tmp_path, capsys):
    path = tmp_path / "moe.yaml"
    path.write_text("name: moe\nkind: transformer\nnum_layers: 2\nhidden: 1024\nnum_heads: 8\nffn_hidden: 2048\n"
                    "seq_len: 1024\nvocab_size: 1000\nnum_experts: 16\nexperts_per_token: 4\nexpert_ffn_hidden: 512\n")
    args = ["search", "--model", str(path), "--gpus", "16", "--global-batch", "32", "--ep", "16",
            "--dispatcher", "deepep", "--top", "1", "--simulate", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "experts dispatched by DeepEP" in out.splitlines()[0]
    assert " --ep 16 " in out and " --dispatcher deepep " in out
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["dispatcher"] == "deepep"
