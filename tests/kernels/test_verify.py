"""greedy_verify: exact checks against an explicit per-row loop; Triton == torch."""

from __future__ import annotations

import pytest
import torch

from kernels.verify import greedy_verify
from tests.kernels.conftest import generator, requires_triton

BACKENDS = ["torch", pytest.param("triton", marks=requires_triton)]


def verify_by_loop(logits, drafts, num_drafts, cu):
    n, k = drafts.shape
    out = torch.full((n, k + 1), -1, dtype=torch.int64)
    num_valid = torch.zeros(n, dtype=torch.int32)
    for i in range(n):
        for j in range(int(num_drafts[i]) + 1):
            row = logits[int(cu[i]) + j].tolist()
            target = row.index(max(row))  # first maximum
            out[i, j] = target
            num_valid[i] = j + 1
            if j == int(num_drafts[i]) or int(drafts[i, j]) != target:
                break
    return out, num_valid


def make_case(num_drafts, k, vocab, accept, seed=0):
    """Drafts per row: ``accept[i]`` leading drafts equal the targets, the next one differs."""
    gen = generator(seed)
    cu = torch.zeros(len(num_drafts) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(num_drafts) + 1, 0)
    logits = torch.randn(int(cu[-1]), vocab, generator=gen)
    targets = logits.argmax(-1)
    drafts = torch.randint(0, vocab, (len(num_drafts), k), generator=gen)
    for i, (nd, a) in enumerate(zip(num_drafts, accept)):
        for j in range(nd):
            t = int(targets[int(cu[i]) + j])
            drafts[i, j] = t if j < a else (t + 1) % vocab
    return logits, drafts, torch.tensor(num_drafts, dtype=torch.int32), cu


CASES = {
    "all-accepted": ([3, 3], 3, 50, [3, 3]),
    "first-rejected": ([3, 3], 3, 50, [0, 0]),
    "middle-rejected": ([4, 4, 4], 4, 50, [1, 2, 3]),
    "zero-drafts": ([0, 0, 0], 3, 50, [0, 0, 0]),
    "zero-K": ([0, 0], 0, 50, [0, 0]),
    "ragged": ([0, 3, 1, 2, 0, 3], 3, 97, [0, 3, 0, 1, 0, 2]),
    "ragged-bonus": ([2, 0, 1], 4, 1500, [2, 0, 1]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_verify(name, backend):
    num_drafts, k, vocab, accept = CASES[name]
    args = make_case(num_drafts, k, vocab, accept)
    out, num_valid = greedy_verify(*args, backend=backend)
    exp_out, exp_valid = verify_by_loop(*args)
    assert out.dtype == torch.int64 and num_valid.dtype == torch.int32
    assert torch.equal(out, exp_out), f"{out} != {exp_out}"
    assert torch.equal(num_valid, exp_valid)
    expected_valid = [min(a, nd) + 1 for nd, a in zip(num_drafts, accept)]
    assert num_valid.tolist() == expected_valid


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_resolve_to_lowest_index(backend):
    vocab = 2500  # the Triton kernel scans the vocabulary in chunks of 1024: ties across chunks
    logits = torch.zeros(4, vocab)
    logits[0, [7, 3, 900]] = 5.0  # tie inside the first chunk -> 3
    logits[1, [2000, 1030]] = 2.0  # tie across chunks -> 1030
    logits[2, [0, 2499]] = 1.0  # first and last entries -> 0
    logits[3] = -1.0  # all equal -> 0
    drafts = torch.tensor([[3, 1030, 0]])
    out, num_valid = greedy_verify(
        logits,
        drafts,
        torch.tensor([3], dtype=torch.int32),
        torch.tensor([0, 4], dtype=torch.int32),
        backend=backend,
    )
    assert out.tolist() == [[3, 1030, 0, 0]] and num_valid.tolist() == [4]
    assert torch.equal(logits.argmax(-1), torch.tensor([3, 1030, 0, 0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_drafts_past_num_drafts_are_ignored(backend):
    logits, drafts, num_drafts, cu = make_case([1, 2], 3, 30, [1, 2])
    drafts[0, 1:] = 29  # garbage past row 0's single draft
    drafts[1, 2] = -5
    out, num_valid = greedy_verify(logits, drafts, num_drafts, cu, backend=backend)
    assert num_valid.tolist() == [2, 3]
    assert out[0, 2:].tolist() == [-1, -1] and out[1, 3].item() == -1


@requires_triton
def test_triton_matches_torch_random():
    gen = generator(3)
    num_drafts = torch.randint(0, 5, (16,), generator=gen).int()
    # Accept with high probability so rows reach every depth: small vocab, drafts from targets.
    cu = torch.zeros(17, dtype=torch.int32)
    cu[1:] = torch.cumsum(num_drafts + 1, 0)
    logits = torch.randn(int(cu[-1]), 300, generator=gen)
    targets = logits.argmax(-1)
    drafts = torch.zeros(16, 4, dtype=torch.int64)
    for i in range(16):
        for j in range(int(num_drafts[i])):
            drafts[i, j] = targets[int(cu[i]) + j] if torch.rand(1, generator=gen) < 0.8 else 0
    ref = greedy_verify(logits, drafts, num_drafts, cu, backend="torch")
    tri = greedy_verify(logits, drafts, num_drafts, cu, backend="triton")
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])
