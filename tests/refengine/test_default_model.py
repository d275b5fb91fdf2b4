"""The embedded default model: loads fast, writes readable text, agrees with transformers, and its
MTP drafts are accepted often enough that every accepted count 0..K occurs on the default workload."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from refengine import LLM, SamplingParams
from refengine.llm import default_model_path
from refengine.model import load_model
from refengine.tokenizer import load_tokenizer
from refengine.tools.default_workload import DEFAULT_PROMPTS, default_prompts
from refengine.tools.report import acceptance_stats, run_workload
from tests.helpers.checkpoints import load_hf_model
from tests.helpers.oracle import hf_greedy_loop

K = 3
ACCEPTANCE_LENGTH_BAR = 2.5
PARITY_TOKENS = 24


@pytest.fixture(scope="module")
def path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def workload_runs(path):
    """(K=0 run, K=3 run) of the default workload, shared by the tests below."""
    return run_workload(path, 0), run_workload(path, K)


def test_loads_quickly(path):
    """Prints the load time (not asserted: machines differ). The first load in a process also pays
    one-time torch imports; the second is the load itself."""
    timings = []
    for _ in range(2):
        start = time.perf_counter()
        model, cfg = load_model(path)
        timings.append(time.perf_counter() - start)
    print(f"default model: first load {timings[0] * 1000:.0f} ms, then {timings[1] * 1000:.0f} ms; "
          f"{sum(p.numel() for p in model.parameters())} parameters")
    assert model.mtp is not None and cfg.num_mtp_layers == 1
    assert cfg.eos_token_ids and cfg.model_type == "qwen3_next"


def test_llm_default_generates_printable_text():
    out = LLM().generate("Once upon a time", SamplingParams(max_tokens=48))[0]
    print(repr(out.text))
    assert out.text
    assert all(c.isprintable() or c in "\n\t" for c in out.text)


def test_workload_text_is_mostly_words(workload_runs):
    plain, _ = workload_runs
    for prompt, out in zip(DEFAULT_PROMPTS, plain.outputs):
        assert all(c.isprintable() or c in "\n\t" for c in out.text), (prompt.text, out.text)
        if prompt.kind != "predictable":
            letters = sum(c.isalpha() or c.isspace() for c in out.text)
            assert letters >= 0.8 * len(out.text), (prompt.text, out.text)


def test_tokenizer_round_trip(path):
    tok = load_tokenizer(path)
    text = "Beautiful is better than ugly."
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text) + [tok.eos_token_id]) == text


@pytest.mark.parametrize("k", [0, K])
def test_same_greedy_tokens_as_transformers(path, k):
    hf = load_hf_model(path)
    llm = LLM(path, num_speculative_tokens=k)
    prompts = default_prompts()[::3]
    outs = llm.generate(prompts, SamplingParams(max_tokens=PARITY_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = llm.tokenizer.encode(prompt)
        assert out.token_ids == hf_greedy_loop(hf, ids, PARITY_TOKENS), prompt


def test_speculation_is_lossless_on_workload(workload_runs):
    plain, spec = workload_runs
    for a, b in zip(plain.outputs, spec.outputs):
        assert a.token_ids == b.token_ids


def test_mtp_acceptance_on_default_workload(workload_runs):
    _, spec = workload_runs
    stats = acceptance_stats(spec.outputs, K)
    print(f"acceptance length {stats.acceptance_length:.3f}, per position {stats.position_rates}, "
          f"histogram {stats.histogram}")
    assert all(n > 0 for n in stats.histogram), f"some accepted count never occurs: {stats.histogram}"
    assert stats.acceptance_length >= ACCEPTANCE_LENGTH_BAR


def test_checkpoint_is_small(path):
    size = sum(f.stat().st_size for f in Path(path).iterdir())
    assert size < 5 * 1024 * 1024
