"""A minimal batch driver for model tests: one prefill step, then greedy decode steps.

Each sequence i owns recurrent state slot i and KV blocks ``[i*B, (i+1)*B)`` (contiguous assignment).
This is only scaffolding to exercise the model; the real engine lives in refengine/.
"""

from __future__ import annotations

import torch

from refengine.forward_context import AttnMetadata, ForwardContext, RecurrentGroup, RecurrentMetadata
from refengine.model.cache_specs import PagedKV
from refengine.model.registry import cache_specs


class Driver:
    def __init__(
        self,
        model,
        cfg,
        num_seqs: int,
        max_len: int,
        block_size: int = 16,
        num_spec: int = 0,  # K: extra conv-state columns (kept 0 by the tests)
    ) -> None:
        self.model, self.cfg = model, cfg
        self.block_size = block_size
        self.blocks_per_seq = -(-max_len // block_size)
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        num_blocks = num_seqs * self.blocks_per_seq
        self.kv_caches, self.states = {}, {}  # as the model's family declares them (the drafter's KV too)
        for key, spec in cache_specs(cfg, num_spec, drafter_kv=model.mtp is not None).items():
            if isinstance(spec, PagedKV):
                self.kv_caches[key] = spec.allocate(num_blocks, block_size, dtype, device)
            else:
                self.states[key] = spec.allocate(num_seqs, dtype, device)
        self.device = device
        self.block_table = torch.arange(num_blocks, dtype=torch.int32).view(num_seqs, self.blocks_per_seq)
        self.lengths = [0] * num_seqs  # tokens already in the caches per sequence

    def _context(self, rows: list[int], qlens: list[int], prefill: bool, chunked: bool) -> tuple:
        positions, slots = [], []
        for row, q in zip(rows, qlens):
            for pos in range(self.lengths[row], self.lengths[row] + q):
                positions.append(pos)
                block = int(self.block_table[row, pos // self.block_size])
                slots.append(block * self.block_size + pos % self.block_size)
        cu = [0]
        for q in qlens:
            cu.append(cu[-1] + q)
        dev = self.device

        def i32(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=dev)

        attn = AttnMetadata(
            query_start_loc=i32(cu),
            seq_lens=i32([self.lengths[r] + q for r, q in zip(rows, qlens)]),
            block_table=self.block_table[rows].contiguous().to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        )
        group = RecurrentGroup(
            token_indices=torch.arange(cu[-1], dtype=torch.int64, device=dev),
            query_start_loc=i32(cu),
            state_indices=i32(rows),
            has_initial_state=torch.tensor([self.lengths[r] > 0 for r in rows], device=dev)
            if prefill
            else None,
        )
        gdn = RecurrentMetadata(prefill=group) if prefill else RecurrentMetadata(decode=group)
        ctx = ForwardContext(attn=attn, recurrent=gdn, kv_caches=self.kv_caches, states=self.states,
                             recurrent_prefill_chunked=chunked)
        return ctx, torch.tensor(positions, dtype=torch.int64, device=dev)

    @torch.inference_mode()
    def prefill(
        self, prompts: list[list[int]], chunked: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """Run every prompt in one step. Returns (hidden [T, H], logits [T, V], the step's context)."""
        rows = list(range(len(prompts)))
        ctx, positions = self._context(rows, [len(p) for p in prompts], prefill=True, chunked=chunked)
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=self.device)
        hidden = self.model(ids, positions, ctx)
        for r, p in zip(rows, prompts):
            self.lengths[r] += len(p)
        return hidden, self.model.compute_logits(hidden), ctx

    @torch.inference_mode()
    def decode(self, tokens: list[int]) -> torch.Tensor:
        """One token per sequence. Returns logits [N, V]."""
        rows = list(range(len(tokens)))
        ctx, positions = self._context(rows, [1] * len(tokens), prefill=False, chunked=False)
        hidden = self.model(torch.tensor(tokens, dtype=torch.int64, device=self.device), positions, ctx)
        for r in rows:
            self.lengths[r] += 1
        return self.model.compute_logits(hidden)


def greedy_generate(
    model, cfg, prompts: list[list[int]], max_new_tokens: int,
    chunked: bool = False,
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Batched greedy decoding: one prefill step, then ``max_new_tokens - 1`` decode steps.

    Returns (new tokens per prompt, prefill logits [sum(len), V], step logits [N, max_new_tokens, V])
    where step logits row j produced new token j.
    """
    driver = Driver(model, cfg, len(prompts), max(len(p) for p in prompts) + max_new_tokens)
    _, prefill_logits, ctx = driver.prefill(prompts, chunked=chunked)
    step_logits = [prefill_logits[(ctx.attn.query_start_loc[1:] - 1).long()]]  # [N, V]
    tokens = step_logits[-1].argmax(-1).tolist()
    out = [[t] for t in tokens]
    for _ in range(max_new_tokens - 1):
        step_logits.append(driver.decode(tokens))
        tokens = step_logits[-1].argmax(-1).tolist()
        for seq, t in zip(out, tokens):
            seq.append(t)
    return out, prefill_logits, torch.stack(step_logits, dim=1)
