"""``parsim search --dispatch-fp8``: every plan with expert parallelism sends its tokens to their experts in fp8
(``dispatch_fp8``, as DeepSeek-V3 does), priced by the fast tier as the simulator prices it."""

from __future__ import annotations

import json
import statistics

import pytest
from small_moe_search import MOE_SPEC, both_tiers

from parsim.cli.main import main
from parsim.search.space import Candidate


def _estimates(dispatch_fp8: bool) -> dict[Candidate, tuple[float, float]]:
    """Every non-FSDP plan of a small fp8 MoE on 16 H100s: (fast tier's step, simulated step) by candidate."""
    space, plans = both_tiers(dtype="fp8", dispatch_fp8=dispatch_fp8)
    out = {}
    for candidate, (estimate, plan, simulated) in plans.items():
        assert plan.dispatch_fp8 == dispatch_fp8
        assert (candidate.mapping(space).get("moe") or {}).get("dispatch_fp8", False) == dispatch_fp8
        out[candidate] = (estimate.step_s, simulated)
    return out


def test_the_fast_tier_prices_fp8_dispatch_as_the_simulator_does_and_it_saves_time():
    fp8, plain = _estimates(True), _estimates(False)
    assert fp8.keys() == plain.keys() and len(fp8) > 20
    errors = [estimate / simulated - 1 for estimate, simulated in fp8.values()]
    assert statistics.median(map(abs, errors)) < 0.01 and max(map(abs, errors)) < 0.05
    # half the bytes of the dispatch and the combine's gradient: no plan slower, some faster in the simulation
    assert all(fp8[c][1] <= plain[c][1] * (1 + 1e-9) for c in fp8)
    assert sum(fp8[c][1] < plain[c][1] * 0.999 for c in fp8) >= len(fp8) // 2


def test_the_search_says_fp8_dispatch_in_its_header_its_commands_and_its_json(tmp_path, capsys):
    path = tmp_path / "moe.yaml"
    path.write_text(json.dumps({**MOE_SPEC, "num_layers": 2, "seq_len": 1024}))
    args = ["search", "--model", str(path), "--gpus", "16", "--global-batch", "32", "--ep", "16", "--dtype", "fp8",
            "--dispatch-fp8", "--top", "1", "--simulate", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "tokens dispatched in fp8" in out.splitlines()[0]
    assert " --ep 16 " in out and " --dispatch-fp8" in out
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dispatch_fp8"] is True


@pytest.mark.parametrize("args, message", [
    (["--model", "llama3-8b", "--dtype", "fp8"], "--dispatch-fp8: llama3-8b is a dense model"),
    (["--model", "deepseek-v3", "--dtype", "bf16"], "--dispatch-fp8 sends the tokens fp8 GEMMs read in fp8"),
])
def test_fp8_dispatch_is_refused_in_one_line_where_it_cannot_apply(args, message, capsys):
    assert main(["search", *args, "--gpus", "64", "--dispatch-fp8"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
