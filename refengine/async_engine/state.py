"""Persistent per-request state on the device, keyed by request slot (not by batch row).

The device copy is authoritative: the verifier's output updates it in place on the device, so a
step scheduled before the previous step's results are known still reads the right positions,
tokens and state offsets. The host only stages writes for newly admitted requests and block-table
growth; it never reads these tensors to build inputs.
"""

from __future__ import annotations

import torch

from refengine.async_engine.processing import ProcessorState
from refengine.async_engine.sampling_rows import SamplingRows


class RequestSlots:
    """Hands out request slots (rows of the persistent tensors)."""

    def __init__(self, num_slots: int):
        self._free = list(range(num_slots - 1, -1, -1))

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free request slot: more running requests than max_num_seqs")
        return self._free.pop()

    def free(self, idx: int) -> None:
        self._free.append(idx)

    @property
    def num_free(self) -> int:
        return len(self._free)


class DeviceState:
    """``R = num_slots + 1`` rows: one per request slot, and a sink row (the last, so request slot -1
    gathers it) that padding rows of a FULL step read and write, so a padded program needs no masks
    around its gathers and scatters. Block-table entries a request does not own hold ``sink_block``,
    a KV block no request is ever given."""

    def __init__(self, num_slots: int, max_len: int, max_blocks: int, num_speculative_tokens: int,
                 sink_block: int, device: torch.device, vocab_size: int = 1):
        i32 = {"dtype": torch.int32, "device": device}
        i64 = {"dtype": torch.int64, "device": device}
        self.sink = num_slots
        self.sink_block = sink_block
        num_slots += 1
        self.num_computed = torch.zeros(num_slots, **i32)  # [R] committed tokens whose KV/state is written
        self.num_tokens = torch.zeros(num_slots, **i32)  # [R] committed tokens (prompt + outputs)
        self.num_prompt = torch.zeros(num_slots, **i32)  # [R] original prompt length
        self.num_valid = torch.ones(num_slots, **i32)  # [R] tokens the previous step kept (bonus included)
        self.last_sampled = torch.zeros(num_slots, **i64)  # [R] last committed token
        self.draft_tokens = torch.zeros(num_slots, num_speculative_tokens, **i64)  # [R, K] next step's drafts
        self.num_drafts = torch.zeros(num_slots, **i32)  # [R] how many of them were proposed (0..K)
        self.token_ids = torch.full((num_slots, max_len), -1, **i64)  # [R, L] committed tokens, -1 beyond
        self.block_table = torch.full((num_slots, max_blocks), sink_block, **i32)  # [R, B] KV block ids
        # [R, K+1] slots s_0..s_K
        self.state_slots = torch.zeros(num_slots, 1 + num_speculative_tokens, **i32)
        # the requests' logits processors (masks, bias, penalty counts, min_tokens, bad words), per slot
        self.processors = ProcessorState(num_slots, vocab_size, device)
        self.sampling = SamplingRows(num_slots, device)  # temperature, top-k/p, min-p and seed, per slot

    def admit(
        self,
        idx: torch.Tensor,
        token_rows: torch.Tensor,
        num_tokens: torch.Tensor,
        num_prompt: torch.Tensor,
        slots: torch.Tensor,
        num_computed: torch.Tensor,
    ) -> None:
        """Reset the rows of newly admitted (or resumed) requests; runs on the device timeline.
        ``num_computed``: tokens a prefix-cache hit serves (0 without one)."""
        idx = idx.long()
        self.num_computed[idx] = num_computed
        self.num_tokens[idx] = num_tokens
        self.num_prompt[idx] = num_prompt
        self.num_valid[idx] = 1
        self.num_drafts[idx] = 0
        self.token_ids[idx] = token_rows
        self.state_slots[idx] = slots
