"""The model reproduces transformers on tiny checkpoints that transformers itself wrote.

Every layout: Qwen3-Next dense and MoE (every layer sparse, or every second one with a forced-dense
layer and no renormalisation), Qwen3.5 dense and MoE, both multimodal wrappers, tied and untied
heads, odd dims, with and without MTP tensors (tests/helpers/checkpoints.py PRESETS).

Greedy tokens from a batched prefill + decode run (tests/helpers/driver.py) must equal
``generate(do_sample=False)`` run one prompt at a time; prefill and per-step logits must agree to
float tolerance. Both GDN prefill paths (recurrent and chunked) are checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from refengine.model import MTP_CACHE_KEY, load_model
from tests.helpers.checkpoints import PRESETS, load_hf_model
from tests.helpers.driver import Driver, greedy_generate
from tests.helpers.oracle import hf_greedy_uncached

PROMPT_LENGTHS = (1, 3, 17, 40, 70)  # 70 crosses a 64-token chunk of the chunked GDN path
PROMPT_SEED = 6  # chosen so every preset's greedy top-1/top-2 margins stay >= 5e-4
NEW_TOKENS = 32
REL_TOL = 1e-4


def make_prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@dataclass
class Reference:
    prompts: list[list[int]]
    tokens: list[list[int]]  # greedy continuation per prompt
    prefill_logits: list[torch.Tensor]  # [len, V] per prompt, no-cache forward
    step_logits: list[torch.Tensor]  # [NEW_TOKENS, V] per prompt, generate scores


@pytest.fixture(scope="module")
def hf_reference(tiny_checkpoint):
    """``hf_reference(preset) -> Reference``, computed once per module."""
    done: dict[str, Reference] = {}

    def get(preset: str) -> Reference:
        if preset not in done:
            hf = load_hf_model(tiny_checkpoint(preset))
            prompts = make_prompts(hf.config.get_text_config(decoder=True).vocab_size)
            ref = Reference(prompts, [], [], [])
            with torch.no_grad():
                for p in prompts:
                    ids = torch.tensor([p])
                    ref.prefill_logits.append(hf(ids).logits[0].float())
                    out = hf.generate(
                        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                        eos_token_id=None, output_scores=True, return_dict_in_generate=True,
                    )
                    ref.tokens.append(out.sequences[0, len(p):].tolist())
                    ref.step_logits.append(torch.stack(out.scores)[:, 0].float())
            done[preset] = ref
        return done[preset]

    return get


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


# The chunked GDN prefill path does not depend on the MLP or the wrapper: checked on the dense
# presets and one MoE preset (one of them in the default tier); every preset runs the recurrent path.
CHUNKED_PRESETS = ("next-tiny", "next-gqa4-untied", "qwen35-tiny", "next-odd-dims", "next-moe")
CASES = [pytest.param(p, False, id=f"{p}-recurrent") for p in sorted(PRESETS)] + [
    pytest.param(p, True, id=f"{p}-chunked", marks=() if p == "next-tiny" else pytest.mark.slow)
    for p in CHUNKED_PRESETS]


@pytest.mark.parametrize("preset, chunked", CASES)
def test_greedy_and_logits_match_transformers(preset, chunked, tiny_checkpoint, hf_reference):
    ref = hf_reference(preset)
    model, cfg = load_model(tiny_checkpoint(preset))
    tokens, prefill_logits, step_logits = greedy_generate(
        model, cfg, ref.prompts, NEW_TOKENS, chunked=chunked
    )

    for i, (ours, theirs) in enumerate(zip(tokens, ref.tokens)):
        if ours != theirs:
            j = next(k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            pytest.fail(f"prompt {i} (len {len(ref.prompts[i])}): first divergence at new token {j}: "
                        f"ours {ours[max(0, j - 3):j + 3]} vs transformers {theirs[max(0, j - 3):j + 3]}")
    starts = [0]
    for p in ref.prompts:
        starts.append(starts[-1] + len(p))
    for i in range(len(ref.prompts)):
        err = rel_err(prefill_logits[starts[i]:starts[i + 1]], ref.prefill_logits[i])
        assert err <= REL_TOL, f"prompt {i}: prefill logits relative error {err:.2e}"
        err = rel_err(step_logits[i], ref.step_logits[i])
        assert err <= REL_TOL, f"prompt {i}: decode logits relative error {err:.2e}"


UNCACHED_TOKENS = 8


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_greedy_equals_transformers_uncached_forward(preset, tiny_checkpoint, hf_reference):
    """Greedy tokens against transformers' plain forward over the whole sequence, no cache, every step."""
    path = tiny_checkpoint(preset)
    hf = load_hf_model(path)
    model, cfg = load_model(path)
    prompts = hf_reference(preset).prompts[2:4]  # 17 and 40 tokens
    tokens, _, _ = greedy_generate(model, cfg, prompts, UNCACHED_TOKENS)
    for prompt, ours in zip(prompts, tokens):
        assert ours == hf_greedy_uncached(hf, prompt, UNCACHED_TOKENS), f"prompt of length {len(prompt)}"


@pytest.mark.parametrize("chunked", [False, True], ids=["recurrent", "chunked"])
def test_batched_prefill_equals_single_rows_bitwise(chunked, tiny_checkpoint):
    model, cfg = load_model(tiny_checkpoint("next-tiny"))
    prompts = make_prompts(cfg.vocab_size)
    _, batched, _ = greedy_generate(model, cfg, prompts, 1, chunked=chunked)
    start = 0
    for p in prompts:
        _, alone, _ = greedy_generate(model, cfg, [p], 1, chunked=chunked)
        assert torch.equal(batched[start:start + len(p)], alone), f"prompt of length {len(p)} differs"
        start += len(p)


@pytest.mark.parametrize("preset", ["next-tiny", "qwen35-tiny", "next-moe", "qwen35-moe"])
def test_mtp_head_smoke(preset, tiny_checkpoint):
    model, cfg = load_model(tiny_checkpoint(preset))
    assert model.mtp is not None and cfg.num_mtp_layers == 1
    prompts = make_prompts(cfg.vocab_size)[:4]
    driver = Driver(model, cfg, len(prompts), max_len=64)
    hidden, logits, ctx = driver.prefill(prompts)
    last = (ctx.attn.query_start_loc[1:] - 1).long()
    sampled = logits[last].argmax(-1).tolist()
    # Row p pairs token t_{p+1} with hidden h_p at position p; the last slot takes the sampled token.
    shifted = torch.tensor([t for p, s in zip(prompts, sampled) for t in p[1:] + [s]], dtype=torch.int64)
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad():
        out = model.mtp(shifted, hidden, positions, ctx.attn, driver.kv_caches[MTP_CACHE_KEY])
        draft_logits = model.compute_logits(out)
    assert out.shape == hidden.shape
    assert draft_logits.shape == (hidden.shape[0], cfg.vocab_size) and draft_logits.dtype == torch.float32
    assert torch.isfinite(draft_logits).all()
    assert driver.kv_caches[MTP_CACHE_KEY][0].abs().sum() > 0, "the MTP layer did not write its KV cache"


def test_the_oracle_runs_transformers_torch_paths(tiny_checkpoint, tiny_nemotron):
    """transformers swaps flash-linear-attention's, causal-conv1d's or mamba-ssm's kernels in for its torch
    GDN, conv and Mamba2 functions where a package is importable (a GPU runner with the ``bench`` extra):
    CUDA-only kernels the CPU oracle cannot run. The oracle's modeling modules call the torch ones."""
    import sys

    from tests.helpers.nemotron_checkpoints import load_hf_model as load_hf_nemotron

    swapped = []
    oracles = (load_hf_model(tiny_checkpoint("next-tiny")), load_hf_nemotron(tiny_nemotron("nemotron-dense")))
    for hf in oracles:
        module = sys.modules[type(hf).__module__]
        swapped += [f"{module.__name__}.{attr}" for attr, value in vars(module).items()
                    if hasattr(value, "__wrapped__")
                    and getattr(value, "__code__", None) is not None
                    and value.__code__.co_filename.endswith("hub_kernels.py")]
    assert not swapped, f"the oracle would call a kernel package's functions: {swapped}"
