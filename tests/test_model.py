"""Model descriptions: exact parameter counts, FLOPs and activations against hand computation, and loading errors."""

from __future__ import annotations

import pytest

from parsim.errors import ConfigError, ParsimError
from parsim.workload.model import MLPModel, TransformerModel, builtin_models, load_model, shard


# --------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("name, params", [
    ("llama3-8b", 8_030_261_248),
    ("llama3-70b", 70_553_706_496),
    ("llama3-405b", 405_853_388_800),
    ("course-mlp", 4 * 1024 * 1024),
])
def test_preset_parameter_counts_match_published_totals(name, params):
    assert load_model(name).num_params == params


def test_gpt3_parameters_follow_the_12_h_squared_formula():
    L, h, V, s = 96, 12288, 50257, 2048
    # Q K V O, fc1 fc2, two norm gains, and the biases: QKV 3h, output h, fc1 4h, fc2 h
    per_layer = 4 * h * h + 2 * h * 4 * h + 2 * h + 9 * h
    expected = L * per_layer + V * h + s * h + h  # tied token table, learned positions, final norm
    model = load_model("gpt3-175b")
    assert model.params_per_layer == per_layer
    assert model.num_params == expected == 174_601_887_744


def test_llama3_8b_splits_into_layers_embedding_and_head():
    m = load_model("llama3-8b")
    h, kv, f, V = 4096, 8 * 128, 14336, 128256
    assert m.params_per_layer == 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h == 218_112_000
    assert m.embedding_params == V * h
    assert m.head_params == V * h + h  # untied head plus the final norm
    assert m.embedding_params + m.num_layers * m.params_per_layer + m.head_params == m.num_params


def test_tied_head_owns_no_weight_but_still_computes():
    gpt3 = load_model("gpt3-175b")
    head = gpt3.head_cost(2)
    assert head.num_params == gpt3.hidden  # only the final norm
    assert head.forward_flops_per_token() == 2 * gpt3.hidden * gpt3.vocab_size


# --------------------------------------------------------------------------- FLOPs
def test_mlp_flops_are_two_per_multiply_add_and_three_times_forward():
    m = load_model("course-mlp")
    forward = 4 * 2 * 1024 * 1024
    assert m.forward_flops_per_token() == forward
    assert m.backward_flops_per_token() == (forward, forward)
    assert m.training_flops_per_token() == 3 * forward
    assert m.model_flops_per_token() == 6 * m.num_params


def test_llama3_8b_forward_flops_by_hand():
    L, h, kv, f, V, s = 32, 4096, 1024, 14336, 128256, 8192
    matmuls = L * (2 * h * h + 2 * h * kv + 3 * h * f) + h * V
    attention = L * 4 * s * h  # QK^T and AV over the full sequence, no causal halving
    m = load_model("llama3-8b")
    assert m.forward_flops_per_token() == 2 * matmuls + attention
    assert m.training_flops_per_token() == 3 * (2 * matmuls + attention)


def test_backward_splits_into_input_and_weight_gradients_for_zero_bubble():
    m = load_model("llama3-8b")
    layer = m.layer_costs(2)[0]
    matmul = sum(mm.flops_per_token() for mm in layer.matmuls)
    attention = 4 * m.seq_len * m.hidden
    assert layer.backward_weight_flops_per_token() == matmul
    assert layer.backward_input_flops_per_token() == matmul + 2 * attention
    dgrad, wgrad = m.backward_flops_per_token()
    assert dgrad + wgrad == 2 * m.forward_flops_per_token()


def test_gpt3_model_flops_match_narayanan_without_recomputation():
    layers, h, s, V = 96, 12288, 2048, 50257
    # 72·l·h²·(1 + s/6h + V/12lh) per token, expanded to stay in integers
    narayanan = 72 * layers * h * h + 12 * layers * s * h + 6 * h * V
    m = load_model("gpt3-175b")
    assert m.model_flops_per_token() == narayanan
    assert m.model_flops_per_token() == m.training_flops_per_token()


@pytest.mark.parametrize("name", sorted(builtin_models()))
def test_model_flops_equal_training_flops_for_every_preset(name):
    m = load_model(name)
    assert m.model_flops_per_token() == m.training_flops_per_token() == 3 * m.forward_flops_per_token()


# --------------------------------------------------------------------------- activations and TP
def test_gpt3_layer_saves_korthikanti_34h_less_dropout_masks():
    m = load_model("gpt3-175b")
    layer = m.layer_costs(2)[0]
    h = m.hidden
    assert layer.activation_bytes_per_token() == 32 * h
    for t in (2, 4, 8):  # Korthikanti et al.: 10 + 24/t, of which 2 are dropout masks
        assert layer.activation_bytes_per_token(t) == 8 * h + 24 * h // t


def test_swiglu_layer_saves_three_ffn_intermediates():
    m = load_model("llama3-8b")
    h, q, kv, f, d = 4096, 4096, 1024, 14336, 2
    expected = (4 * h + 2 * q + 2 * kv + 3 * f) * d
    assert m.layer_costs(d)[0].activation_bytes_per_token() == expected


def test_mlp_layer_saves_input_and_pre_activation():
    layer = load_model("course-mlp").layer_costs(4)[0]
    assert layer.activation_bytes_per_token() == 2 * 1024 * 4
    assert layer.activation_bytes_per_token(4) == 1024 * 4 + 256 * 4  # the gathered input is whole


def test_megatron_layer_has_two_all_reduces_each_way():
    m = load_model("llama3-8b")
    layer = m.layer_costs(2)[0]
    for phase, names in (("forward", ["attn.out", "mlp.out"]), ("backward", ["mlp.in.grad", "attn.in.grad"])):
        ops = layer.collectives(phase)
        assert [c.name for c in ops] == names
        assert all(c.op == "all_reduce" and c.bytes_per_token == 4096 * 2 for c in ops)


def test_course_tp_all_gathers_forward_and_reduce_scatters_backward():
    layer = load_model("course-mlp").layer_costs(4)[0]
    (fwd,), (bwd,) = layer.collectives("forward"), layer.collectives("backward")
    assert (fwd.op, fwd.position, fwd.bytes_per_token) == ("all_gather", "after", 1024 * 4)
    assert (bwd.op, bwd.position, bwd.bytes_per_token) == ("reduce_scatter", "before", 1024 * 4)
    assert layer.matmuls[0].shape_per_rank(4) == (1024, 256)


def test_tp_shards_matmuls_and_replicates_norms():
    m = load_model("llama3-70b")
    layer = m.layer_costs(2)[0]
    norms = 2 * m.hidden
    assert 8 * layer.params_per_rank(8) == m.params_per_layer - norms + 8 * norms
    assert layer.forward_flops_per_token(8) * 8 == layer.forward_flops_per_token()


def test_kv_heads_replicate_when_tp_exceeds_them():
    m = load_model("tiny-gpt")  # 4 heads of 16, 2 kv heads
    k = next(mm for mm in m.layer_costs(4)[0].matmuls if mm.name == "attn.k")
    assert k.shape_per_rank(2) == (64, 16)  # one kv head each
    assert k.shape_per_rank(4) == (64, 16)  # still one whole head, on two ranks each


def test_vocab_is_padded_when_tp_does_not_divide_it():
    head = load_model("gpt3-175b").head_cost(2)
    assert head.matmuls[0].shape_per_rank(8) == (12288, 6283)  # ceil(50257 / 8)
    assert shard(50257, 8) == 6283


def test_embedding_and_head_only_for_transformers():
    mlp = load_model("course-mlp")
    assert mlp.embedding_cost(4) is None and mlp.head_cost(4) is None
    names = [c.name for c in load_model("tiny-gpt").costs(4)]
    assert names == ["embedding", "layer.0", "layer.1", "layer.2", "layer.3", "head"]


def test_unsupported_tp_style_is_refused():
    with pytest.raises(ParsimError, match="supports tensor_parallel allgather, not 'megatron'"):
        load_model("course-mlp").layer_costs(4, "megatron")


# --------------------------------------------------------------------------- loading
def test_inline_mapping_and_round_trip():
    m = load_model({"kind": "mlp", "num_layers": 2, "width": 8, "batch_size": 4})
    assert isinstance(m, MLPModel) and m.num_params == 128
    for name in builtin_models():
        model = load_model(name)
        assert load_model(model.to_dict()) == model


def test_kv_heads_default_to_heads():
    m = load_model({"kind": "transformer", "num_layers": 1, "hidden": 8, "num_heads": 2, "ffn_hidden": 16,
                    "seq_len": 4, "vocab_size": 10})
    assert isinstance(m, TransformerModel) and m.num_kv_heads == 2


def test_model_file_by_path(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text("kind: mlp\nnum_layers: 3\nwidth: 16\nbatch_size: 8\n")
    model = load_model(str(path))
    assert model.name == "small" and model.num_params == 3 * 256


def test_unknown_model_name_lists_presets():
    with pytest.raises(ParsimError, match="unknown model 'llama9'.*llama3-8b"):
        load_model("llama9")


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("kind: mlp\nnum_layers: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: \(file\): malformed YAML at line \d"):
        load_model(str(path))


@pytest.mark.parametrize("data, message", [
    ({"kind": "mlp", "num_layers": 2, "width": 8, "batch_size": 4, "depth": 3},
     "<model>: depth: unknown key (expected one of name, kind, description, dtype, num_layers"),
    # a transformer's keys would not fit on a line: the closest, and the first of them
    ({"kind": "transformer", "num_layerz": 2}, "<model>: num_layerz: unknown key (expected one of "),
    ({"kind": "transformer", "num_layerz": 2}, " keys, the closest num_layers or "),
    ({"kind": "mlp", "num_layers": "four", "width": 8, "batch_size": 4},
     "<model>: num_layers: is 'four' (expected a whole number)"),
    ({"kind": "mlp", "num_layers": 0, "width": 8, "batch_size": 4},
     "num_layers: is 0 (expected a whole number from 1 to 16,384)"),
    ({"kind": "mlp", "num_layers": 2, "batch_size": 4}, "<model>: width: missing"),
    ({"kind": "cnn"}, "<model>: kind: is 'cnn' (expected mlp or transformer)"),
    ({"num_layers": 2}, "<model>: kind: missing"),
    ({"kind": "transformer", "num_layers": 1, "hidden": 8, "num_heads": 4, "num_kv_heads": 3,
      "ffn_hidden": 16, "seq_len": 4, "vocab_size": 10}, "num_kv_heads: 3 does not divide num_heads 4"),
    ({"kind": "transformer", "num_layers": 1, "hidden": 10, "num_heads": 4, "ffn_hidden": 16,
      "seq_len": 4, "vocab_size": 10}, "num_heads: 4 does not divide hidden 10"),
    ({"kind": "transformer", "num_layers": 1, "hidden": 8, "num_heads": 2, "ffn_hidden": 16,
      "seq_len": 4, "vocab_size": 10, "ffn_type": "relu"}, "ffn_type: is 'relu' (expected swiglu or gelu)"),
    ({"kind": "transformer", "num_layers": 1, "hidden": 8, "num_heads": 2, "ffn_hidden": 16,
      "seq_len": 4, "vocab_size": 10, "tied_embeddings": "yes"}, "tied_embeddings: is 'yes' (expected true or false)"),
])
def test_each_model_problem_is_one_config_error_line(data, message):
    with pytest.raises(ConfigError) as err:
        load_model(data)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_file_errors_name_the_file(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("kind: mlp\nnum_layers: 2\nwidth: 8.5\nbatch_size: 4\n")
    with pytest.raises(ConfigError, match=r"m.yaml: width: is 8.5 \(expected a whole number\)"):
        load_model(path)


@pytest.mark.parametrize("name", ["course-mlp", "llama3-8b"])
def test_collective_ops_use_the_result_schema_names(name):
    from parsim.report.results import OPERATIONS

    for cost in load_model(name).costs(2):
        for phase in ("forward", "backward"):
            assert all(c.op in OPERATIONS for c in cost.collectives(phase))
