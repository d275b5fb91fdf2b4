"""Nemotron-H's MTP head: made by ``add-mtp-head``, loaded from mtp.* tensors, drafting in both engines."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from refengine import LLM, SamplingParams
from refengine.model.loader import CheckpointError, load_model
from refengine.tools.mtp_head import HEAD_FILE, add_mtp_head, weight_map
from tests.helpers.checkpoints import read_tensors, write_variant
from tests.refengine.test_nemotron_loader import assert_same_model


@pytest.fixture(scope="module")
def with_head(tiny_nemotron, tmp_path_factory):
    dst = tmp_path_factory.mktemp("nemotron-mtp") / "ckpt"
    origin = add_mtp_head(tiny_nemotron("nemotron-dense"), dst)
    return dst, origin


def test_head_is_named_as_vllm_loads_it(with_head):
    dst, origin = with_head
    names = {n for n in weight_map(dst) if n.startswith("mtp.")}
    for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "norm.weight", "mixer.q_proj.weight"):
        assert f"mtp.layers.0.{part}" in names
    for part in ("norm.weight", "mixer.gate.weight", "mixer.experts.0.up_proj.weight",
                 "final_layernorm.weight"):
        assert f"mtp.layers.1.{part}" in names
    assert origin["mtp.layers.0.mixer.q_proj.weight"] == "backbone.layers.1.mixer.q_proj.weight"
    model, cfg = load_model(dst)
    assert cfg.num_mtp_layers == 1 and cfg.mtp_block_kinds == ["attention", "moe"]
    assert model.mtp.layers[0].eh_proj.weight.shape == (64, 128)


def test_head_fuses_embedding_then_hidden(with_head):
    """eh_proj reads [enorm(embedding) | hnorm(hidden)]: with add-mtp-head's [0 | I] the next token
    cannot change the head's output, and the hidden state must."""
    from refengine.forward_context import AttnMetadata

    model, _ = load_model(with_head[0])

    def run(token: int, hidden: torch.Tensor) -> torch.Tensor:
        kv = (torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16))  # [blocks, block_size, Hkv, D]
        attn = AttnMetadata(query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                            seq_lens=torch.tensor([1], dtype=torch.int32),
                            block_table=torch.tensor([[0]], dtype=torch.int32),
                            slot_mapping=torch.tensor([0], dtype=torch.int64))
        return model.mtp(torch.tensor([token]), hidden, torch.tensor([0]), attn, kv)

    hidden = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(run(5, hidden), run(77, hidden))
    assert not torch.equal(run(5, hidden), run(5, hidden * 2 + 1))


def test_mtp_drafts_are_lossless_in_both_engines(with_head, tiny_nemotron):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    plain = LLM(model=str(tiny_nemotron("nemotron-dense")), engine="reference").generate(prompts, params)
    for engine in ("reference", "async"):
        llm = LLM(model=str(with_head[0]), engine=engine, num_speculative_tokens=3, drafter="mtp")
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], engine


def test_partial_head_is_refused_by_name(tiny_nemotron, tmp_path):
    path = tiny_nemotron("nemotron-dense")
    tensors = read_tensors(path) | {"mtp.layers.0.norm.weight": torch.ones(64)}
    with pytest.raises(CheckpointError, match="mtp.layers.0.eh_proj.weight"):
        load_model(write_variant(path, tmp_path / "mtp", tensors=tensors))


def test_add_mtp_head_refuses_a_checkpoint_with_a_head(with_head, tmp_path):
    with pytest.raises(CheckpointError, match="already has an MTP head"):
        add_mtp_head(with_head[0], tmp_path / "again")


def test_cli_adds_a_head_to_a_nemotron_checkpoint(tiny_nemotron, tmp_path, capsys):
    from refengine.tools.cli import main

    assert main(["add-mtp-head", str(tiny_nemotron("nemotron-dense")), str(tmp_path / "out")]) == 0
    assert "initialised from the model's own layers (backbone.layers.1)" in capsys.readouterr().out
    assert load_model(tmp_path / "out")[0].mtp is not None


# ---- what vLLM loads, loads; what it refuses, is refused ---------------------------------------------
def copy_with(src, dst, config: dict | None = None, tensors: dict[str, torch.Tensor] | None = None):
    """A copy of checkpoint folder ``src`` with config.json fields set and tensors added (a shard of
    their own, in the index)."""
    shutil.copytree(src, dst)
    if config:
        (dst / "config.json").write_text(json.dumps(json.loads((dst / "config.json").read_text()) | config))
    if tensors:
        save_file(tensors, str(dst / "extra.safetensors"), metadata={"format": "pt"})
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        index["weight_map"].update(dict.fromkeys(tensors, "extra.safetensors"))
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def test_the_step_count_is_recorded_where_vllm_reads_it(with_head):
    _, cfg = load_model(with_head[0])
    assert cfg.num_nextn_predict_layers == 1


@pytest.mark.parametrize("count", [2, -1])
def test_a_head_under_another_step_count_is_refused_naming_it(with_head, tmp_path, count):
    """vLLM builds its Nemotron-H MTP head only for num_nextn_predict_layers 1 and refuses other counts."""
    variant = copy_with(with_head[0], tmp_path / "count", config={"num_nextn_predict_layers": count})
    with pytest.raises(CheckpointError, match=rf"num_nextn_predict_layers: {count} MTP layers"):
        load_model(variant)


def test_a_step_count_without_a_head_loads(tiny_nemotron, tmp_path):
    """No mtp.* tensors, no head: the model loads whatever the count says (as vLLM loads its target)."""
    variant = copy_with(tiny_nemotron("nemotron-dense"), tmp_path / "count",
                        config={"num_nextn_predict_layers": 2})
    assert load_model(variant)[0].mtp is None


def test_mtp_tensors_vllm_skips_are_skipped(with_head, tmp_path):
    """mtp.* tensors no parameter of the head loads (vLLM's MTP loader skips them): a rotary table, a
    layer past the step's two blocks, the fusion on the second block, an expert id past n_routed_experts."""
    extras = {
        "mtp.layers.0.mixer.rotary_emb.inv_freq": torch.ones(8),
        "mtp.layers.2.norm.weight": torch.ones(64),
        "mtp.layers.1.enorm.weight": torch.ones(64),
        "mtp.layers.1.mixer.experts.8.up_proj.weight": torch.ones(32, 64),
    }
    model, cfg = load_model(copy_with(with_head[0], tmp_path / "extras", tensors=extras))
    assert cfg.num_mtp_layers == 1
    assert_same_model(load_model(with_head[0])[0], model)


def test_a_misshapen_head_tensor_is_still_refused(with_head, tmp_path):
    variant = copy_with(with_head[0], tmp_path / "bad")
    head = load_file(variant / HEAD_FILE)
    head["mtp.layers.0.eh_proj.weight"] = torch.ones(64, 64)
    save_file(head, str(variant / HEAD_FILE), metadata={"format": "pt"})
    expected = r"tensor mtp.layers.0.eh_proj.weight has shape \[64, 64\], expected \[64, 128\]"
    with pytest.raises(CheckpointError, match=expected):
        load_model(variant)
