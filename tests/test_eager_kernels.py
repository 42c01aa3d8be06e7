"""``layer_kernels: eager`` and ``cross_entropy: torch`` count the bytes the executor's eager modules move.

Every ATen op the executor's layer and head dispatch is one kernel that reads its inputs and writes its
outputs; ``executor.compute_bench.count_traffic`` adds up those bytes (views move none), and the model's
memory-bound bytes per token must match them. Left out on both sides: the matmuls and the attention kernel,
which the model prices by their shapes and FLOPs. ``parsim calibrate`` counts its elementwise benchmark's
bytes the same way.
"""

from __future__ import annotations

import pytest

from parsim.cli.main import main
from parsim.workload.model import TransformerModel
from parsim.workload.plan import Plan

torch = pytest.importorskip("torch")

from executor.compute_bench import count_traffic  # noqa: E402
from executor.train.models import CrossEntropyLoss, DecoderLayer, Head  # noqa: E402

TOKENS = 128


def measured(fn, grad=None) -> tuple[float, float]:
    """Bytes per token of ``fn()``'s forward and of its backward, as :func:`count_traffic` counts them."""
    out, _, forward = count_traffic(fn)
    _, _, backward = count_traffic(lambda: out.backward(grad))
    return forward / TOKENS, backward / TOKENS


def modelled(plan: Plan, entry: str, skip: tuple[str, ...] = ()) -> tuple[int, int]:
    cost = next(c for c in plan.stage_costs(0) if c.name == entry)
    kernels = [e for block in cost.blocks for e in block.elementwise if e.name not in skip]
    return tuple(sum(e.bytes_per_token(backward, plan.dtype_bytes) for e in kernels) for backward in (False, True))


def model(**shape) -> TransformerModel:
    defaults = dict(name="eager", num_layers=1, hidden=512, num_heads=8, num_kv_heads=2, ffn_hidden=1536,
                    seq_len=TOKENS, vocab_size=4096, layer_kernels="eager", cross_entropy="torch")
    return TransformerModel(**{**defaults, **shape})


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("shape", [{}, {"num_kv_heads": 8, "ffn_type": "gelu", "position_embedding": "learned"}],
                         ids=["llama", "gpt"])
def test_an_eager_layer_moves_the_bytes_the_executors_layer_moves(dtype, shape):
    m = model(**shape)
    torch.manual_seed(0)
    layer = DecoderLayer(m).to(getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype]))
    x = torch.randn(1, TOKENS, m.hidden, dtype=layer.norm_attn.weight.dtype, requires_grad=True)
    forward, backward = measured(lambda: layer(x), torch.randn_like(x))
    # the attention kernel's own traffic is priced with it, beside its FLOPs
    expected = modelled(Plan(model=m, dp=1, dtype=dtype), "layer.0", skip=("attn.core",))
    assert expected == (pytest.approx(forward, rel=0.005), pytest.approx(backward, rel=0.005))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_eager_head_and_torchs_cross_entropy_move_the_bytes_the_executors_do(dtype):
    m = model()
    torch.manual_seed(0)
    head = Head(m).to(getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype]))
    x = torch.randn(1, TOKENS, m.hidden, dtype=head.norm.weight.dtype, requires_grad=True)
    targets = torch.randint(0, m.vocab_size, (1, TOKENS))
    forward, backward = measured(lambda: CrossEntropyLoss()(head(x), targets))
    expected = modelled(Plan(model=m, dp=1, dtype=dtype), "head")
    assert expected == (pytest.approx(forward, rel=0.005), pytest.approx(backward, rel=0.005))


def test_torchs_log_softmax_rereads_a_vocabulary_row_too_wide_for_shared_memory():
    """Past 12,288 fp32 entries (48 KiB) cunn_SoftMaxForward reads the row three times and its backward reads
    the gradient twice: 2 and 1 accesses more than the ops' own inputs and outputs."""
    narrow, wide = (modelled(Plan(model=model(vocab_size=v, cross_entropy="torch"), dp=1, dtype="bf16"), "head")
                    for v in (12288, 12289))
    grown = [b / 12289 - a / 12288 for a, b in zip(narrow, wide)]
    assert grown == [pytest.approx(2 * 4, abs=0.2), pytest.approx(1 * 4, abs=0.2)]


def test_eager_kernels_move_more_than_fused_ones_and_leave_the_matmuls():
    fused, eager = model(layer_kernels="fused", cross_entropy="fused"), model()
    for entry in ("layer.0", "head"):
        plain, slow = (modelled(Plan(model=m, dp=1, dtype="bf16"), entry) for m in (fused, eager))
        assert slow[0] > plain[0] and slow[1] > plain[1]
    layers = [next(c for c in Plan(model=m, dp=1, dtype="bf16").stage_costs(0) if c.name == "layer.0")
              for m in (fused, eager)]
    assert [b.matmuls for b in layers[0].blocks] == [b.matmuls for b in layers[1].blocks]


@pytest.mark.parametrize("extra, expected", [("layer_kernels: compiled", "fused or eager"),
                                             ("layer_kernels: eager, attention: mla", "grouped-query flash")])
def test_layer_kernels_that_are_not_modelled_are_refused_in_one_line(tmp_path, capsys, extra, expected):
    plan = tmp_path / "p.yaml"
    plan.write_text("model: {kind: transformer, num_layers: 2, hidden: 256, num_heads: 4, ffn_hidden: 1024,"
                    f" seq_len: 128, vocab_size: 1000, {extra}}}\nparallel: {{dp: 8}}\n")
    assert main(["simulate", str(plan), "--cluster", "dgx-h100"]) == 2
    err = capsys.readouterr().err.strip()
    assert "layer_kernels" in err and expected in err and len(err.splitlines()) == 1
