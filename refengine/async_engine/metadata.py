"""Attention and recurrent metadata for one step, built on the device, padded for graph replays.

Rows come in persistent-batch order: decode rows first, then prefill rows. Every per-request tensor
is sized by the step's padded *request* count, and padding rows carry inert values:
``PAD_SLOT_ID`` state indices, ``num_valid`` 1, repeated ``query_start_loc``, seq_len 0 and the
sink block in the block table. Per-token tensors are sized by the padded token count.
"""

from __future__ import annotations

import torch

from kernels import PAD_SLOT_ID
from refengine.async_engine.graphs import StepShape
from refengine.async_engine.inputs import StepRows
from refengine.async_engine.state import DeviceState
from refengine.forward_context import AttnMetadata, RecurrentGroup, RecurrentMetadata


class MetadataBuilder:
    def __init__(self, state: DeviceState, num_speculative_tokens: int, device: torch.device):
        self.state = state
        self.num_speculative_tokens = num_speculative_tokens
        self.device = device

    def build(self, shape: StepShape, rows: StepRows, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              slot_mapping: torch.Tensor) -> tuple[AttnMetadata, RecurrentMetadata]:
        """Rows ``[:num_decode_rows]`` form the decode group, the rest (eager steps only) the prefill group.

        ``rows``: the step's padded row table [N]; ``query_start_loc`` [N+1] int32, ``seq_lens`` [N] int32 and
        ``slot_mapping`` [T] int64 as ``kernels.input_prep.prepare_inputs`` made them.

        Every per-request tensor has ``num_reqs_padded`` rows (contract 6); padding rows read the
        state's sink row, write the sink block (attention) and the NULL slot (recurrent state).
        """
        dev, st = self.device, self.state
        real = rows.idx >= 0
        idx = rows.idx.long()  # -1 (padding) gathers the sink row
        block_table = torch.where(real[:, None], st.block_table[idx], st.sink_block)
        attn = AttnMetadata(query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                            slot_mapping=slot_mapping)

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
                query_start_loc=query_start_loc[: nd + 1],
                state_indices=slots if self.num_speculative_tokens else slots[:, 0].contiguous(),
                num_valid=num_valid,
                token_range=(0, shape.num_decode_tokens),
            )
        if n_pad > nd:
            start, stop = shape.num_decode_tokens, shape.num_tokens
            recurrent.prefill = RecurrentGroup(
                token_indices=torch.arange(start, stop, dtype=torch.int64, device=dev),
                query_start_loc=query_start_loc[nd:] - start,
                state_indices=st.state_slots[idx[nd:], 0].contiguous(),
                has_initial_state=rows.has_initial_state[nd:].bool(),
                token_range=(start, stop),
            )
        return attn, recurrent
