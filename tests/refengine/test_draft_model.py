"""Draft models (``drafter="draft_model"``): a checkpoint with the target's vocabulary drafts with its own KV
cache and, when hybrid, its own recurrent state slots under the target's contract (s_0..s_K, read at a-1).

Both engines are token-exact and acceptance-exact and feed the drafter the same ids; speculation is lossless;
a verify step that rejected drafts leaves none of them in the draft model's state (it equals a fresh prefill
of the committed tokens); a draft model with another vocabulary and a malformed vLLM ``speculative_config``
are refused naming the problem.
"""

from __future__ import annotations

import json

import pytest
import torch

from refengine import LLM, ConfigError, SamplingParams
from refengine.config import speculative_from_vllm
from refengine.drafters import draft_model as draft_module
from refengine.llm import default_model_path
from refengine.model.loader import CheckpointError
from refengine.tools.cli import main as refengine_main
from refengine.tools.draft_model import cut_draft_model, make_draft_model, parse_layers
from refengine.tools.tiny_models import tiny_model_path

BLOCK = 4
SHARED = [(5 * j) % 250 for j in range(13)]
PROMPTS = [SHARED, [7], [3, 1, 4, 1], [9, 2, 6, 5, 3], SHARED[:10] + [8, 8]]


@pytest.fixture(scope="module")
def hybrid_draft():
    """The embedded default model cut to layers 0 and 3: a GDN layer and a full-attention layer."""
    return cut_draft_model(default_model_path(), "0,3")


def run(draft, k, engine="reference", graph_mode="none", model=None, prompts=PROMPTS, max_tokens=10,
        **kw):
    records = []
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k} if k else None
    llm = LLM(model=model, engine=engine, graph_mode=graph_mode, speculative_config=spec, block_size=BLOCK,
              max_num_seqs=4, observer=records.append, **kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert llm.engine.pools_empty()
    drafter_rows = {(r.request_id, tuple(r.positions), r.output_token_ids is not None):
                    (r.drafter_input_ids, r.next_draft_token_ids)
                    for rec in records for r in rec.rows}
    return [o.token_ids for o in outs], [o.acceptance for o in outs], drafter_rows


def assert_same(ref, test):
    assert test[0] == ref[0], "tokens differ"
    assert test[1] == ref[1], "acceptance differs"
    common = ref[2].keys() & test[2].keys()
    assert len(common) >= len(PROMPTS)
    last = {}
    for key in sorted(common):  # a request's last sampling row may have finished (the reference drafts none)
        if key[2]:
            last[key[0]] = key
    for key in common - set(last.values()):
        assert test[2][key] == ref[2][key], f"drafter inputs or drafts differ at {key}"


def test_both_engines_exact_and_lossless_with_a_hybrid_draft_model(hybrid_draft):
    """K=3, prefix caching on: the async engine (FULL_AND_PIECEWISE) equals the reference engine, and both
    equal plain greedy decoding; drafts are both accepted and rejected."""
    ref = run(hybrid_draft, 3, enable_prefix_caching=True, mamba_cache_mode="all")
    test = run(hybrid_draft, 3, "async", "full_and_piecewise", enable_prefix_caching=True,
               mamba_cache_mode="all")
    assert_same(ref, test)
    assert ref[0] == run(None, 0)[0], "speculation changed the output"
    accepted = {a for acc in ref[1] for _, a in acc}
    assert 0 in accepted and max(accepted) > 0, accepted


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("graph_mode", ["none", "piecewise", "full", "full_and_piecewise"])
@pytest.mark.parametrize("caching", [False, True])
def test_every_graph_mode_and_k(hybrid_draft, k, graph_mode, caching):
    cache = {"enable_prefix_caching": caching}
    ref = run(hybrid_draft, k, **cache)
    assert_same(ref, run(hybrid_draft, k, "async", graph_mode, **cache))
    assert ref[0] == run(None, 0)[0]


def test_the_target_as_its_own_draft_model_accepts_every_draft():
    """Every layer kept: the draft model is the target, so each verify step keeps all K drafts (a draft state
    read at the wrong slot, or KV at the wrong positions, would make it propose something else)."""
    draft = cut_draft_model(default_model_path(), "all")
    _, acceptance, _ = run(draft, 3, "async", "full", prompts=PROMPTS[:3])
    assert all(a == 3 for acc in acceptance for d, a in acc if d == 3), acceptance


@pytest.mark.slow
def test_mamba2_draft_model_on_nemotron_h():
    """tiny:nemotron_h cut to its Mamba2 and attention layers drafts for itself: both engines alike."""
    target = tiny_model_path("tiny:nemotron_h")
    draft = cut_draft_model(target, "0,1")
    prompts = [[5, 6, 7], [9], [1, 2, 3, 4, 5, 6]]
    ref = run(draft, 2, model=target, prompts=prompts, max_tokens=8)
    test = run(draft, 2, "async", "full_and_piecewise", model=target, prompts=prompts, max_tokens=8)
    assert (test[0], test[1]) == (ref[0], ref[1])
    assert ref[0] == run(None, 0, model=target, prompts=prompts, max_tokens=8)[0]


def _draft_state(llm, rid):
    """The draft model's live GDN state of running request ``rid`` (reference engine): (conv window [C, W-1],
    recurrent state), read where the next step reads it (slot s_{a-1}, window columns a-1..)."""
    req = llm.engine.core.requests[rid]
    conv, ssm = llm.engine.caches.states["draft.0"]
    a = req.num_valid
    width = conv.shape[-1] - llm.config.speculative.num_speculative_tokens
    return conv[req.state_slots[0], :, a - 1: a - 1 + width].clone(), ssm[req.state_slots[a - 1]].clone()


def _fresh_state(draft, tokens):
    """The draft model's GDN state after a plain prefill of ``tokens`` (no speculation)."""
    llm = LLM(model=draft, block_size=BLOCK, max_num_seqs=1)
    llm.add_request("fresh", tokens, SamplingParams(max_tokens=2, ignore_eos=True))
    llm.step()  # the prompt in one chunk; the request runs on
    req = llm.engine.core.requests["fresh"]
    conv, ssm = llm.engine.caches.states[0]
    return conv[req.state_slots[0]].clone(), ssm[req.state_slots[0]].clone()


@pytest.mark.parametrize("broken", [False, True], ids=["scratch slot", "chain in s_0 (must fail)"])
def test_a_rejected_draft_leaves_no_state_behind(hybrid_draft, broken, monkeypatch):
    """After verify steps that rejected drafts, the draft model's state that the next step reads equals the
    state a fresh prefill of the committed tokens leaves. With the chained passes run in the request's own
    s_0 instead of a scratch slot (the bonus and the drafts then stay in the state) the comparison fails."""
    if broken:
        monkeypatch.setattr(draft_module, "scratch_slots", lambda states, slot0, live: slot0)
    records = []
    spec = {"method": "draft_model", "model": hybrid_draft, "num_speculative_tokens": 3}
    llm = LLM(speculative_config=spec, block_size=BLOCK, max_num_seqs=1, observer=records.append)
    llm.add_request("r", SHARED, SamplingParams(max_tokens=40, ignore_eos=True))
    checked = 0
    while llm.has_unfinished() and checked < 3:
        llm.step()
        row = records[-1].rows[0]
        req = llm.engine.core.requests.get("r")
        if req is None or row.num_accepted is None or row.num_accepted == len(row.draft_token_ids):
            continue  # only steps that rejected a draft
        conv, ssm = _draft_state(llm, "r")
        fresh_conv, fresh_ssm = _fresh_state(hybrid_draft, req.all_token_ids[: req.num_computed_tokens])
        if broken and not (torch.allclose(conv, fresh_conv[:, : conv.shape[-1]])
                           and torch.allclose(ssm, fresh_ssm, atol=1e-5)):
            return  # the broken chain was seen
        torch.testing.assert_close(conv, fresh_conv[:, : conv.shape[-1]])
        torch.testing.assert_close(ssm, fresh_ssm, atol=1e-5, rtol=1e-5)
        checked += 1
    assert not broken, "a chain run in the live slot went unnoticed"
    assert checked == 3, "the run had too few steps with rejections"


def test_a_draft_model_with_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"vocab_size 256.*target model 260"):
        LLM(speculative_config={"method": "draft_model", "model": tiny_model_path("tiny:nemotron_h"),
                                "num_speculative_tokens": 2})


def test_vllm_speculative_config():
    assert speculative_from_vllm({"method": "draft_model", "model": "/x", "num_speculative_tokens": 3}) == {
        "drafter": "draft_model", "draft_model": "/x", "num_speculative_tokens": 3}
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}
    assert speculative_from_vllm(ngram) == {"drafter": "ngram", "num_speculative_tokens": 2,
                                            "prompt_lookup_max": 4}
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'draft_tensor_parallel_size'"):
        speculative_from_vllm({"method": "draft_model", "model": "/x", "num_speculative_tokens": 3,
                               "draft_tensor_parallel_size": 1})
    with pytest.raises(ConfigError, match="method must be one of"):
        speculative_from_vllm({"method": "medusa", "num_speculative_tokens": 3})
    with pytest.raises(ConfigError, match="needs 'num_speculative_tokens'"):
        speculative_from_vllm({"method": "mtp"})
    with pytest.raises(ConfigError, match="needs draft_model="):
        LLM(speculative_config={"method": "draft_model", "num_speculative_tokens": 3})
    with pytest.raises(ConfigError, match="speculative_config and num_speculative_tokens both given"):
        LLM(num_speculative_tokens=2, speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def test_make_draft_model(tmp_path, capsys):
    src = default_model_path()
    assert parse_layers("2", 4) == [0, 1] and parse_layers("0,3", 4) == [0, 3]
    assert parse_layers("all", 2) == [0, 1]
    for bad in ("0", "5", "3,1", "1,1", "x"):
        with pytest.raises(CheckpointError, match="--layers"):
            parse_layers(bad, 4)
    out = make_draft_model(src, tmp_path / "d", "1,3")
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    assert config["layer_types"] == ["linear_attention", "full_attention"]
    assert (out / "tokenizer.json").is_file()
    assert refengine_main(["make-draft-model", src, str(tmp_path / "e"), "--layers", "2"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert refengine_main(["make-draft-model", src, str(tmp_path / "e"), "--layers", "2"]) != 0
    assert "already exists" in capsys.readouterr().err
