"""``refengine add-mtp-head SRC DST`` on checkpoints transformers saved without an MTP head: DST loads
with one (detected from its ``mtp.*`` tensors), drafts with it losslessly in both engines, runs the
conformance suite's MTP scenarios instead of skipping them, and is SRC's model otherwise."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conformance.cli import main as conformance_main
from conformance.model import describe_model
from refengine import LLM, SamplingParams
from refengine.llm import default_model_path
from refengine.model.loader import read_config
from refengine.tools.cli import main
from tests.helpers.checkpoints import get_spec, write_checkpoint

PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], [9]]
LAYOUTS = {  # preset -> the key config.json gets the MTP layer count under
    "next-tiny": "num_nextn_predict_layers",  # Qwen3-Next, dense
    "qwen35-moe": "mtp_num_hidden_layers",  # Qwen3.5-MoE: the MTP layer's MLP is sparse
    "qwen35-mm": "mtp_num_hidden_layers",  # the multimodal wrapper: model.language_model.*, text_config
}


@pytest.fixture(scope="module")
def without_head(tmp_path_factory):
    """``get(preset) -> Path``: the preset as transformers saves it, with no mtp.* tensors."""
    made: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in made:
            made[preset] = write_checkpoint(tmp_path_factory.mktemp(preset) / "src",
                                            replace(get_spec(preset), with_mtp=False))
        return made[preset]

    return get


def _tokens(model, **kwargs) -> list[list[int]]:
    return [
        o.token_ids for o in LLM(model=str(model), **kwargs).generate(PROMPTS, SamplingParams(max_tokens=12))
    ]


@pytest.mark.parametrize("preset", LAYOUTS)
def test_the_copy_drafts_with_its_new_head_losslessly(preset, without_head, tmp_path, capsys):
    src, dst = without_head(preset), tmp_path / "dst"
    assert not describe_model(str(src)).has_mtp
    with pytest.raises(ValueError, match="needs a checkpoint with mtp.* weights"):
        LLM(model=str(src), num_speculative_tokens=2)

    assert main(["add-mtp-head", str(src), str(dst)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {dst}: {src} plus an MTP head of ")
    assert describe_model(str(dst)).has_mtp
    plain = _tokens(src)
    assert _tokens(dst) == plain  # the model itself is unchanged
    for engine in ("reference", "async"):
        outs = LLM(model=str(dst), engine=engine, num_speculative_tokens=3).generate(
            PROMPTS, SamplingParams(max_tokens=12))
        assert [o.token_ids for o in outs] == plain, engine  # speculation is lossless
        assert all(o.num_draft_tokens > 0 for o in outs), engine  # the head drafted
    config = json.loads((dst / "config.json").read_text())
    assert config.get("text_config", config)[LAYOUTS[preset]] == 1


def test_the_head_is_made_of_the_models_own_layers(without_head, tmp_path):
    src, dst = without_head("qwen35-moe"), tmp_path / "dst"
    assert main(["add-mtp-head", str(src), str(dst)]) == 0
    cfg = read_config(src)
    model, head = load_file(str(src / "model.safetensors")), load_file(str(dst / "mtp.safetensors"))
    last_full = f"model.layers.{cfg.full_layer_ids[-1]}."
    assert torch.equal(
        head["mtp.layers.0.self_attn.q_proj.weight"], model[last_full + "self_attn.q_proj.weight"]
    )
    assert torch.equal(
        head["mtp.layers.0.input_layernorm.weight"], model[last_full + "input_layernorm.weight"]
    )
    # a sparse MTP layer, as layer 0
    assert torch.equal(
        head["mtp.layers.0.mlp.experts.3.down_proj.weight"],
        model["model.layers.0.mlp.experts.3.down_proj.weight"],
    )
    assert torch.equal(head["mtp.norm.weight"], model["model.norm.weight"])
    h = cfg.hidden_size
    assert torch.equal(head["mtp.fc.weight"], torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1))
    assert not head["mtp.pre_fc_norm_embedding.weight"].any()
    assert set(load_file(str(dst / "model.safetensors"))) == set(model)  # SRC's weights, not rewritten
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(model) | set(head)


def test_the_conformance_suite_runs_its_mtp_scenarios_on_the_copy(without_head, tmp_path):
    src, dst = without_head("next-tiny"), tmp_path / "dst"
    argv = ["run", "--engine", "async", "--scenario", "mtp-k3", "--scenario", "mtp-k1"]
    out = io.StringIO()
    # both scenarios skipped: the run checked nothing, so it is not green
    assert conformance_main([*argv, "--model", str(src)], out=out) == 1
    assert (
        "no MTP head (mtp.* weights; `refengine add-mtp-head` adds one)" in out.getvalue()
        and "no scenario ran: all 2 were skipped, so nothing was checked" in out.getvalue()
    ), out.getvalue()
    assert main(["add-mtp-head", str(src), str(dst)]) == 0
    out = io.StringIO()
    assert conformance_main([*argv, "--model", str(dst)], out=out) == 0
    assert "2 passed, 0 failed, 0 expected failures, 0 skipped" in out.getvalue(), out.getvalue()


@pytest.mark.parametrize("case,pattern", [
    ("has-head", "already has an MTP head"),
    ("dst-exists", "exists; add-mtp-head writes a new folder"),
    ("not-a-checkpoint", "missing config.json"),
])
def test_refusals_are_one_line(case, pattern, without_head, tmp_path, capsys):
    src, dst = without_head("next-tiny"), tmp_path / "dst"
    if case == "has-head":
        src = Path(default_model_path())
    elif case == "dst-exists":
        dst.mkdir()
    else:
        src = tmp_path
    assert main(["add-mtp-head", str(src), str(dst)]) == 2
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert line.startswith("refengine add-mtp-head: ") and pattern in line and not out, line
    assert case == "dst-exists" or not dst.exists()
