"""What the host stages for one async step: the row table, and the writes to persistent state.

The host knows a step's scheduling facts (which request slot a row serves, how many tokens it
runs, whether it samples, which checkpoint slots prefix caching held for it); the device knows
everything else. ``StepRows`` is a table of int64 columns ``[N, F]`` in a ``HostBuffer``; after the
copy the device reads it through the record's named views, never through column numbers.

``StagedWrites`` is everything else a step writes into persistent state before its program
(admissions, block-table rows, prefix-cache restores): named pieces of any dtype, their bytes packed
into one host tensor (each piece starting on an 8-byte word), copied to the device in one transfer and
read back as named views in their own dtypes (views only: no conversion runs on the device).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch


class RowTable:
    """Base of a staged record: every dataclass field is one int64 column of an ``[N, F]`` table, except
    the field named by ``wide`` (if any, the last one), which spans every column after the others."""

    wide: ClassVar[str | None] = None

    @classmethod
    def columns(cls) -> tuple[str, ...]:
        """The one-column fields."""
        return tuple(f.name for f in fields(cls) if f.name != cls.wide)

    @classmethod
    def width(cls, wide: int = 0) -> int:
        """F: the table's columns when the wide field spans ``wide`` of them."""
        return len(cls.columns()) + wide

    @classmethod
    def pack(cls, rows: list[dict]) -> list[list[int]]:
        """Host rows (one dict per row, keyed by field; the wide field a list) as table rows."""
        cols = cls.columns()
        return [[int(row[c]) for c in cols] + [int(v) for v in row.get(cls.wide, ())] for row in rows]

    @classmethod
    def view(cls, table: torch.Tensor):
        """The record whose fields are the columns of ``table`` [N, F] (views, no copies)."""
        f = len(cls.columns())
        assert table.dim() == 2 and table.shape[1] >= f, f"{cls.__name__}: table must be [N, F]"
        assert cls.wide is not None or table.shape[1] == f, f"{cls.__name__}: table must be [N, F]"
        named = dict(zip(cls.columns(), table[:, :f].unbind(1)))
        if cls.wide is not None:
            named[cls.wide] = table[:, f:]
        return cls(**named)


@dataclass
class StepRows(RowTable):
    """Per-row facts of one step (N rows, decode rows first; padding rows at the end of a FULL step)."""

    wide: ClassVar[str] = "checkpoint_slots"

    idx: torch.Tensor  # [N] request slot; -1 for a padding row (its gathers read the state's sink row)
    query_len: torch.Tensor  # [N] tokens the row runs (committed tail, then drafts); 0 for padding
    is_decode: torch.Tensor  # [N] 1: the request is past its prompt (contract 2), else 0
    has_initial_state: torch.Tensor  # [N] 1: the request has computed tokens, so its state is live
    is_sampling: torch.Tensor  # [N] 1: the row reaches the request's last token and picks tokens
    # [N] draft positions at the row's tail: the host schedules K per decode row (the device's drafts, fillers
    # past their count); 0 for prefill rows, K for padding
    num_draft_positions: torch.Tensor
    backup_token: torch.Tensor  # [N] the prompt token after a prompt chunk that does not sample, else -1
    # [N] each the entry of the request's block-table row, and the KV block it now holds, of up to two blocks
    # the request got since its last step (-1: none), written by the program; a new owner's whole row, or
    # more blocks, are staged writes instead (``blocks.*``)
    block_at0: torch.Tensor
    block_at1: torch.Tensor
    block_id0: torch.Tensor
    block_id1: torch.Tensor
    # [N, P] prefix caching: the checkpoint slot held for the row's p-th block boundary (the sink slot where
    # none); P = 0 without caching
    checkpoint_slots: torch.Tensor

    @staticmethod
    def inert_values(num_speculative_tokens: int, sink_checkpoints: list[int] = ()) -> dict:
        """A padding row: no request slot, zero tokens, samples nothing, holds no checkpoint (the sink
        slot, ``sink_checkpoints`` [P]). It carries K draft positions so a FULL step's logits count (1 +
        draft positions per row) depends on its padded size only."""
        return {"idx": -1, "query_len": 0, "is_decode": 1, "has_initial_state": 1, "is_sampling": 0,
                "num_draft_positions": num_speculative_tokens, "backup_token": 0, "block_at0": -1,
                "block_at1": -1, "block_id0": 0, "block_id1": 0, "checkpoint_slots": list(sink_checkpoints)}

    @classmethod
    def inert_row(cls, num_speculative_tokens: int, device, sink_checkpoints: list[int] = ()) -> torch.Tensor:
        """[F] the padding row (``inert_values``) on ``device``."""
        values = cls.inert_values(num_speculative_tokens, sink_checkpoints)
        return torch.tensor(cls.pack([values])[0], dtype=torch.int64, device=device)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _words(t: torch.Tensor) -> int:
    """The 8-byte words piece ``t`` takes in the packed tensor."""
    return -(-_nbytes(t) // 8)


class StagedWrites:
    """A step's writes to persistent state, staged on the host: named pieces, each any tensor.

    ``host``: the host buffer ``packed`` packs into (a step's staging buffer, reused two steps later); none:
    ``packed`` returns a new tensor."""

    def __init__(self, host=None):
        self.pieces: dict[str, torch.Tensor] = {}  # name -> host tensor, in the order added
        self.host = host  # a HostBuffer, or None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.pieces:
            raise ValueError(f"staged write {name!r} added twice")
        self.pieces[name] = tensor

    def get(self, name: str) -> torch.Tensor | None:
        return self.pieces.get(name)

    def replace(self, name: str, tensor: torch.Tensor) -> None:
        self.pieces[name] = tensor

    def __bool__(self) -> bool:
        return bool(self.pieces)

    def packed(self) -> torch.Tensor:
        """[W] int64: every piece's bytes, in order, each from an 8-byte word on (zero bytes between)."""
        parts, zeros = [], None
        for t in self.pieces.values():
            parts.append(t.reshape(-1).view(torch.uint8))
            pad = -_nbytes(t) % 8
            if pad:
                zeros = torch.zeros(8, dtype=torch.uint8) if zeros is None else zeros
                parts.append(zeros[:pad])
        words = sum(_words(t) for t in self.pieces.values())
        if self.host is None:
            out = torch.empty(words, dtype=torch.int64)
        else:
            out = self.host.at_least(words)[:words]
        if parts:
            torch.cat(parts, out=out.view(torch.uint8))
        return out

    def unpack(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The pieces as views of ``flat`` (``packed()`` copied to the device), each in its own shape and
        dtype: ``flat`` viewed once per dtype, then one slice per piece (and a view for its shape unless it
        is 1-D), so a step's admissions cost a view or two per piece, not three."""
        out, at, typed = {}, 0, {}
        for name, t in self.pieces.items():
            base = typed.get(t.dtype)
            if base is None:
                base = typed[t.dtype] = flat if t.dtype == torch.int64 else flat.view(t.dtype)
            first = at * (8 // t.element_size())  # pieces start on a word
            piece = base[first: first + t.numel()]
            out[name] = piece if t.dim() == 1 else piece.view(t.shape)
            at += _words(t)
        return out
