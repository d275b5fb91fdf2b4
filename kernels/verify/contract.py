"""Input contract of ``greedy_verify`` (kernels/_contract.py), called first by both backends."""

from __future__ import annotations

from kernels._contract import FLOATS, INDEX, Contract


def check_greedy_verify_inputs(target_logits, draft_tokens, num_draft_tokens,
                               cu_num_logits) -> tuple[int, int]:
    """The contract of ``greedy_verify`` (kernels/README.md); returns (N, K)."""
    c = Contract("greedy_verify")
    c.tensor("target_logits", target_logits, FLOATS, "num_logits, V")
    c.at_least("target_logits", "V", 1)
    c.tensor("draft_tokens", draft_tokens, INDEX, "N, K")
    c.tensor("num_draft_tokens", num_draft_tokens, INDEX, "N")
    c.offsets("cu_num_logits", cu_num_logits)
    return c.sizes["N"], c.sizes["K"]
