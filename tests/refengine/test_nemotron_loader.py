"""Nemotron-H checkpoints: the released layout (``backbone.*``, per-expert tensors, which transformers'
``save_pretrained`` writes too), ``model.*`` names with stacked experts, single file and sharded; one
clear error naming a bad pattern letter, a bad head/group split, or a missing or misshapen tensor."""

from __future__ import annotations

import json
import re

import pytest
import torch

from refengine.model import CheckpointError, load_model
from tests.helpers.checkpoints import read_tensors, reshard, write_variant

MOE = "nemotron-moe"  # pattern "M*MEME", written with the legacy hybrid_override_pattern


def assert_same_model(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def config_of(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_released_layout_loads(tiny_nemotron):
    path = tiny_nemotron(MOE)
    names = read_tensors(path)
    assert all(n.startswith(("backbone.", "lm_head.")) for n in names)
    assert "backbone.layers.3.mixer.experts.0.up_proj.weight" in names
    model, cfg = load_model(path)
    assert cfg.pattern == "M*MEME" and model.mtp is None
    experts = model.model.layers[3].mixer.experts
    assert experts.up_proj.shape == (cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size)
    assert torch.equal(experts.up_proj[2], names["backbone.layers.3.mixer.experts.2.up_proj.weight"])
    assert torch.equal(model.model.layers[0].mixer.conv1d.weight,
                       names["backbone.layers.0.mixer.conv1d.weight"][:, 0, :])


def test_sharded_equals_single_file(tiny_nemotron, tmp_path):
    path = tiny_nemotron(MOE)
    sharded = reshard(path, tmp_path / "sharded", num_shards=3)
    assert_same_model(load_model(path)[0], load_model(sharded)[0])


def test_model_names_and_stacked_experts_load(tiny_nemotron, tmp_path):
    """transformers' in-memory names (``model.*``) and stacked experts, as its state_dict holds them."""
    path = tiny_nemotron(MOE)
    tensors, experts = {}, {}
    for name, t in read_tensors(path).items():
        name = re.sub(r"^backbone\.", "model.", name)
        m = re.match(r"^(.*\.experts\.)(\d+)\.(up_proj|down_proj)\.weight$", name)
        if m:
            experts.setdefault(m.group(1) + m.group(3), {})[int(m.group(2))] = t
        else:
            tensors[name] = t
    for name, parts in experts.items():
        tensors[name] = torch.stack([parts[e] for e in sorted(parts)])
    variant = write_variant(path, tmp_path / "stacked", tensors=tensors)
    assert_same_model(load_model(path)[0], load_model(variant)[0])


def test_router_stays_float32_in_bfloat16(tiny_nemotron):
    model, _ = load_model(tiny_nemotron(MOE), dtype=torch.bfloat16)
    gate = model.model.layers[3].mixer.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[3].mixer.experts.up_proj.dtype == torch.bfloat16


def variant_error(path, tmp_path, tensors=None, config=None) -> str:
    with pytest.raises(CheckpointError) as info:
        load_model(write_variant(path, tmp_path / "variant", tensors=tensors, config=config))
    return str(info.value)


def test_missing_tensor_is_named_as_in_the_file(tiny_nemotron, tmp_path):
    path = tiny_nemotron(MOE)
    tensors = read_tensors(path)
    del tensors["backbone.layers.0.mixer.D"]
    message = variant_error(path, tmp_path, tensors=tensors)
    assert message.startswith("missing tensor backbone.layers.0.mixer.D"), message


def test_missing_expert_is_named(tiny_nemotron, tmp_path):
    path = tiny_nemotron(MOE)
    tensors = read_tensors(path)
    del tensors["backbone.layers.5.mixer.experts.6.down_proj.weight"]
    message = variant_error(path, tmp_path, tensors=tensors)
    assert message.startswith("missing tensor backbone.layers.5.mixer.experts.6.down_proj.weight"), message


def test_misshapen_tensor_is_named(tiny_nemotron, tmp_path):
    path = tiny_nemotron(MOE)
    tensors = read_tensors(path)
    name = "backbone.layers.2.mixer.in_proj.weight"
    tensors[name] = tensors[name][:-1]
    message = variant_error(path, tmp_path, tensors=tensors)
    expected = rf"tensor {re.escape(name)} has shape \[\d+, 64\], expected \[\d+, 64\]$"
    assert re.match(expected, message), message


def test_unexpected_tensor_is_named(tiny_nemotron, tmp_path):
    path = tiny_nemotron("nemotron-dense")
    tensors = read_tensors(path) | {"backbone.layers.9.norm.weight": torch.ones(64)}
    message = variant_error(path, tmp_path, tensors=tensors)
    assert message.startswith("unexpected tensor backbone.layers.9.norm.weight"), message
    assert "layer pattern is 'M*M-'" in message


def test_bad_pattern_letter_is_named(tiny_nemotron, tmp_path):
    path = tiny_nemotron(MOE)
    config = config_of(path)
    config["hybrid_override_pattern"] = "M*MXME"
    config.pop("layers_block_type", None)
    message = variant_error(path, tmp_path, config=config)
    assert "hybrid_override_pattern: unknown letter 'X' at layer 3 of 'M*MXME'" in message, message


def test_bad_block_type_is_named(tiny_nemotron, tmp_path):
    path = tiny_nemotron("nemotron-dense")
    config = config_of(path)
    config["layers_block_type"] = ["linear_attention", "full_attention", "dense", "mlp"]
    message = variant_error(path, tmp_path, config=config)
    assert "layers_block_type: unknown block type 'dense' at layer 2" in message, message


def test_heads_not_divisible_by_groups_is_named(tiny_nemotron, tmp_path):
    path = tiny_nemotron("nemotron-dense")
    config = config_of(path) | {"mamba_num_heads": 6, "n_groups": 4}
    message = variant_error(path, tmp_path, config=config)
    assert "mamba_num_heads: 6 is not a multiple of n_groups 4" in message, message


# ---- config fields read as vLLM reads them ----------------------------------------------------------
def test_shared_expert_width_is_is_times_n_shared_experts(tiny_nemotron, tmp_path):
    """vLLM's shared expert is moe_shared_expert_intermediate_size x n_shared_experts wide (transformers
    ignores n_shared_experts): the same tensors under Is 24 x 2 are the model written with Is 48 x 1."""
    path = tiny_nemotron(MOE)
    assert config_of(path)["moe_shared_expert_intermediate_size"] == 48
    config = config_of(path) | {"moe_shared_expert_intermediate_size": 24, "n_shared_experts": 2}
    model, cfg = load_model(write_variant(path, tmp_path / "two-shared", config=config))
    assert cfg.shared_expert_intermediate_size == 48
    assert model.model.layers[3].mixer.shared_experts.up_proj.weight.shape == (48, 64)
    assert_same_model(load_model(path)[0], model)


def test_no_shared_expert_when_n_shared_experts_is_0(tiny_nemotron, tmp_path):
    """n_shared_experts 0: vLLM builds no shared expert, and a checkpoint holds none."""
    path = tiny_nemotron(MOE)
    tensors = {n: t for n, t in read_tensors(path).items() if ".shared_experts." not in n}
    config = config_of(path) | {"n_shared_experts": 0}
    model, _ = load_model(write_variant(path, tmp_path / "no-shared", tensors=tensors, config=config))
    routed_only = load_model(path)[0].model.layers[3].mixer
    routed_only.shared_experts = None
    moe = model.model.layers[3].mixer
    assert moe.shared_experts is None
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(moe(x), routed_only(x))


def test_negative_n_shared_experts_is_named(tiny_nemotron, tmp_path):
    path = tiny_nemotron(MOE)
    message = variant_error(path, tmp_path, config=config_of(path) | {"n_shared_experts": -1})
    assert "n_shared_experts: must be an integer >= 0, got -1" in message, message
