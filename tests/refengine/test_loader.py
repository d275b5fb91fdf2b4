"""Checkpoint loading: both GDN layouts, shards, tying, MTP, the Qwen3.5 wrapper, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from refengine.model import CheckpointError, load_model
from refengine.model.qwen3_next import Qwen3NextConfig
from refengine.model.qwen3_next.weights import merge_ba, merge_qkvz, split_ba, split_qkvz
from tests.helpers.checkpoints import (
    PRESETS,
    fuse_experts,
    get_spec,
    load_hf_model,
    read_tensors,
    reshard,
    write_variant,
)


def _state(model) -> dict[str, torch.Tensor]:
    return model.state_dict()


def _assert_same_state(a, b) -> None:
    sa, sb = _state(a), _state(b)
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_load_with_their_tensors(preset, tiny_checkpoint):
    path = tiny_checkpoint(preset)
    model, cfg = load_model(path)
    assert cfg.gdn_layout == ("split" if preset.startswith("qwen35") else "qkvz")
    spec = get_spec(preset)
    assert (model.mtp is not None, cfg.num_mtp_layers) == ((True, 1) if spec.with_mtp else (False, 0))
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)] == [
        spec.is_moe_layer(i) for i in range(len(spec.layer_types))]
    state = _state(model)
    for name, tensor in read_tensors(path).items():
        name = name.replace("model.language_model.", "model.", 1)
        if name in state:  # everything except the Qwen3-Next fused GDN projections and per-expert weights
            assert torch.equal(state[name].reshape(tensor.shape), tensor), name
    assert all(t.dtype == torch.float32 for t in state.values())


def test_load_casts_dtype(tiny_checkpoint):
    model, _ = load_model(tiny_checkpoint("next-tiny"), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_sharded_checkpoint_loads_identically(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("next-gqa4-untied")
    sharded = reshard(src, tmp_path / "sharded", num_shards=2)
    assert len(list(sharded.glob("*.safetensors"))) == 2
    _assert_same_state(load_model(src)[0], load_model(sharded)[0])


def _to_split_layout(tensors: dict[str, torch.Tensor], cfg: Qwen3NextConfig) -> dict[str, torch.Tensor]:
    """Qwen3-Next fused GDN projections -> Qwen3.5 split ones, by explicit row indices."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk
    group = 2 * dk + 2 * r * dv  # rows per key-head group: q (dk), k (dk), v (r*dv), z (r*dv)
    q_rows = [g * group + i for g in range(hk) for i in range(dk)]
    k_rows = [g * group + dk + i for g in range(hk) for i in range(dk)]
    v_rows = [g * group + 2 * dk + i for g in range(hk) for i in range(r * dv)]
    z_rows = [g * group + 2 * dk + r * dv + i for g in range(hk) for i in range(r * dv)]
    b_rows = [g * 2 * r + j for g in range(hk) for j in range(r)]
    a_rows = [g * 2 * r + r + j for g in range(hk) for j in range(r)]
    out = {}
    for name, t in tensors.items():
        if name.endswith("in_proj_qkvz.weight"):
            base = name[: -len("in_proj_qkvz.weight")]
            out[base + "in_proj_qkv.weight"] = t[q_rows + k_rows + v_rows].contiguous()
            out[base + "in_proj_z.weight"] = t[z_rows].contiguous()
        elif name.endswith("in_proj_ba.weight"):
            base = name[: -len("in_proj_ba.weight")]
            out[base + "in_proj_b.weight"] = t[b_rows].contiguous()
            out[base + "in_proj_a.weight"] = t[a_rows].contiguous()
        else:
            out[name] = t
    return out


def test_qwen3_next_layout_equals_qwen35_layout(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("next-odd-dims")  # r = Hv/Hk = 3, Dk != Dv
    next_model, cfg = load_model(src)
    config = json.loads((src / "config.json").read_text())
    for key in ("decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size", "norm_topk_prob",
                "num_experts", "num_experts_per_tok", "output_router_logits", "router_aux_loss_coef",
                "shared_expert_intermediate_size"):
        config.pop(key)
    config.update(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"])
    dst = write_variant(src, tmp_path / "split", _to_split_layout(read_tensors(src), cfg), config)
    split_model, split_cfg = load_model(dst)
    assert split_cfg.gdn_layout == "split"
    _assert_same_state(next_model, split_model)

    # The permutation itself is right: transformers gives the same logits for both layouts.
    ids = torch.tensor([[5, 17, 3, 101, 42, 7, 9]])
    with torch.no_grad():
        ref = load_hf_model(src)(ids).logits
        other = load_hf_model(dst)(ids).logits
    torch.testing.assert_close(other, ref, rtol=0, atol=1e-5)


def test_layout_helpers_round_trip(tiny_checkpoint):
    path = tiny_checkpoint("next-odd-dims")
    _, cfg = load_model(path)
    tensors = read_tensors(path)
    qkvz, ba = (
        tensors["model.layers.1.linear_attn.in_proj_qkvz.weight"],
        tensors["model.layers.1.linear_attn.in_proj_ba.weight"],
    )
    assert torch.equal(merge_qkvz(*split_qkvz(qkvz, cfg), cfg), qkvz)
    assert torch.equal(merge_ba(*split_ba(ba, cfg), cfg), ba)


def test_tied_and_untied_heads(tiny_checkpoint, tmp_path):
    tied_path = tiny_checkpoint("next-tiny")
    assert "lm_head.weight" not in read_tensors(tied_path)
    tied, cfg = load_model(tied_path)
    assert cfg.tie_word_embeddings and tied.lm_head.weight is tied.model.embed_tokens.weight

    untied_path = tiny_checkpoint("next-gqa4-untied")
    untied, cfg = load_model(untied_path)
    assert not cfg.tie_word_embeddings
    assert torch.equal(untied.lm_head.weight, read_tensors(untied_path)["lm_head.weight"])
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)

    # A tied checkpoint that still stores the head is accepted only when it is the embedding.
    tensors = read_tensors(tied_path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    load_model(write_variant(tied_path, tmp_path / "same", tensors))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_model(write_variant(tied_path, tmp_path / "different", tensors))


def test_checkpoint_without_mtp_has_no_mtp_head(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen35-tiny")
    tensors = {k: v for k, v in read_tensors(src).items() if not k.startswith("mtp.")}
    model, cfg = load_model(write_variant(src, tmp_path / "no_mtp", tensors))
    assert model.mtp is None and cfg.num_mtp_layers == 0
    assert not any(name.startswith("mtp.") for name in _state(model))


def test_qwen35_multimodal_wrapper_layout(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen35-tiny")
    text = json.loads((src / "config.json").read_text())
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "tie_word_embeddings": text["tie_word_embeddings"], "text_config": text,
              "vision_config": {"depth": 1}}
    tensors = {}
    for name, t in read_tensors(src).items():
        tensors[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    wrapped, cfg = load_model(write_variant(src, tmp_path / "wrapped", tensors, config))
    assert cfg.model_type == "qwen3_5" and cfg.gdn_layout == "split"
    _assert_same_state(load_model(src)[0], wrapped)


# ---- errors ---------------------------------------------------------------------------------------


def _edit(src, dst, drop=(), add=None):
    tensors = {k: v for k, v in read_tensors(src).items() if k not in drop}
    tensors.update(add or {})
    return write_variant(src, dst, tensors)


@pytest.mark.parametrize(
    "drop, add, expected",
    [
        (
            ["model.layers.1.self_attn.k_norm.weight"],
            None,
            "missing tensor model.layers.1.self_attn.k_norm.weight",
        ),
        (
            ["model.layers.0.linear_attn.in_proj_ba.weight"],
            None,
            "missing tensor model.layers.0.linear_attn.in_proj_ba",
        ),
        (["mtp.fc.weight"], None, "missing tensor mtp.fc.weight"),
        (
            [],
            {"model.layers.0.mlp.extra.weight": torch.zeros(2)},
            "unexpected tensor model.layers.0.mlp.extra.weight",
        ),
        (
            [],
            {"model.layers.0.linear_attn.in_proj_qkv.weight": torch.zeros(128, 64)},
            "unexpected tensor model.layers.0.linear_attn.in_proj_qkv.weight",
        ),
        (
            [],
            {"model.layers.0.mlp.up_proj.weight": torch.zeros(127, 64)},
            r"tensor model.layers.0.mlp.up_proj.weight has shape \[127, 64\], expected \[128, 64\]",
        ),
        (
            [],
            {"model.layers.2.linear_attn.conv1d.weight": torch.zeros(128, 1, 3)},
            "tensor model.layers.2.linear_attn.conv1d.weight has shape",
        ),
    ],
    ids=[
        "missing",
        "missing-gdn",
        "missing-mtp",
        "unexpected",
        "wrong-layout",
        "misshaped",
        "misshaped-conv",
    ],
)
def test_bad_tensors_are_named(drop, add, expected, tiny_checkpoint, tmp_path):
    path = _edit(tiny_checkpoint("next-tiny"), tmp_path / "bad", drop, add)
    with pytest.raises(CheckpointError, match=expected):
        load_model(path)


def _wrap(src, dst, drop=(), add=None):
    """``src`` (a Qwen3.5 text checkpoint) inside the multimodal wrapper, tensors dropped / added by wrapped
    name."""
    text = json.loads((src / "config.json").read_text())
    config = {
        "model_type": "qwen3_5",
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
    }
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in read_tensors(src).items()}
    tensors = {k: v for k, v in tensors.items() if k not in drop}
    return write_variant(src, dst, {**tensors, **(add or {})}, config)


@pytest.mark.parametrize(
    "drop, add, expected",
    [
        (
            ["model.language_model.layers.1.self_attn.k_norm.weight"],
            None,
            r"^missing tensor model\.language_model\.layers\.1\.self_attn\.k_norm\.weight$",
        ),
        (
            [],
            {"model.language_model.layers.0.mlp.extra.weight": torch.zeros(2)},
            r"^unexpected tensor model\.language_model\.layers\.0\.mlp\.extra\.weight$",
        ),
        (
            [],
            {"model.language_model.layers.0.mlp.up_proj.weight": torch.zeros(127, 64)},
            (r"^tensor model\.language_model\.layers\.0\.mlp\.up_proj\.weight has shape \[127, 64\], "
             r"expected \[128, 64\]$"),
        ),
        (
            [],
            {"model.language_model.norm.weight": torch.zeros(64, dtype=torch.int32)},
            r"^tensor model\.language_model\.norm\.weight has dtype torch\.int32, expected a float type$",
        ),
        (["mtp.fc.weight"], None, r"^missing tensor mtp\.fc\.weight$"),
    ],
    ids=["missing", "unexpected", "misshaped", "not-float", "missing-unwrapped"],
)
def test_a_wrapped_checkpoints_tensors_are_named_as_in_its_file(
    drop, add, expected, tiny_checkpoint, tmp_path
):
    path = _wrap(tiny_checkpoint("qwen35-tiny"), tmp_path / "wrapped", drop, add)
    with pytest.raises(CheckpointError, match=expected):
        load_model(path)


def test_absent_layer_types_are_named_when_the_tensors_disagree(tiny_checkpoint, tmp_path):
    """Without layer_types transformers derives them from full_attention_interval (default 4: layers
    0-2 linear); next-tiny's layer 1 is full attention, so its tensors do not match."""
    src = tiny_checkpoint("next-tiny")
    config = json.loads((src / "config.json").read_text())
    del config["layer_types"]
    path = write_variant(src, tmp_path / "no_layer_types", None, config)
    with pytest.raises(
        CheckpointError,
        match=(
            r"^missing tensor model\.layers\.1\.linear_attn\.\S+ \(and \d+ more: .*\); config\.json has no "
            r"layer_types, so transformers derived them from full_attention_interval "
            r"\(linear_attention for layer 1\), "
            r"but the tensors make layer 1 full_attention: add layer_types to config\.json$"
        ),
    ):
        load_model(path)
    # Stated layer_types that disagree with the tensors: the plain error, no word about deriving them.
    stated = write_variant(
        src, tmp_path / "stated", None, {**config, "layer_types": ["linear_attention"] * 4}
    )
    with pytest.raises(CheckpointError, match=r"^missing tensor model\.layers\.1\.linear_attn\.[^;]*$"):
        load_model(stated)
    # Derived layer types that match the tensors load.
    _, cfg = load_model(
        write_variant(src, tmp_path / "interval2", None, {**config, "full_attention_interval": 2})
    )
    assert cfg.layer_types == ["linear_attention", "full_attention"] * 2


def test_absent_layer_types_in_a_wrapped_config_are_named(tiny_checkpoint, tmp_path):
    path = _wrap(tiny_checkpoint("qwen35-tiny"), tmp_path / "wrapped")
    config = json.loads((path / "config.json").read_text())
    del config["text_config"]["layer_types"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=r"^missing tensor model\.language_model\.layers\.1\.linear_attn\."
        r".*config\.json has no layer_types",
    ):
        load_model(path)


def test_conv_weight_without_middle_axis_loads(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("next-tiny")
    name = "model.layers.0.linear_attn.conv1d.weight"
    conv = read_tensors(src)[name]
    model, _ = load_model(_edit(src, tmp_path / "conv2d", add={name: conv[:, 0, :].clone()}))
    assert torch.equal(model.model.layers[0].linear_attn.conv1d.weight, conv[:, 0, :])


def test_file_errors(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("next-tiny")
    with pytest.raises(CheckpointError, match=f"^checkpoint folder {tmp_path / 'nowhere'} does not exist$"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(CheckpointError, match=f"^checkpoint path {tmp_path / 'a_file'} is not a folder"):
        load_model(tmp_path / "a_file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=f"^missing config.json in {tmp_path / 'empty'}$"):
        load_model(tmp_path / "empty")

    bad_json = write_variant(src, tmp_path / "bad_json")
    (bad_json / "config.json").write_text('{"model_type": "qwen3_next", ')
    with pytest.raises(CheckpointError, match="invalid JSON in .*config.json"):
        load_model(bad_json)

    bad_cfg = write_variant(src, tmp_path / "bad_cfg")
    cfg = json.loads((src / "config.json").read_text())
    (bad_cfg / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 3}))
    with pytest.raises(CheckpointError, match="num_attention_heads"):
        load_model(bad_cfg)

    sharded = reshard(src, tmp_path / "sharded", num_shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing shard file model-00002-of-00002.safetensors"):
        load_model(sharded)

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((src / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="only safetensors .*pytorch_model.bin"):
        load_model(pickled)


# ---- Qwen3NextConfig ------------------------------------------------------------------------------------


def _base_config(tiny_checkpoint) -> dict:
    return json.loads((tiny_checkpoint("next-tiny") / "config.json").read_text())


@pytest.mark.parametrize(
    "change, field",
    [
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"num_key_value_heads": 3}, "num_attention_heads"),
        ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
        (
            {"layer_types": ["linear_attention", "sliding", "linear_attention", "full_attention"]},
            "layer_types",
        ),
        ({"hidden_size": 0}, "hidden_size"),
        ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
        ({"model_type": "llama"}, "model_type"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}},
            "partial_rotary_factor",
        ),
        ({"eos_token_id": 999}, "eos_token_ids"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_config_validation_names_the_field(change, field, tiny_checkpoint):
    with pytest.raises(ValueError, match=field):
        Qwen3NextConfig.from_hf_config({**_base_config(tiny_checkpoint), **change})


def test_config_moe_fields_and_layer_rule(tiny_checkpoint):
    cfg = Qwen3NextConfig.from_hf_config(
        {
            **_base_config(tiny_checkpoint),
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mlp_only_layers": [0],
            "decoder_sparse_step": 1,
            "norm_topk_prob": False,
        }
    )
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (4, 2, False)
    # transformers' defaults fill what config.json leaves out.
    assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (512, 512)
    step2 = Qwen3NextConfig.from_hf_config(
        {
            **_base_config(tiny_checkpoint),
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mlp_only_layers": [],
            "decoder_sparse_step": 2,
        }
    )
    assert [step2.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Qwen3NextConfig.from_hf_config(
            {
                **_base_config(tiny_checkpoint),
                "num_experts": 4,
                "num_experts_per_tok": 5,
                "mlp_only_layers": [],
            }
        )
    # Qwen3.5-MoE: every layer sparse, always renormalised, no dense width needed; wrapped text_config.
    wrapped = Qwen3NextConfig.from_hf_config(
        {"model_type": "qwen3_5_moe", "text_config": {"num_hidden_layers": 2}}
    )
    assert wrapped.model_type == "qwen3_5_moe" and wrapped.gdn_layout == "split"
    assert wrapped.norm_topk_prob and all(wrapped.is_moe_layer(i) for i in range(2))
    assert (wrapped.num_experts, wrapped.num_experts_per_tok, wrapped.intermediate_size) == (256, 8, 0)


def test_config_defaults_are_transformers(tiny_checkpoint):
    """Absent fields take transformers' defaults (head_dim 256, not hidden/heads), for every model type."""
    from transformers import CONFIG_MAPPING

    base = {k: v for k, v in _base_config(tiny_checkpoint).items() if k != "head_dim"}
    cfg = Qwen3NextConfig.from_hf_config(base)
    assert cfg.head_dim == CONFIG_MAPPING["qwen3_next"]().head_dim == 256
    for model_type in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"):
        hf = CONFIG_MAPPING[model_type]()
        ours = Qwen3NextConfig.from_hf_config({"model_type": model_type})
        text = hf.get_text_config(decoder=True)
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "layer_types",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
            "max_position_embeddings",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
        ):
            assert getattr(ours, name) == getattr(text, name, 0), (model_type, name)
        assert ours.rope_theta == text.rope_parameters["rope_theta"], model_type
        assert ours.partial_rotary_factor == text.rope_parameters["partial_rotary_factor"], model_type
        assert ours.tie_word_embeddings == hf.tie_word_embeddings, model_type


def test_config_derived_fields(tiny_checkpoint):
    base = _base_config(tiny_checkpoint)
    del base["layer_types"]
    legacy = {k: v for k, v in base.items() if k != "rope_parameters"}
    cfg = Qwen3NextConfig.from_hf_config({**legacy, "num_hidden_layers": 8, "full_attention_interval": 4,
                                      "rope_theta": 1e7, "partial_rotary_factor": 0.5,
                                      "eos_token_id": [3, 4], "num_nextn_predict_layers": 1})
    assert cfg.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert (cfg.rope_theta, cfg.partial_rotary_factor, cfg.rotary_dim) == (1e7, 0.5, 8)
    assert cfg.eos_token_ids == [3, 4] and cfg.num_mtp_layers == 1 and cfg.gdn_layout == "qkvz"
    parse = Qwen3NextConfig.from_hf_config
    assert parse({**base, "num_hidden_layers": 4, "eos_token_id": 7}).eos_token_ids == [7]
    assert parse({**base, "num_hidden_layers": 4, "eos_token_id": None}).eos_token_ids == []


# ---- hub ids from the local cache, dtype="auto" ------------------------------------------------------


def _fake_hub_cache(cache, repo_id: str, src) -> None:
    """The layout huggingface_hub keeps: models--owner--name/{refs/main, snapshots/<commit>/files}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in src.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())


def test_hub_id_resolves_from_the_local_cache_only(tiny_checkpoint, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from refengine.model.loader import resolve_model_path

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    src = tiny_checkpoint("next-moe")
    _fake_hub_cache(tmp_path / "hub", "Qwen/Tiny-Next-MoE", src)
    path = resolve_model_path("Qwen/Tiny-Next-MoE")
    assert "snapshots" in path
    _assert_same_state(load_model(path)[0], load_model(src)[0])
    assert resolve_model_path(str(src)) == str(src)  # a folder is itself

    with pytest.raises(CheckpointError, match="nor in the local Hugging Face cache.*never downloaded"):
        resolve_model_path("Qwen/Qwen3-Next-80B-A3B-Instruct")


def test_llm_takes_a_hub_id_and_dtype_auto(tiny_checkpoint, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from refengine.llm import LLM

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    src = tiny_checkpoint("qwen35-moe")
    bf16 = tmp_path / "bf16"
    tensors = {k: v.to(torch.bfloat16) for k, v in read_tensors(src).items()}
    write_variant(src, bf16, tensors, {**json.loads((src / "config.json").read_text()), "dtype": "bfloat16"})
    _fake_hub_cache(tmp_path / "hub", "someone/tiny-bf16", bf16)
    llm = LLM("someone/tiny-bf16", dtype="auto", max_num_batched_tokens=64)
    assert llm.config.dtype == "bfloat16"
    assert all(p.dtype == torch.bfloat16 for p in llm.engine.model.parameters())
    assert len(llm.generate([[1, 2, 3]])[0].token_ids) > 0


def test_dtype_auto_reads_config_then_tensors(tiny_checkpoint, tmp_path):
    from refengine.model.loader import resolve_dtype

    src = tiny_checkpoint("next-tiny")
    assert resolve_dtype("bfloat16", src) == "bfloat16"
    assert resolve_dtype("auto", src) == "float32"  # transformers wrote "dtype": "float32"
    config = json.loads((src / "config.json").read_text())
    config.pop("dtype", None)
    wrapped = write_variant(src, tmp_path / "torch_dtype", None, {"model_type": "qwen3_5",
                                                                   "text_config": {"torch_dtype": "float16"}})
    assert resolve_dtype("auto", wrapped) == "float16"
    no_dtype = write_variant(
        src, tmp_path / "none", {k: v.to(torch.bfloat16) for k, v in read_tensors(src).items()}, config
    )
    assert resolve_dtype("auto", no_dtype) == "bfloat16"  # from the tensors
    odd = write_variant(src, tmp_path / "odd", None, {**config, "dtype": "float8_e4m3fn"})
    with pytest.raises(CheckpointError, match="float8_e4m3fn"):
        resolve_dtype("auto", odd)


# ---- MoE checkpoints ----------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["next-moe", "qwen35-moe"])
def test_fused_and_per_expert_layouts_load_identically(preset, tiny_checkpoint, tmp_path):
    src = tiny_checkpoint(preset)
    per_expert, cfg = load_model(src)
    fused = write_variant(src, tmp_path / "fused", fuse_experts(read_tensors(src)))
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in read_tensors(fused))
    _assert_same_state(per_expert, load_model(fused)[0])
    # The fused layout is transformers' own: the per-expert weights sit at [e, :I] (gate) and [e, I:] (up).
    tensors = read_tensors(src)
    gate_up = per_expert.model.layers[1].mlp.experts.gate_up_proj
    i = cfg.moe_intermediate_size
    assert torch.equal(gate_up[2, :i], tensors["model.layers.1.mlp.experts.2.gate_proj.weight"])
    assert torch.equal(gate_up[2, i:], tensors["model.layers.1.mlp.experts.2.up_proj.weight"])


@pytest.mark.parametrize(
    "drop, add, expected",
    [
        (
            ["model.layers.1.mlp.experts.3.up_proj.weight"],
            None,
            "missing tensor model.layers.1.mlp.experts.3.up_proj",
        ),
        (["mtp.layers.0.mlp.gate.weight"], None, "missing tensor mtp.layers.0.mlp.gate.weight"),
        (
            [],
            {"model.layers.1.mlp.experts.8.up_proj.weight": torch.zeros(32, 64)},
            "unexpected tensor model.layers.1.mlp.experts.8.up_proj.weight",
        ),
        (
            [],
            {"model.layers.0.mlp.shared_expert_gate.weight": torch.zeros(2, 64)},
            r"shared_expert_gate.weight has shape \[2, 64\], expected \[1, 64\]",
        ),
        (
            [],
            {"model.layers.2.mlp.experts.gate_up_proj": torch.zeros(8, 64, 64)},
            "missing tensor model.layers.2.mlp.experts.down_proj",
        ),
    ],
    ids=["missing-expert", "missing-mtp-router", "extra-expert", "misshaped-gate", "mixed-layouts"],
)
def test_bad_moe_tensors_are_named(drop, add, expected, tiny_checkpoint, tmp_path):
    path = _edit(tiny_checkpoint("next-moe"), tmp_path / "bad", drop, add)
    with pytest.raises(CheckpointError, match=expected):
        load_model(path)
