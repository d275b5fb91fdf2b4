"""Attention and GDN metadata for one step, built on the device, padded for graph replays.

Rows come in persistent-batch order: decode rows first, then prefill rows. In a FULL replay every
per-request tensor is sized by the graph's padded *request* count and padded with inert values:
``PAD_SLOT_ID`` state indices, accepted count 1, repeated ``query_start_loc``, seq_len 0. Per-token
tensors are sized by the padded token count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import PAD_SLOT_ID
from refengine.async_engine.graphs import StepShape
from refengine.async_engine.state import DeviceState
from refengine.config import GraphMode
from refengine.forward_context import AttnMetadata, RecurrentGroup, RecurrentMetadata


@dataclass
class StepTensors:
    """A step's device inputs (N = padded rows, T = padded tokens)."""

    idx_mapping: torch.Tensor  # [N] int32, request slot per row, -1 for padding rows
    query_start_loc: torch.Tensor  # [N+1] int32
    is_decode: torch.Tensor  # [N] bool
    has_initial_state: torch.Tensor  # [N] bool
    seq_lens: torch.Tensor  # [N] int32
    slot_mapping: torch.Tensor  # [T] int64


class MetadataBuilder:
    def __init__(self, state: DeviceState, num_spec_tokens: int, device: torch.device):
        self.state = state
        self.k = num_spec_tokens
        self.device = device

    def per_request_rows(self, shape: StepShape) -> int:
        """Rows every per-request tensor has: the padded request count (contract 6)."""
        return shape.num_reqs_padded

    def build(self, t: StepTensors, shape: StepShape, num_decode: int,
              qsl_host: list[int]) -> tuple[AttnMetadata, RecurrentMetadata]:
        dev = self.device
        rows = self.per_request_rows(shape)
        idx, qsl = pad_rows(t.idx_mapping, rows, -1), pad_qsl(t.query_start_loc, rows)
        real = idx >= 0
        safe = idx.long().clamp(min=0)
        block_table = torch.where(real[:, None], self.state.block_table[safe], 0)
        attn = AttnMetadata(query_start_loc=qsl, seq_lens=pad_rows(t.seq_lens, rows, 0),
                            block_table=block_table, slot_mapping=t.slot_mapping)

        recurrent = RecurrentMetadata()
        full = shape.mode is GraphMode.FULL
        decode_rows = rows if full else num_decode
        if decode_rows:
            d_idx = idx[:decode_rows]
            d_real = d_idx >= 0
            slots = self.state.state_slots[d_idx.long().clamp(min=0)]
            slots = torch.where(d_real[:, None], slots, torch.full_like(slots, PAD_SLOT_ID))
            accepted = None
            if self.k:
                # Accepted counts keyed by request slot, from the device (contract 3); 1 for padding.
                acc = self.state.num_valid[d_idx.long().clamp(min=0)]
                accepted = torch.where(d_real, acc, torch.ones_like(acc)).to(torch.int32)
            end = shape.num_tokens_padded if full else qsl_host[num_decode]
            recurrent.decode = RecurrentGroup(
                token_indices=torch.arange(0, end, dtype=torch.int64, device=dev),
                query_start_loc=qsl[: decode_rows + 1],
                state_indices=slots if self.k else slots[:, 0].contiguous(),
                num_accepted_tokens=accepted,
            )
        n = shape.num_reqs
        if n > num_decode:
            start, stop = qsl_host[num_decode], qsl_host[n]
            p_idx = t.idx_mapping[num_decode:n].long()
            recurrent.prefill = RecurrentGroup(
                token_indices=torch.arange(start, stop, dtype=torch.int64, device=dev),
                query_start_loc=t.query_start_loc[num_decode: n + 1] - start,
                state_indices=self.state.state_slots[p_idx, 0].contiguous(),
                has_initial_state=t.has_initial_state[num_decode:n],
            )
        return attn, recurrent


def pad_rows(x: torch.Tensor, rows: int, value) -> torch.Tensor:
    """``x`` cut or padded with ``value`` to ``rows`` leading entries."""
    if x.shape[0] >= rows:
        return x[:rows]
    return torch.cat([x, torch.full((rows - x.shape[0], *x.shape[1:]), value, dtype=x.dtype, device=x.device)])


def pad_qsl(qsl: torch.Tensor, rows: int) -> torch.Tensor:
    """``query_start_loc`` for ``rows`` rows: padding rows repeat the last value (zero tokens)."""
    if qsl.shape[0] >= rows + 1:
        return qsl[: rows + 1]
    return torch.cat([qsl, qsl[-1:].expand(rows + 1 - qsl.shape[0])])
