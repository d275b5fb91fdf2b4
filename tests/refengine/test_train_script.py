"""The default model's training script stays runnable: a few steps of a tiny model, then a load."""

from __future__ import annotations

import json

import pytest
import torch

from refengine.model import load_model
from refengine.tokenizer import load_tokenizer
from refengine.tools import corpus
from refengine.tools.default_workload import DEFAULT_PROMPTS
from refengine.tools.train_default_model import EOS_ID, main


def test_three_steps_write_a_loadable_checkpoint(tmp_path, capsys):
    out = tmp_path / "model"
    assert main(["--out", str(out), "--tiny", "--steps", "3", "--max-files", "30"]) == 0
    log = capsys.readouterr().out
    assert "step 3/3" in log and "wrote" in log
    model, cfg = load_model(out)
    assert model.mtp is not None and cfg.eos_token_ids == [EOS_ID]
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_next"
    assert load_tokenizer(str(out)).eos_token_id == EOS_ID
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_corpus_is_deterministic_ascii_with_synthetic_lines():
    a = corpus.build_documents(seed=0, max_files=30)
    b = corpus.build_documents(seed=0, max_files=30)
    assert a == b and all(d.isascii() for d in a)
    assert any(d.startswith("Once upon a time") for d in a)
    assert any("Beautiful is better than ugly." in d for d in a)


@pytest.mark.slow
def test_held_out_prompts_are_not_in_the_corpus():
    text = "\n".join(corpus.build_documents(seed=0))
    for prompt in DEFAULT_PROMPTS:
        if prompt.kind != "predictable":
            assert prompt.text not in text, prompt
