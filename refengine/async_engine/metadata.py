"""Attention and recurrent metadata for one step, built on the device, padded for graph replays.

Rows come in persistent-batch order: decode rows first, then prefill rows. Every per-request tensor
is sized by the step's padded *request* count, and padding rows carry inert values:
``PAD_SLOT_ID`` state indices, ``num_valid`` 1, repeated ``query_start_loc``, seq_len 0 and the
sink block in the block table. Per-token tensors are sized by the padded token count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import PAD_SLOT_ID
from refengine.async_engine.graphs import StepShape
from refengine.async_engine.state import DeviceState
from refengine.forward_context import AttnMetadata, RecurrentGroup, RecurrentMetadata


@dataclass
class StepTensors:
    """A step's device inputs (N = padded rows, T = padded tokens)."""

    idx_mapping: torch.Tensor  # [N] int32, request slot per row, -1 for padding rows
    query_start_loc: torch.Tensor  # [N+1] int32
    has_initial_state: torch.Tensor  # [N] bool
    seq_lens: torch.Tensor  # [N] int32
    slot_mapping: torch.Tensor  # [T] int64


class MetadataBuilder:
    def __init__(self, state: DeviceState, num_speculative_tokens: int, device: torch.device):
        self.state = state
        self.num_speculative_tokens = num_speculative_tokens
        self.device = device

    def build(self, t: StepTensors, shape: StepShape) -> tuple[AttnMetadata, RecurrentMetadata]:
        """Rows ``[:num_decode_rows]`` form the decode group, the rest (eager steps only) the prefill group.

        Every per-request tensor has ``num_reqs_padded`` rows (contract 6); padding rows read the
        state's sink row, write the sink block (attention) and the NULL slot (recurrent state).
        """
        dev, st = self.device, self.state
        real = t.idx_mapping >= 0
        idx = t.idx_mapping.long()  # -1 (padding) gathers the sink row
        block_table = torch.where(real[:, None], st.block_table[idx], st.sink_block)
        attn = AttnMetadata(query_start_loc=t.query_start_loc, seq_lens=t.seq_lens, block_table=block_table,
                            slot_mapping=t.slot_mapping)

        recurrent = RecurrentMetadata()
        nd, n_pad = shape.num_decode_rows, shape.num_reqs_padded
        if nd:
            d_real = real[:nd]
            slots = st.state_slots[idx[:nd]]
            slots = torch.where(d_real[:, None], slots, torch.full_like(slots, PAD_SLOT_ID))
            num_valid = None
            if self.num_speculative_tokens:
                # Kept counts keyed by request slot, from the device (contract 3); 1 for padding.
                kept = st.num_valid[idx[:nd]]
                num_valid = torch.where(d_real, kept, torch.ones_like(kept)).to(torch.int32)
            recurrent.decode = RecurrentGroup(
                token_indices=torch.arange(0, shape.num_decode_tokens, dtype=torch.int64, device=dev),
                query_start_loc=t.query_start_loc[: nd + 1],
                state_indices=slots if self.num_speculative_tokens else slots[:, 0].contiguous(),
                num_valid=num_valid,
            )
        if n_pad > nd:
            start, stop = shape.num_decode_tokens, shape.num_tokens
            recurrent.prefill = RecurrentGroup(
                token_indices=torch.arange(start, stop, dtype=torch.int64, device=dev),
                query_start_loc=t.query_start_loc[nd:] - start,
                state_indices=st.state_slots[idx[nd:], 0].contiguous(),
                has_initial_state=t.has_initial_state[nd:],
            )
        return attn, recurrent
