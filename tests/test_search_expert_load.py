"""``parsim search --expert-load``: every MoE plan priced with its busiest expert at that load, by the fast tier as
the simulator prices it, and said in the header, the commands and the JSON."""

from __future__ import annotations

import json
import statistics

import pytest
from small_moe_search import MOE_SPEC, both_tiers

from parsim.cli.main import main
from parsim.search.space import Candidate


def _estimates(expert_load: float) -> dict[Candidate, tuple[float, float, float]]:
    """Every non-FSDP plan of a small MoE on 16 H100s: (fast tier's step, simulated step, fast tier's memory)."""
    _, plans = both_tiers(expert_load=expert_load)
    assert all(plan.expert_load == expert_load for _, plan, _ in plans.values())
    return {c: (estimate.step_s, simulated, estimate.memory_bytes) for c, (estimate, _, simulated) in plans.items()}


def test_the_fast_tier_prices_a_hot_expert_as_the_simulator_does_and_it_costs_time_and_memory():
    hot, even = _estimates(2.0), _estimates(1.0)
    assert hot.keys() == even.keys() and len(hot) > 20
    errors = [estimate / simulated - 1 for estimate, simulated, _ in hot.values()]
    assert statistics.median(map(abs, errors)) < 0.01 and max(map(abs, errors)) < 0.05
    assert all(hot[c][1] > even[c][1] and hot[c][2] > even[c][2] for c in hot)  # slower, and more rows kept


def test_the_search_says_the_expert_load_in_its_header_its_commands_and_its_json(tmp_path, capsys):
    path = tmp_path / "moe.yaml"
    path.write_text(json.dumps({**MOE_SPEC, "num_layers": 2, "seq_len": 1024}))
    args = ["search", "--model", str(path), "--gpus", "16", "--global-batch", "32", "--ep", "16",
            "--expert-load", "1.5", "--top", "1", "--simulate", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "busiest expert 1.5x the mean" in out.splitlines()[0] and " --expert-load 1.5" in out
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["expert_load"] == 1.5


@pytest.mark.parametrize("args, message", [
    (["--model", "llama3-8b", "--expert-load", "1.5"], "--expert-load: llama3-8b is a dense model"),
    (["--model", "mixtral-8x22b", "--expert-load", "0.5"], "--expert-load 0.5 is below 1: it is the busiest expert's"),
    (["--model", "mixtral-8x22b", "--expert-load", "nan"], "--expert-load nan is below 1"),
    (["--model", "mixtral-8x22b", "--expert-load", "5"], "--expert-load 5 is more than all tokens on one expert"),
])
def test_an_expert_load_that_cannot_apply_is_refused_in_one_line(args, message, capsys):
    assert main(["search", *args, "--gpus", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err
