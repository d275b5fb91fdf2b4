"""The real-size tier: random-weight MoE checkpoints at real per-rank shapes; both engines token-exact.

On a GPU (``gpu`` + ``nightly``): Qwen3-Next-80B-like and Qwen3.5-MoE-like checkpoints (hidden 2048,
Dk = Dv = 128, 16/32 GDN heads, 512 / 256 experts, few layers) in bfloat16. On CPU, in the default
tier: the same structures at small widths in float32. The async engine (and MTP speculation in
both) must give exactly the reference engine's tokens.
"""

from __future__ import annotations

import pytest
import torch

from refengine import LLM, SamplingParams
from tests.helpers.random_checkpoint import (
    NEXT_80B_LIKE,
    NEXT_SMALL,
    QWEN35_MOE_LIKE,
    QWEN35_MOE_SMALL,
    write_random_checkpoint,
)

PROMPT_LENGTHS = (1, 5, 23, 70)


def prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def run(path, engine: str, k: int, items, max_tokens: int, **options) -> list[list[int]]:
    llm = LLM(path, engine=engine, num_speculative_tokens=k, max_num_seqs=4, max_num_batched_tokens=64,
              **options)
    outs = llm.generate(items, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [o.token_ids for o in outs]


def logits_digests(path, items, max_tokens: int, **options) -> list[list[tuple[int, str]]]:
    """Per prompt, (tokens computed before the step, hash of the step's logits), all prompts in one batch."""
    seen: dict[str, list[tuple[int, str]]] = {}

    def observe(record) -> None:
        for row in record.rows:
            if row.logits_digest is not None:
                seen.setdefault(row.request_id, []).append((row.num_computed_tokens, row.logits_digest))

    llm = LLM(path, max_num_seqs=len(items), max_num_batched_tokens=256, observer=observe, **options)
    outs = llm.generate(items, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [seen[o.request_id] for o in outs]


def check_batch_invariance(path, vocab_size: int, max_tokens: int, **options) -> None:
    """A prompt's logits are bitwise the same alone and batched with the others (MoE experts shared)."""
    items = prompts(vocab_size)
    together = logits_digests(path, items, max_tokens, **options)
    for i, item in enumerate(items):
        alone = logits_digests(path, [item], max_tokens, **options)[0]
        assert alone == together[i], f"prompt {i} (length {len(item)}): logits depend on the batch"


def check_engines_agree(path, vocab_size: int, max_tokens: int, **options) -> None:
    items = prompts(vocab_size)
    reference = run(path, "reference", 0, items, max_tokens, **options)
    assert all(len(t) == max_tokens for t in reference)
    assert len({tuple(t) for t in reference}) > 1, "every prompt gave the same tokens: a degenerate model"
    for engine, k in (("async", 0), ("reference", 2), ("async", 2)):
        assert run(path, engine, k, items, max_tokens, **options) == reference, f"{engine} K={k} differs"


@pytest.mark.parametrize("spec", [NEXT_SMALL, QWEN35_MOE_SMALL], ids=["next-80b-small", "qwen35-moe-small"])
def test_small_real_structure_engines_agree_fp32(spec, tmp_path):
    path = write_random_checkpoint(tmp_path / "ckpt", spec, torch.float32)
    check_engines_agree(str(path), spec.config["vocab_size"], max_tokens=12, dtype="auto")
    check_batch_invariance(str(path), spec.config["vocab_size"], max_tokens=4, dtype="auto")


@pytest.mark.gpu
@pytest.mark.nightly
@pytest.mark.parametrize("spec", [NEXT_80B_LIKE, QWEN35_MOE_LIKE], ids=["next-80b", "qwen35-moe"])
def test_real_size_engines_agree_bf16(spec, tmp_path):
    path = write_random_checkpoint(tmp_path / "ckpt", spec, torch.bfloat16)
    check_engines_agree(str(path), spec.config["vocab_size"], max_tokens=24, dtype="auto", device="cuda")
    check_batch_invariance(str(path), spec.config["vocab_size"], max_tokens=8, dtype="auto", device="cuda")
