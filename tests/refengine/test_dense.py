"""The dense attention family (Llama, Qwen3) reproduces transformers on tiny checkpoints transformers
wrote, through the model and both engines.

Presets (tests/helpers/llama_checkpoints.py): Llama with Llama-3.1's RoPE scaling (untied, GQA 4:2),
plain RoPE (tied), odd sizes; Qwen3 with its q/k norms (tied, and untied with GQA 8:2).
"""

from __future__ import annotations

import io
import json
import re

import pytest
import torch

from conformance.cli import main as conformance_main
from conformance.model import describe_model
from refengine import LLM, SamplingParams
from refengine.drafters import ScriptedDrafter
from refengine.model import CheckpointError, load_model
from refengine.model.registry import cache_specs, family_for
from refengine.tools.tiny_models import tiny_model_path
from tests.helpers.driver import Driver, greedy_generate
from tests.helpers.llama_checkpoints import PRESETS, load_hf_model, write_checkpoint
from tests.helpers.oracle import hf_greedy_uncached

NEW_TOKENS = 8
REL_TOL = 1e-5
LENGTHS = (1, 5, 40, 90)  # 90 reaches past the llama3 scaling's original context of 64
DEFAULT_TIER = ("llama3", "llama-plain-tied", "qwen3")
CASES = [pytest.param(p, (3, 20), id=f"{p}-short") for p in DEFAULT_TIER] + [
    pytest.param(p, LENGTHS, id=p, marks=pytest.mark.slow) for p in sorted(PRESETS)]
TINY = "tiny:llama"


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """``dense(preset) -> Path``: a checkpoint transformers wrote, once per module."""
    written = {}

    def get(preset: str):
        if preset not in written:
            written[preset] = write_checkpoint(tmp_path_factory.mktemp(preset), preset)
        return written[preset]

    return get


def make_prompts(vocab_size: int, lengths, seed: int = 6) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def prefill_errors(model, cfg, hf, prompts) -> list[float]:
    _, ours, _ = greedy_generate(model, cfg, prompts, 1)
    errors, start = [], 0
    for prompt in prompts:
        with torch.no_grad():
            theirs = hf(torch.tensor([prompt])).logits[0]
        errors.append(rel_err(ours[start:start + len(prompt)], theirs))
        start += len(prompt)
    return errors


@pytest.mark.parametrize("preset, lengths", CASES)
def test_greedy_and_prefill_logits_match_transformers(preset, lengths, dense):
    path = dense(preset)
    hf = load_hf_model(path)
    model, cfg = load_model(path)
    assert family_for(cfg.model_type).name == "llama"
    prompts = make_prompts(cfg.vocab_size, lengths)
    tokens, _, _ = greedy_generate(model, cfg, prompts, NEW_TOKENS)
    for prompt, ours in zip(prompts, tokens):
        assert ours == hf_greedy_uncached(hf, prompt, NEW_TOKENS), f"prompt of length {len(prompt)}"
    for prompt, err in zip(prompts, prefill_errors(model, cfg, hf, prompts)):
        assert err <= REL_TOL, f"prompt of length {len(prompt)}: prefill logits relative error {err:.2e}"


def test_llama3_frequencies_equal_transformers_bitwise_and_matter(dense, tmp_path):
    """The scaled inverse frequencies are transformers' own bits; served without the scaling, the same
    weights miss the oracle by far more than float error (so the parity test sees the scaling)."""
    path = dense("llama3")
    hf = load_hf_model(path)
    model, cfg = load_model(path)
    ours = model.model.layers[0].self_attn.rotary.inv_freq(torch.device("cpu"))
    assert torch.equal(ours, hf.model.rotary_emb.inv_freq)
    raw = json.loads((path / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw["rope_parameters"]["rope_theta"]}
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(raw))
    (plain / "model.safetensors").symlink_to(path / "model.safetensors")
    unscaled, cfg = load_model(plain)
    prompts = make_prompts(cfg.vocab_size, (40,))
    assert max(prefill_errors(unscaled, cfg, hf, prompts)) > 100 * REL_TOL


def test_aux_hidden_states_are_transformers_hidden_states(dense):
    """``ctx.capture_aux(i, x)``: the residual stream entering layer i is transformers'
    ``output_hidden_states[i]`` (for i < L; its last entry is post final norm)."""
    path = dense("llama3")
    hf = load_hf_model(path)
    model, cfg = load_model(path)
    prompt = make_prompts(cfg.vocab_size, (17,))[0]
    driver = Driver(model, cfg, 1, len(prompt))
    layers = cfg.num_hidden_layers
    ctx, positions = driver._context([0], [len(prompt)], prefill=True, chunked=False)
    ctx.aux_layers = tuple(range(layers))
    with torch.no_grad():
        model(torch.tensor(prompt), positions, ctx)
        theirs = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    assert len(ctx.aux_hidden) == layers
    for i in range(layers):
        err = rel_err(ctx.aux_hidden[i], theirs[i][0])
        assert err <= REL_TOL, f"layer {i}: aux hidden relative error {err:.2e}"
    assert rel_err(ctx.aux_hidden[1], theirs[2][0]) > 100 * REL_TOL  # one layer off is caught


def test_caches_are_one_paged_kv_per_layer_and_no_drafter_kv(dense):
    _, cfg = load_model(dense("qwen3"))
    specs = cache_specs(cfg, 3, drafter_kv=False)
    assert sorted(specs) == list(range(cfg.num_hidden_layers))
    assert {(s.num_kv_heads, s.head_dim) for s in specs.values()} == {(2, 16)}
    with pytest.raises(ValueError, match="no MTP head"):
        cache_specs(cfg, 3, drafter_kv=True)


@pytest.mark.parametrize("engine", ["reference", "async"])
def test_engine_greedy_equals_transformers(engine, dense):
    """Both engines, batched with chunked prefill (a 40-token prompt over 16-token steps), against the
    oracle one prompt at a time."""
    path = dense("qwen3")
    hf = load_hf_model(path)
    llm = LLM(model=str(path), engine=engine, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = make_prompts(llm.model_config.vocab_size, (3, 40, 17))
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy_uncached(hf, prompt, NEW_TOKENS), f"prompt of length {len(prompt)}"


# ---- both engines, token-exact, on the tiny preset ---------------------------------------------------
SYSTEM = list(b"You are a terse assistant. ")  # 27 tokens: whole 4-token blocks the second wave hits
WAVES = [[SYSTEM + list(b"the cat. the cat.")],
         [SYSTEM + list(b"the dog. the dog. the dog."), SYSTEM + list(b"hi"), list(b"abcabcabcabc"),
          list(range(40, 75))]]


def drafter_for(name: str, k: int):
    return ScriptedDrafter(k, 256, "hash") if name == "scripted" else name


def run_waves(engine: str, k: int, drafter: str, graph_mode: str = "full_and_piecewise"):
    extra = {"graph_mode": graph_mode} if engine == "async" else {}
    if drafter == "ngram":  # short n-grams: the model's outputs rarely repeat a 5-gram of the prompt
        extra.update(prompt_lookup_min=1, prompt_lookup_max=3)
    llm = LLM(model=tiny_model_path(TINY), engine=engine, num_speculative_tokens=k,
              drafter=drafter_for(drafter, k), enable_prefix_caching=True, block_size=4,
              max_num_batched_tokens=16, max_num_seqs=4, **extra)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = [o for wave in WAVES for o in llm.generate(wave, params)]
    assert llm.engine.pools_empty(), "blocks leaked"
    return outs


def assert_same(ref, got):
    for i, (a, b) in enumerate(zip(ref, got)):
        assert b.token_ids == a.token_ids, f"prompt {i}: async {b.token_ids} != reference {a.token_ids}"
        assert b.acceptance == a.acceptance, f"prompt {i}: acceptance differs"
        assert b.num_cached_tokens == a.num_cached_tokens, f"prompt {i}: prefix-cache hits differ"


ENGINE_CASES = [(0, "mtp", "full_and_piecewise"), (3, "ngram", "full_and_piecewise")]
SLOW_ENGINE_CASES = [(3, "scripted", "full_and_piecewise")] + [
    (k, d, m) for m in ("none", "piecewise", "full") for k, d in ((0, "mtp"), (3, "ngram"), (3, "scripted"))]


@pytest.mark.parametrize("k, drafter, graph_mode", [pytest.param(*c, id="-".join(map(str, c)))
                                                    for c in ENGINE_CASES] + [
    pytest.param(*c, id="-".join(map(str, c)), marks=pytest.mark.slow) for c in SLOW_ENGINE_CASES])
def test_both_engines_token_exact_with_prefix_caching(k, drafter, graph_mode):
    ref = run_waves("reference", k, drafter)
    got = run_waves("async", k, drafter, graph_mode)
    assert_same(ref, got)
    assert sum(o.num_cached_tokens for o in ref) >= 24, "the second wave should hit the shared prefix"
    if k:
        assert sum(o.num_draft_tokens for o in ref) > 0, "some drafts should be verified"
    if drafter == "scripted":
        assert sum(o.num_accepted_tokens for o in ref) > 0, "some drafts should be accepted"


def test_the_tiny_preset_has_eagle3_layers_and_wide_margins():
    """8 layers (EAGLE-3's default auxiliary layers 2, L/2, L-3 exist), llama3 scaling, and greedy margins
    that are not flat."""
    model, cfg = load_model(tiny_model_path(TINY))
    assert cfg.num_hidden_layers >= 8 and cfg.rope_scaling is not None
    _, logits, _ = greedy_generate(model, cfg, [list(b"Once upon a time")], 1)
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).median()) > 1e-3


def test_conformance_runs_on_the_tiny_preset():
    """``conformance run --model tiny:llama``: the family is named, scenarios drafting with an MTP head are
    skipped (the model has none), the others pass."""
    facts = describe_model(TINY)
    assert facts.family == "llama" and not facts.has_mtp and facts.has_tokenizer
    out = io.StringIO()
    args = ["run", "--model", TINY, "--engine", "async", "--scenario", "short-prompts-k0",
            "--scenario", "scripted-ragged-k3", "--scenario", "short-prompts-k1"]
    assert conformance_main(args, out=out) == 0, out.getvalue()
    text = out.getvalue()
    assert "2 passed, 0 failed" in text and "1 skipped" in text, text


@pytest.mark.slow
def test_structured_outputs_resumed_after_preemption_on_a_wider_tiny_llama(tmp_path, monkeypatch):
    """tiny:llama's maker with RMSNorm weights in [1, 3]: ``structured-preemption-k3`` on the async engine
    once raised 'committed token ... breaks the grammar it was decoded under' on resumption: a request
    (ignore_eos) preempted while its verify step was in flight lost its matcher at the preemption, so the
    step's kept tokens were committed without it; a draft completing the grammar did not finish the
    request and the bonus token after it was kept, which the matcher rebuilt at readmission refused."""
    from refengine.model.llama import tiny
    from refengine.tools import tiny_models

    monkeypatch.setattr(tiny, "NORMS", (1.0, 3.0))
    tiny_models._make("llama", tmp_path)
    out = io.StringIO()
    args = ["run", "--model", str(tmp_path / "out"), "--engine", "async",
            "--scenario", "structured-preemption-k3", "--allow-unexercised"]
    rc = conformance_main(args, out=out)
    assert not re.search(r"token \d+ (at index \d+ )?breaks", out.getvalue()), out.getvalue()
    assert rc == 0, out.getvalue()


# ---- refused configs ----------------------------------------------------------------------------------
BAD_FIELDS = [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
     r"rope_parameters: rope_type 'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_scaling: rope_type 'dynamic'"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3},
     r"num_attention_heads: 4 is not a multiple of num_key_value_heads 3"),
    ({"attention_bias": True}, r"attention_bias: biased projections are not supported"),
    ({"mlp_bias": True}, r"mlp_bias: biased projections are not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act: only 'silu'"),
    ({"head_dim": 15}, r"head_dim"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                          "high_freq_factor": 1.0, "original_max_position_embeddings": 64,
                          "rope_theta": 10000.0}}, r"low_freq_factor < high_freq_factor"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}},
     r"low_freq_factor|high_freq_factor"),
]


@pytest.mark.parametrize("change, message", BAD_FIELDS, ids=[next(iter(c)) + f"-{i}" for i, (c, _) in
                                                             enumerate(BAD_FIELDS)])
def test_a_bad_config_field_is_refused_by_name(change, message, dense, tmp_path):
    path = dense("llama3")
    raw = json.loads((path / "config.json").read_text())
    raw.pop("rope_parameters", None) if "rope_scaling" in change else None
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path)
