"""Context parallelism on gloo ranks trains exactly like one process, with the simulator's K/V exchanges.

Unit level (one process): the ring's blocks over Megatron-LM's load-balanced
chunks, merged by their log-sum-exp, and their FlashAttention-style backward
equal full causal SDPA; so does attention on gathered K/V under the global
causal mask. Plan level: ring and all-gather attention alone (cp 2, cp 4) and
composed with dp, pp (1F1B and zero-bubble), tp, tied embeddings, and FSDP, HSDP
and ZeRO-1/2 sharding over the dp x cp ranks (as torchtitan's dp_shard_cp mesh) take one
step, AdamW included, and every rank's loss (the replica's, over whole
sequences), gradients and weights equal the single-process reference, and
every plan records exactly the events the lowering predicts.
"""

from __future__ import annotations

import importlib.util

import pytest
from reference_runs import assert_events_as_simulated, assert_step_equals_reference, verify_plans

from parsim.lowering.lower import lower
from parsim.workload.plan import load_plan

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
pytestmark = needs_torch

GPT = {"kind": "transformer", "name": "gpt", "num_layers": 2, "hidden": 32, "num_heads": 4, "num_kv_heads": 2,
       "ffn_hidden": 64, "seq_len": 16, "vocab_size": 64}
LEARNED = dict(GPT, position_embedding="learned")
BATCH = {"microbatch_size": 2, "num_microbatches": 2}


def cp_plan(model: dict, style: str, schedule: str = "1f1b", sync: dict | None = None, **parallel) -> object:
    return load_plan({"model": model, "parallel": parallel, "batch": BATCH, "context_parallel": style,
                      "schedule": schedule, **({"data_parallel": sync} if sync else {})})


ZERO1 = {"grad_sync": "bucketed", "bucket_size": "8KiB", "overlap": True, "zero": 1}
FSDP = {"grad_sync": "fsdp"}


PLANS_2 = {
    "cp2 ring, rope": cp_plan(GPT, "ring", cp=2),
    "cp2 all-gather, learned positions": cp_plan(LEARNED, "all_gather", cp=2),
    "cp2 ring, FSDP over the context-parallel ranks": cp_plan(GPT, "ring", sync=FSDP, cp=2),
    "cp2 all-gather, ZeRO-1 over the context-parallel ranks": cp_plan(LEARNED, "all_gather", sync=ZERO1, cp=2),
}
PLANS_4 = {
    "cp4 ring": cp_plan(GPT, "ring", cp=4),
    "cp4 all-gather, learned positions": cp_plan(LEARNED, "all_gather", cp=4),
    "cp2 x dp2 ring, learned positions": cp_plan(LEARNED, "ring", cp=2, dp=2),
    "cp2 x pp2 ring, 1f1b": cp_plan(dict(GPT, num_layers=4), "ring", cp=2, pp=2),
    "cp2 x pp2 all-gather, zero-bubble": cp_plan(dict(GPT, num_layers=4), "all_gather", "zero-bubble", cp=2, pp=2),
    "cp2 x tp2 ring": cp_plan(GPT, "ring", cp=2, tp=2),
    "cp2 x pp2 ring, tied across stages": cp_plan(dict(GPT, num_layers=4, tied_embeddings=True), "ring", cp=2, pp=2),
    "cp2 x dp2 ring, FSDP over dp x cp": cp_plan(GPT, "ring", sync=FSDP, cp=2, dp=2),
    "cp2 x dp2 ring, HSDP in shard groups of 2 (the cp pairs)": cp_plan(GPT, "ring", sync=dict(FSDP, shard_group=2),
                                                                        cp=2, dp=2),
    "cp2 x dp2 all-gather, ZeRO-2 over dp x cp": cp_plan(LEARNED, "all_gather", sync=dict(ZERO1, zero=2), cp=2,
                                                         dp=2),
    "cp2 x pp2 ring, FSDP (gathered once a step)": cp_plan(dict(GPT, num_layers=4), "ring", sync=FSDP, cp=2, pp=2),
}
RUNS = [(name, 2) for name in PLANS_2] + [(name, 4) for name in PLANS_4]


# --------------------------------------------------------------------------- the math, in one process
def _qkv(seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, heads, 16, 8, generator=g) for heads in (4, 2, 2))
    return q, k, v, torch.randn(2, 4, 16, 8, generator=g)


def _reference(q, k, v, dout):
    """Causal SDPA on the whole sequence: out and the gradients of ``(out * dout).sum()``."""
    from executor.train.models import causal_attention

    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = causal_attention(q, k, v)
    (out * dout).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _close(a, b) -> bool:
    return (a - b).abs().max().item() < 1e-5 * b.abs().max().item()


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_blocks_merged_by_log_sum_exp_equal_causal_attention(cp):
    """Every cp rank's ring over the load-balanced chunks, forward and backward, in one process."""
    import torch

    from executor.train.context_parallel import attend, attend_backward, merge, ring_block, sequence_positions

    q, k, v, dout = _qkv()
    ref_out, ref_dq, ref_dk, ref_dv = _reference(q, k, v, dout)
    tokens = [sequence_positions(16, cp, r) for r in range(cp)]
    assert sorted(torch.cat(tokens).tolist()) == list(range(16))
    causal = torch.ones(16 // cp, 16 // cp, dtype=torch.bool).tril()
    outs, lses = {}, {}
    for rank in range(cp):
        mine = q[:, :, tokens[rank]]
        for step in range(cp):  # the order the ring brings the chunks in
            source = (rank - step) % cp
            rows, cols, is_causal = ring_block(rank, source, 16 // cp)
            kc, vc = k[:, :, tokens[source]][:, :, cols], v[:, :, tokens[source]][:, :, cols]
            block = attend(mine[:, :, rows], kc, vc, causal if is_causal else None)
            if step == 0:
                outs[rank], lses[rank] = block
            else:
                merge(outs[rank][:, :, rows], lses[rank][:, :, rows], *block)
        assert _close(outs[rank], ref_out[:, :, tokens[rank]]), f"rank {rank}"

    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        dout_r = dout[:, :, tokens[rank]].float()
        delta = (dout_r * outs[rank]).sum(-1)
        for source in range(cp):
            rows, cols, is_causal = ring_block(rank, source, 16 // cp)
            where = tokens[source][cols]
            grads = attend_backward(q[:, :, tokens[rank]][:, :, rows], k[:, :, where], v[:, :, where],
                                    dout_r[:, :, rows], lses[rank][:, :, rows], delta[:, :, rows],
                                    causal if is_causal else None)
            dq[:, :, tokens[rank][rows]] += grads[0]
            dk[:, :, where] += grads[1]
            dv[:, :, where] += grads[2]
    assert _close(dq, ref_dq) and _close(dk, ref_dk) and _close(dv, ref_dv)


def test_attention_on_gathered_kv_with_the_global_mask_equals_causal_attention():
    import torch

    from executor.train.context_parallel import attend, attend_backward, sequence_positions

    cp = 4
    q, k, v, dout = _qkv(1)
    ref_out, ref_dq, ref_dk, ref_dv = _reference(q, k, v, dout)
    gathered = torch.cat([sequence_positions(16, cp, r) for r in range(cp)])  # keys in the order of the ranks
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        mine = sequence_positions(16, cp, rank)
        mask = mine.unsqueeze(1) >= gathered.unsqueeze(0)
        out, lse = attend(q[:, :, mine], k[:, :, gathered], v[:, :, gathered], mask)
        assert _close(out, ref_out[:, :, mine])
        d = dout[:, :, mine].float()
        grads = attend_backward(q[:, :, mine], k[:, :, gathered], v[:, :, gathered], d, lse, (d * out).sum(-1), mask)
        assert _close(grads[0], ref_dq[:, :, mine])
        dk[:, :, gathered] += grads[1]
        dv[:, :, gathered] += grads[2]
    assert _close(dk, ref_dk) and _close(dv, ref_dv)


# --------------------------------------------------------------------------- whole steps on gloo ranks
def measured_steps(rank: int, world: int, plans: list[dict]) -> list[dict]:
    """``parsim run``'s rank body on each plan: one warm-up step, then one measured step."""
    from executor.train.runner import rank_main

    return [rank_main(rank, world, plan, steps=1, warmup=1, seed=0) for plan in plans]


@pytest.fixture(scope="module")
def results() -> dict[int, list[list[dict]]]:
    return {2: verify_plans(PLANS_2, 2, timeout_s=120), 4: verify_plans(PLANS_4, 4, timeout_s=200)}


def _plan_and_runs(results, name: str, world: int):
    plans = PLANS_2 if world == 2 else PLANS_4
    index = list(plans).index(name)
    return plans[name], [results[world][rank][index] for rank in range(world)]


@pytest.mark.multiproc
@pytest.mark.parametrize("name,world", RUNS)
def test_context_parallel_step_equals_single_process(results, name, world):
    assert_step_equals_reference(*_plan_and_runs(results, name, world))


@pytest.mark.multiproc
@pytest.mark.parametrize("name,world", RUNS)
def test_events_match_the_simulated_program(results, name, world):
    """Same names, and the same number of each communication event (K/V exchanges included), per simulated rank."""
    plan, runs = _plan_and_runs(results, name, world)
    assert_events_as_simulated(plan, runs)
    for rank in lower(plan).ranks:
        assert any(n.startswith("reduce_scatter cp layer=") for n in runs[rank]["events"]), f"rank {rank}"


@pytest.mark.multiproc
def test_measured_exchanges_carry_the_simulated_bytes_inside_their_attention_pass():
    """Under ``parsim run``: each K/V exchange has the lowering's bytes and lies within its F or B action,
    and both cp ranks report the same (whole-sequence) loss."""
    from executor.launch import launch

    runs = launch(measured_steps, 2, ([p.to_dict() for p in PLANS_2.values()],), backend="gloo", timeout_s=120)
    for index, plan in enumerate(PLANS_2.values()):
        predicted = {op.name: op for op in lower(plan).rank_ops(0)}
        assert runs[0][index]["losses"] == runs[1][index]["losses"]
        events = runs[0][index]["steps"][0]
        actions = {e.name: e for e in events if e.kind == "compute"}
        exchanges = [e for e in events if e.stream == "cp"]
        assert len(exchanges) == 3 * plan.model.num_layers * plan.num_microbatches
        for e in exchanges:
            assert e.args["bytes"] == predicted[e.name].nbytes, e.name
            mb = e.name.split("mb=")[1].split()[0]
            action = actions[f"{'F' if e.name.endswith('fwd') else 'B'} stage=0 mb={mb}"]
            assert action.start_s <= e.start_s and e.end_s <= action.end_s
