"""``greedy_verify``: greedy acceptance of speculative draft tokens."""

from __future__ import annotations

import torch

from kernels._dispatch import resolve_backend
from kernels.verify.naive import naive_greedy_verify


def greedy_verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    cu_num_logits: torch.Tensor,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``target_logits [num_logits, V]``, ``draft_tokens`` int64 ``[N, K]``, ``num_draft_tokens [N]``,
    ``cu_num_logits`` int32 ``[N+1]`` -> ``(output_tokens int64 [N, K+1], num_valid int32 [N])``.

    Target token j of row i is the argmax (lowest index on ties) of logits row
    ``cu_num_logits[i] + j``; the row emits target tokens up to and including the first mismatch
    with its drafts (or the bonus token when all match), then ``-1`` placeholders.
    """
    tensors = (target_logits, draft_tokens, num_draft_tokens, cu_num_logits)
    if resolve_backend(backend, *tensors) == "torch":
        return naive_greedy_verify(*tensors)
    from kernels.verify.triton_greedy_verify import triton_greedy_verify

    return triton_greedy_verify(*tensors)


__all__ = ["greedy_verify", "naive_greedy_verify"]
