"""The per-step tensor contract between a runner and the model.

Both runners build a ``ForwardContext`` and hand it to the model: the reference runner with plain
loops on the host, the async runner with device-side preparation into static buffers. The model
reads nothing else about the batch. Shapes: ``T`` tokens in the step, ``N`` rows (requests,
including padding rows), ``K`` speculative tokens, ``S`` state slots.

Two kinds of per-step metadata serve every mixer (see ``refengine.model.cache_specs``): paged
attention reads ``AttnMetadata``; every recurrent mixer (GDN and Mamba2) reads the same
``RecurrentMetadata``, its rows split into a prefill group and a decode group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttnMetadata:
    """Paged-attention inputs, shared by every full-attention layer (and the MTP layer)."""

    query_start_loc: torch.Tensor  # [N+1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [N] int32, context length including this step's tokens
    block_table: torch.Tensor  # [N, max_blocks] int32, KV block ids per row
    slot_mapping: torch.Tensor  # [T] int64, KV slot per token, PAD_SLOT_ID for padding tokens


@dataclass
class RecurrentGroup:
    """One group of rows that share a recurrent kernel path.

    Tokens of the group are gathered from the flat token axis with ``token_indices``; the group's
    own ``query_start_loc`` indexes the gathered tokens.
    """

    token_indices: torch.Tensor  # [Tg] int64, positions in the flat token axis
    query_start_loc: torch.Tensor  # [Ng+1] int32, over the gathered tokens
    state_indices: torch.Tensor  # [Ng] int32 (plain rows) or [Ng, K+1] int32 (speculative rows)
    has_initial_state: torch.Tensor | None = None  # [Ng] bool; prefill group only
    num_valid: torch.Tensor | None = None  # [Ng] int32, tokens the previous step kept (bonus included);
    # speculative decode group only (vLLM's kernels call it ``num_accepted_tokens``).
    # (start, stop) on the host where ``token_indices`` is that range of the flat axis (the async engine's
    # groups): the group's tokens are then a view (``gather``), not a copy; None: gathered by index.
    token_range: tuple[int, int] | None = None

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The group's rows of ``x`` [T, ...] -> [Tg, ...] (a view where the group is a range)."""
        if self.token_range is None:
            return x.index_select(0, self.token_indices)
        start, stop = self.token_range
        return x[start:stop]


def scatter_groups(outputs: list[tuple[RecurrentGroup, torch.Tensor]], like: torch.Tensor,
                   shape: tuple[int, ...]) -> torch.Tensor:
    """Each group's output [Tg, ...] at its tokens of a [T, ...] = ``shape`` tensor (``like``'s dtype and
    device), zeros where no group has a token (padding). One group that is the whole axis: its output."""
    if len(outputs) == 1 and outputs[0][0].token_range == (0, shape[0]):
        return outputs[0][1]
    out = like.new_zeros(shape)
    for group, y in outputs:
        if group.token_range is None:
            out.index_copy_(0, group.token_indices, y)
        else:
            out[group.token_range[0]:group.token_range[1]] = y
    return out


@dataclass
class RecurrentMetadata:
    """Rows split by classification (contract 2).

    ``prefill``: rows that run the prefill form (whole-sequence conv and recurrence) and start
    from ``has_initial_state`` (False iff the request has no computed tokens).
    ``decode``: rows of requests that finished their prompt; they run the update form and read
    their state at offset ``num_valid - 1`` (contract 1).
    """

    prefill: RecurrentGroup | None = None
    decode: RecurrentGroup | None = None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """``"group.field" -> shape`` of every per-request tensor handed to the recurrent kernels."""
        out = {}
        for name, group in (("prefill", self.prefill), ("decode", self.decode)):
            if group is None:
                continue
            for field_name in ("query_start_loc", "state_indices", "has_initial_state", "num_valid"):
                value = getattr(group, field_name)
                if value is not None:
                    out[f"{name}.{field_name}"] = tuple(value.shape)
        return out


@dataclass
class ForwardContext:
    attn: AttnMetadata
    recurrent: RecurrentMetadata
    # Per-layer caches, keyed by decoder layer index ("mtp" for the MTP layer's KV cache).
    kv_caches: dict = field(default_factory=dict)  # idx -> (k_cache, v_cache) [blocks, block_size, Hkv, D]
    states: dict = field(default_factory=dict)  # idx -> the mixer's state tensors, each [S, ...]
    recurrent_prefill_chunked: bool = False  # prefill group: chunked kernels (True) or the recurrent form
    # Auxiliary hidden states (EAGLE-3's input): the layer ids i whose input (the residual stream after i
    # layers, vLLM's ``hidden + residual``) the model appends to ``aux_hidden``, in the order of
    # ``aux_layers`` (each [T, H]); empty: the model captures nothing. A model calls ``capture_aux``.
    aux_layers: tuple[int, ...] = ()
    aux_hidden: list = field(default_factory=list)  # [T, H] per id of ``aux_layers``, once the model ran
    # A piecewise step's runner of the token-wise pieces (``refengine.model.pieces``): ``pieces(key, fn,
    # *inputs)`` returns what ``fn(*inputs)`` returns, from a graph captured once per key and input shapes
    # (``refengine.async_engine.graphs.PieceGraphs``); None: every piece runs eagerly.
    pieces: object = None

    def capture_aux(self, layer: int, x: torch.Tensor) -> None:
        """A model calls it before decoder layer ``layer`` with the residual stream ``x`` [T, H] entering."""
        if layer in self.aux_layers:
            self.aux_hidden.append(x)

    def aux_hidden_states(self) -> torch.Tensor:
        """[T, n*H] the captured states concatenated in ``aux_layers`` order (ids sorted by the drafter)."""
        if len(self.aux_hidden) != len(self.aux_layers):
            raise ValueError(f"aux hidden states: captured {len(self.aux_hidden)} of layers "
                             f"{self.aux_layers} (an id at or past the model's layer count?)")
        return torch.cat(self.aux_hidden, dim=-1)
