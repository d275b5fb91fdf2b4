"""Nemotron-H reproduces transformers on tiny checkpoints transformers wrote, through the model and
both engines.

The oracle is transformers' uncached float32 forward with its Mamba2 dt clamp lifted to (0, inf), as
served models run (tests/helpers/nemotron_checkpoints.py). Presets: Mamba2 + attention + MLP (the
default tier), MoE with grouped routing and the legacy pattern field, latent MoE with odd sizes.
"""

from __future__ import annotations

import io

import pytest
import torch

from conformance.cli import main as conformance_main
from refengine import LLM, SamplingParams
from refengine.model import load_model
from tests.helpers.driver import greedy_generate
from tests.helpers.nemotron_checkpoints import PRESETS, load_hf_model
from tests.helpers.oracle import hf_greedy_uncached

PROMPT_LENGTHS = (1, 3, 17, 40)  # 17 and 40 cross transformers' 8-token scan chunks
NEW_TOKENS = 8
REL_TOL = 1e-5
DEFAULT_TIER_LENGTHS = (3, 20)
CASES = [pytest.param("nemotron-dense", DEFAULT_TIER_LENGTHS, False, id="nemotron-dense-short")] + [
    pytest.param(p, PROMPT_LENGTHS, chunked, id=f"{p}-{'chunked' if chunked else 'recurrent'}",
                 marks=pytest.mark.slow) for p in sorted(PRESETS) for chunked in (False, True)]


def make_prompts(vocab_size: int, lengths=PROMPT_LENGTHS, seed: int = 6) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("preset, lengths, chunked", CASES)
def test_greedy_and_prefill_logits_match_transformers(preset, lengths, chunked, tiny_nemotron):
    """The recurrent prefill (the default) and the chunked scan (chunks of 16 at absolute positions)."""
    path = tiny_nemotron(preset)
    hf = load_hf_model(path)
    model, cfg = load_model(path)
    prompts = make_prompts(cfg.vocab_size, lengths)
    tokens, prefill_logits, _ = greedy_generate(model, cfg, prompts, NEW_TOKENS, chunked=chunked)
    start = 0
    for prompt, ours in zip(prompts, tokens):
        assert ours == hf_greedy_uncached(hf, prompt, NEW_TOKENS), f"prompt of length {len(prompt)}"
        with torch.no_grad():
            theirs = hf(torch.tensor([prompt])).logits[0]
        err = rel_err(prefill_logits[start:start + len(prompt)], theirs)
        assert err <= REL_TOL, f"prompt of length {len(prompt)}: prefill logits relative error {err:.2e}"
        start += len(prompt)


def test_transformers_dt_clamp_is_what_differs(tiny_nemotron):
    """With transformers' own clamp (dt >= time_step_min in its chunked path) the prefill logits move
    by far more than float error: the lifted clamp in the oracle is what makes the two agree."""
    path = tiny_nemotron("nemotron-dense")
    model, cfg = load_model(path)
    clamped = load_hf_model(path, lift_dt_clamp=False)
    prompt = make_prompts(cfg.vocab_size, lengths=(40,))[0]
    _, ours, _ = greedy_generate(model, cfg, [prompt], 1)
    with torch.no_grad():
        theirs = clamped(torch.tensor([prompt])).logits[0]
    assert rel_err(ours, theirs) > 100 * REL_TOL


@pytest.mark.parametrize("preset", ["nemotron-dense", pytest.param("nemotron-moe", marks=pytest.mark.slow)])
def test_batched_prefill_equals_single_rows_bitwise(preset, tiny_nemotron):
    model, cfg = load_model(tiny_nemotron(preset))
    prompts = make_prompts(cfg.vocab_size)
    _, batched, _ = greedy_generate(model, cfg, prompts, 1)
    start = 0
    for p in prompts:
        _, alone, _ = greedy_generate(model, cfg, [p], 1)
        assert torch.equal(batched[start:start + len(p)], alone), f"prompt of length {len(p)} differs"
        start += len(p)


@pytest.mark.parametrize("engine", ["reference", "async"])
def test_engine_greedy_equals_transformers(engine, tiny_nemotron):
    """Both engines, batched with chunked prefill (a 40-token prompt over 16-token steps), against the
    oracle one prompt at a time."""
    path = tiny_nemotron("nemotron-dense")
    hf = load_hf_model(path)
    llm = LLM(model=str(path), engine=engine, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = make_prompts(llm.model_config.vocab_size, lengths=(3, 40, 17))
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy_uncached(hf, prompt, NEW_TOKENS), f"prompt of length {len(prompt)}"


def test_conformance_passes_on_a_nemotron_checkpoint(tiny_nemotron):
    """``conformance run --model`` at K=0 and with scripted drafts (Mamba2 verify over s_0..s_K);
    scenarios drafting with an MTP head are skipped for a model without one."""
    path = str(tiny_nemotron("nemotron-dense"))
    out = io.StringIO()
    args = ["run", "--model", path, "--engine", "async", "--scenario", "short-prompts-k0",
            "--scenario", "scripted-ragged-k3", "--scenario", "short-prompts-k1"]
    assert conformance_main(args, out=out) == 0, out.getvalue()
    text = out.getvalue()
    assert "2 passed, 0 failed" in text and "1 skipped" in text, text
